"""Checkpointer across real ranks: gloo process groups, DDP and FSDP2 models, SIGTERM, SIGKILL.

Each test starts its ranks as separate Python processes (RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT, as torchrun sets them) running this module's ``__main__`` worker, so a rank can
be signalled or killed from outside like a real preempted or crashed worker.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

REPO_ROOT = Path(__file__).resolve().parents[2]
WORLD = 2


# -- the worker (runs in each rank process) ---------------------------------------------


class Loader:
    """Per-rank batches that depend on the position; plain JSON state like the real loader."""

    def __init__(self, rank):
        self.rank = rank
        self.position = 0

    def next_batch(self):
        import torch

        gen = torch.Generator().manual_seed(self.position * 1000 + self.rank)
        self.position += 1
        return torch.randn(16, 6, generator=gen), torch.randn(16, 2, generator=gen)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def _build(kind, seed):
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.25), nn.ReLU(), nn.Linear(32, 2))
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return dict(model=model, optimizer=opt, scheduler=sched, loader=Loader(dist.get_rank()))


def _train_step(state):
    x, y = state["loader"].next_batch()
    loss = ((state["model"](x) - y) ** 2).mean()  # dropout: depends on the restored RNG
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()
    state["scheduler"].step()
    return loss.item()


def _full_model_state(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class _PausingDirectory:
    """Builds a store whose writer stops mid-save of one step, so a test can kill it there."""

    @staticmethod
    def make(pause_step, pause_at, signal_file):
        from sparkgpu.train.checkpoint_directory import CheckpointDirectory

        class PausingDirectory(CheckpointDirectory):
            def writer(self, path, thread_count):
                writer = super().writer(path, thread_count)
                if not path.endswith(f"step-{pause_step:010d}"):
                    return writer
                original = getattr(writer, pause_at)

                def paused(*args, **kwargs):
                    result = original(*args, **kwargs)
                    # Data (write_data) or DCP's .metadata (finish) is on disk now; the
                    # commit marker is not.
                    Path(signal_file).write_text(str(os.getpid()))
                    time.sleep(600)
                    return result

                setattr(writer, pause_at, paused)
                return writer

        return PausingDirectory


def worker_main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["train", "stop", "kill"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kind", default="ddp")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-steps", default="")
    parser.add_argument("--restore", action="store_true")
    parser.add_argument("--pause-at", default="finish")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from sparkgpu.train import Checkpointer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    state = _build(args.kind, args.seed)
    result = {"rank": rank}

    if args.scenario == "train":
        ckpt = Checkpointer(args.dir)
        start = ckpt.restore(**state) if args.restore else 0
        save_steps = {int(s) for s in args.save_steps.split(",") if s}
        losses = {}
        for step in range(start, args.steps):
            losses[step] = _train_step(state)
            if step in save_steps:
                ckpt.save(step, extras={"loss": losses[step]}, **state)
        ckpt.close()
        result.update(start=start, losses=losses, blocking=ckpt.last_blocking_seconds)
        full = _full_model_state(state["model"])
        if rank == 0:
            torch.save(full, out.with_suffix(".model.pt"))

    elif args.scenario == "stop":
        ckpt = Checkpointer(args.dir, every_steps=10_000)
        stopped = None
        for step in range(100_000):
            _train_step(state)
            if step == 2:
                Path(f"{out}.ready").write_text("")
            if ckpt.maybe_save(step, **state) and ckpt.should_stop:
                stopped = step
                break
            time.sleep(0.02)
        ckpt.close()
        result.update(stopped=stopped)

    elif args.scenario == "kill":
        Checkpointer.directory_cls = _PausingDirectory.make(7, args.pause_at, f"{out}.paused")
        ckpt = Checkpointer(args.dir)
        for _ in range(4):
            _train_step(state)
        ckpt.save(3, wait=True, **state)
        full = _full_model_state(state["model"])
        if rank == 0:
            torch.save(full, out.with_suffix(".model.pt"))
        for _ in range(4, 8):
            _train_step(state)
        ckpt.save(7, **state)
        ckpt.wait()  # never returns: the test kills this process while step 7 is written
        raise AssertionError("the save of step 7 was expected to pause until killed")

    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# -- the tests (run in the pytest process) ----------------------------------------------


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(tmp_path, name, *args, world=WORLD):
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO_ROOT),
        )
        log = open(tmp_path / f"{name}.rank{rank}.log", "wb")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.integration.test_checkpoint_multirank", *args],
                env=env,
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        log.close()
    return procs


def _logs(tmp_path, name):
    return "\n".join(
        f"--- rank {rank} ---\n" + (tmp_path / f"{name}.rank{rank}.log").read_text()[-4000:] for rank in range(WORLD)
    )


def _wait(procs, tmp_path, name, timeout=180):
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"{name} did not finish in {timeout} s\n{_logs(tmp_path, name)}")
    codes = [proc.returncode for proc in procs]
    assert codes == [0] * len(procs), f"{name} exit codes {codes}\n{_logs(tmp_path, name)}"


def _results(out):
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(WORLD)]


def _wait_for_file(path, procs, tmp_path, name, timeout=120):
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            pytest.fail(f"{name}: {path} never appeared\n{_logs(tmp_path, name)}")
        time.sleep(0.05)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_restarted_job_trains_exactly_like_an_uninterrupted_one(tmp_path, kind):
    import torch

    from sparkgpu.train import Checkpointer, latest_checkpoint

    ckpt_dir, ref_out, resumed_out = tmp_path / "ckpt", tmp_path / "reference", tmp_path / "resumed"
    # Attempt 1 saves (asynchronously) after step 4 and trains on to step 9 without saving:
    # its steps 5..9 are what an uninterrupted job computes.
    procs = _launch(
        tmp_path,
        "reference",
        "train",
        "--kind",
        kind,
        "--dir",
        str(ckpt_dir),
        "--out",
        str(ref_out),
        "--steps",
        "10",
        "--save-steps",
        "4",
    )
    _wait(procs, tmp_path, "reference")
    assert latest_checkpoint(ckpt_dir).step == 4 and latest_checkpoint(ckpt_dir).world_size == WORLD

    # Attempt 2 starts from other initial weights, restores step 4 and redoes 5..9.
    procs = _launch(
        tmp_path,
        "resumed",
        "train",
        "--kind",
        kind,
        "--dir",
        str(ckpt_dir),
        "--out",
        str(resumed_out),
        "--steps",
        "10",
        "--save-steps",
        "9",
        "--restore",
        "--seed",
        "1",
    )
    _wait(procs, tmp_path, "resumed")

    reference, resumed = _results(ref_out), _results(resumed_out)
    for ref, res in zip(reference, resumed):
        assert res["start"] == 5
        expected = {step: loss for step, loss in ref["losses"].items() if int(step) >= 5}
        assert res["losses"] == expected, f"rank {res['rank']}"
        assert ref["blocking"] is not None
    ref_model = torch.load(ref_out.with_suffix(".model.pt"))
    res_model = torch.load(resumed_out.with_suffix(".model.pt"))
    for name in ref_model:
        assert torch.equal(ref_model[name], res_model[name]), name

    # The sharded / replicated checkpoint of step 9 loads into a plain module in one process.
    from torch import nn

    plain = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.25), nn.ReLU(), nn.Linear(32, 2))
    assert Checkpointer(ckpt_dir).restore(model=plain) == 10
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, res_model[name]), name


def test_sigterm_on_one_rank_checkpoints_and_stops_every_rank(tmp_path):
    from sparkgpu.train import latest_checkpoint

    ckpt_dir, out = tmp_path / "ckpt", tmp_path / "stop"
    procs = _launch(tmp_path, "stop", "stop", "--dir", str(ckpt_dir), "--out", str(out))
    for _ in range(WORLD):
        _wait_for_file(f"{out}.ready", procs, tmp_path, "stop")
    # Only rank 1 is preempted; rank 0 must learn of it at the same step, or the two would
    # part ways in their collectives and hang.
    procs[1].send_signal(signal.SIGTERM)
    _wait(procs, tmp_path, "stop", timeout=120)

    stopped = {r["stopped"] for r in _results(out)}
    assert len(stopped) == 1 and None not in stopped
    assert latest_checkpoint(ckpt_dir).step == stopped.pop()


@pytest.mark.parametrize("pause_at", ["write_data", "finish"])
def test_kill_during_a_save_leaves_the_previous_checkpoint_as_latest(tmp_path, pause_at):
    import torch
    from torch import nn

    from sparkgpu.train import Checkpointer, latest_checkpoint

    ckpt_dir, out = tmp_path / "ckpt", tmp_path / "kill"
    procs = _launch(tmp_path, "kill", "kill", "--dir", str(ckpt_dir), "--out", str(out), "--pause-at", pause_at)
    _wait_for_file(f"{out}.paused", procs, tmp_path, "kill")
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
    for proc in procs:
        proc.wait(timeout=30)

    half_written = ckpt_dir / "step-0000000007"
    assert any(half_written.glob("*.distcp")), "the kill was meant to land after data was written"
    assert (half_written / ".metadata").exists() == (pause_at == "finish")
    assert not (half_written / "_COMPLETE.json").exists()
    assert latest_checkpoint(ckpt_dir).step == 3

    # The next attempt (here: one process, a plain module) resumes from step 3 ...
    model = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.25), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(ckpt_dir)
    assert ckpt.restore(model=model, optimizer=opt) == 4
    saved = torch.load(out.with_suffix(".model.pt"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    # ... and its own save of step 7 replaces the half-written directory.
    ckpt.save(7, model=model, optimizer=opt, wait=True)
    assert latest_checkpoint(ckpt_dir).step == 7
    assert not any(half_written.glob("__1_*.distcp")), "files of the killed attempt must not survive"


if __name__ == "__main__":
    worker_main(sys.argv[1:])
