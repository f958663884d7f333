"""A decoder-only transformer resumes bitwise exactly, whichever path restarts it.

The model people train: token embeddings, causal self-attention, layer norm, a GELU MLP,
AdamW with weight decay and gradient clipping, on ``token_dataset`` blocks, wrapped in DDP or
FSDP2 (``fully_shard``) on 2 gloo ranks. The loop counts steps done (``step += 1`` before
``maybe_save(step)``, ``step = restore()``), as Lightning and Hugging Face loops do.

Rank 1 is killed with SIGKILL at a random step and the job restarts from its last checkpoint
through the cold path (a new agent), the job's standby (ranks forked from a zygote that
imported torch before the job existed) or the warm pool; or the runtime cap stops it to
resume in a new attempt; or its client is killed and ``sparkgpu resume`` finishes it (the
Spark cluster's path is in ``test_spark_cluster_exactness.py``). Every run must end bitwise
equal to an uninterrupted one: weights, optimizer state and the loss of every step, with
every block of every epoch trained on exactly once.

The model is large enough that the intra-op thread count changes the low bits of its
matmuls: a restarted rank that ran with other thread settings than the first attempt's
(the zygote's torch was imported before ``OMP_NUM_THREADS`` was set) fails these tests.
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess

import numpy as np
import pytest

from sparkgpu import distributed
from sparkgpu.config import settings
from sparkgpu.launch.backends.local.backend import LocalBackend
from tests.integration.homes import home_of_its_own

# One worker runs the module: its module-scoped fixtures (a reference run, built data) are built
# once, not once on every worker a test of it lands on.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("transformer-restart")]

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 128, 32, 128, 4, 2
BATCH, WORLD, EPOCHS = 4, 2, 2
BLOCKS = 64  # per epoch: 8 steps of 4 blocks on each of 2 ranks
STEPS_PER_EPOCH = BLOCKS // (BATCH * WORLD)
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    """Documents of random tokens whose stream (with EOS after each) cuts into exactly ``BLOCKS`` blocks."""
    from streaming import MDSWriter

    rng = np.random.default_rng(0)
    wanted = BLOCKS * SEQ + 1  # blocks of SEQ + 1 tokens overlap by one
    docs, total = [], 0
    while total < wanted:
        length = min(int(rng.integers(20, 200)), wanted - total - 1) or 1
        docs.append(rng.integers(1, VOCAB, length, dtype=np.int64))
        total += length + 1
    out = tmp_path_factory.mktemp("tokens") / "mds"
    with MDSWriter(out=str(out), columns={"ids": "ndarray:int64"}, size_limit=1 << 12) as writer:  # many shards
        for doc in docs:
            writer.write({"ids": doc})
    return str(out)


def block_hash(block) -> str:
    return hashlib.sha256(block.numpy().tobytes()).hexdigest()[:16]


def build_model(kind: str):
    """The transformer, wrapped for ``kind`` ("ddp" or "fsdp"), the same initial weights on every rank."""
    import torch
    import torch.distributed as dist
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
            self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

        def forward(self, x, mask):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class TinyDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

        def forward(self, ids):
            mask = torch.triu(torch.full((ids.shape[1], ids.shape[1]), float("-inf")), diagonal=1)
            x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
            for block in self.blocks:
                x = block(x, mask)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    model = TinyDecoder()
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_transformer(data_dir, record_file, kind, kill_step=None, step_sleep=0.0, hold_from=None, slow_attempts=1):
    """Trains TOTAL_STEPS steps, counting steps done; records what each step trained on and its loss.

    ``kill_step``: rank 1 of the first attempt kills itself after that step. ``step_sleep``:
    seconds each step of the first ``slow_attempts`` attempts lasts longer (for the runtime cap
    to stop it, or a test to kill something meanwhile).
    ``hold_from``: from that step on, the first attempt waits after each step until it is asked to
    stop (for a preemption test, whose critical job may take a loaded machine long to queue).
    """
    import os
    import signal
    import time

    import torch
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from sparkgpu import data, runtime
    from sparkgpu.train import Checkpointer

    model = build_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    blocks = data.token_dataset(
        local=data_dir, column="ids", seq_len=SEQ, batch_size=BATCH, eos_id=0, shuffle=True, seed=11
    )
    ckpt = Checkpointer(every_steps=3, keep_last=2)
    step = ckpt.restore(model=model, optimizer=opt, loader=blocks)  # steps done
    rank = runtime.get_global_rank()
    threads = (torch.get_num_threads(), torch.get_num_interop_threads())
    with open(f"{record_file}.{rank}", "a") as record:
        while step < TOTAL_STEPS:
            for batch in blocks:
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                step += 1
                record.write(
                    json.dumps(
                        {
                            "attempt": runtime.attempt(),
                            "step": step,
                            "threads": threads,
                            "loss": loss.item().hex(),
                            "blocks": [block_hash(b) for b in batch],
                        }
                    )
                    + "\n"
                )
                record.flush()
                if runtime.attempt() == 0 and rank == 1 and step == kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                if runtime.attempt() < slow_attempts:
                    time.sleep(step_sleep)
                if runtime.attempt() == 0:
                    held = time.monotonic()
                    while hold_from is not None and step >= hold_from and not runtime.should_checkpoint():
                        assert time.monotonic() - held < 240, "the held attempt was never asked to stop"
                        time.sleep(0.1)
                ckpt.maybe_save(step, model=model, optimizer=opt, loader=blocks)
                if ckpt.should_stop:
                    ckpt.close()
                    runtime.stop_for_restart()
                if step >= TOTAL_STEPS:
                    break
    ckpt.close()
    model_sd, optim_sd = get_state_dict(model, opt)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731 - FSDP2 shards are DTensors
    return {
        "model": {k: full(v).clone() for k, v in model_sd.items()},
        "optimizer": {f"{p}.{k}": full(v).clone() for p, s in optim_sd["state"].items() for k, v in s.items()},
    }


def run(token_dir, tmp_path, tag, kind, backend=None, **options):
    record = tmp_path / f"{tag}.jsonl"
    policy = {k: options.pop(k) for k in ("max_restarts", "max_runtime", "checkpoint_grace", "detach") if k in options}
    job = distributed(gpus=WORLD, gpu_type="cpu", backend=backend, **policy)(train_transformer)
    states = job.distributed(token_dir, str(record), kind, **options)
    state = json.loads((settings().staging_root / job.last_job_id / "state.json").read_text())
    return states, state, read_records(record)


def read_records(record) -> dict[tuple[int, int], dict]:
    """(rank, step) -> what that step trained on, keeping the attempt whose step counted (the last one)."""
    steps = {}
    for rank in range(WORLD):
        for line in open(f"{record}.{rank}"):
            entry = json.loads(line)
            steps[(rank, entry["step"])] = entry
    return steps


def assert_each_epoch_trains_every_block_once(steps, all_blocks):
    for epoch in range(EPOCHS):
        seen = [
            h
            for (rank, step), entry in steps.items()
            if (step - 1) // STEPS_PER_EPOCH == epoch
            for h in entry["blocks"]
        ]
        assert sorted(seen) == all_blocks, f"epoch {epoch} skipped or repeated blocks"


def assert_bitwise_equal(a: dict, b: dict):
    for part in ("model", "optimizer"):
        assert a[part].keys() == b[part].keys()
        for name in a[part]:
            assert a[part][name].equal(b[part][name]), f"{part} {name} differs"


@pytest.fixture(scope="module")
def all_blocks(token_dir):
    from sparkgpu import data

    loader = data.token_dataset(
        local=token_dir, column="ids", seq_len=SEQ, batch_size=1, eos_id=0, rank=0, world_size=1
    )
    hashes = sorted(block_hash(batch[0]) for batch in loader)
    assert len(hashes) == BLOCKS == len(set(hashes))
    return hashes


@pytest.fixture(scope="module")
def uninterrupted(token_dir, all_blocks, tmp_path_factory):
    """``uninterrupted(kind)``: the run of ``kind`` that nothing stopped, made once per module."""
    runs = {}

    def get(kind: str):
        if kind not in runs:
            with home_of_its_own(tmp_path_factory):
                states, state, steps = run(
                    token_dir, tmp_path_factory.mktemp("plain"), "plain", kind, backend=LocalBackend(standby=False)
                )
            assert len(state["attempts"]) == 1
            assert sorted(steps) == [(rank, step) for rank in range(WORLD) for step in range(1, TOTAL_STEPS + 1)]
            assert_each_epoch_trains_every_block_once(steps, all_blocks)
            assert_bitwise_equal(states[0], states[1])
            runs[kind] = states[0], steps
        return runs[kind]

    return get


def assert_same_run(states, steps, plain, plain_steps, all_blocks, note):
    assert {k: (v["loss"], v["blocks"]) for k, v in steps.items()} == {
        k: (v["loss"], v["blocks"]) for k, v in plain_steps.items()
    }, f"the loss curve or the data differ {note}"
    assert_each_epoch_trains_every_block_once(steps, all_blocks)
    for rank_state in states:
        assert_bitwise_equal(rank_state, plain)


RESTART_PATHS = {
    "cold": lambda: LocalBackend(standby=False),  # a new agent starts new interpreters
    "standby": lambda: LocalBackend(),  # ranks forked from the job's standby zygote
    "warm_pool": lambda: "warm_pool",  # ranks of both attempts forked from the warm pool's zygote
}


# Every restart path with DDP, and FSDP2 through the standby: what a path changes (the process that
# runs the rank, its thread settings) is the same whichever way the model is wrapped, and the
# standby is the path a restarted FSDP job takes by default.
@pytest.mark.parametrize("kind, path", [("ddp", "cold"), ("ddp", "standby"), ("ddp", "warm_pool"), ("fsdp", "standby")])
def test_a_sigkilled_rank_resumes_bitwise_equal_through_each_restart_path(
    kind, path, uninterrupted, token_dir, all_blocks, tmp_path
):
    plain, plain_steps = uninterrupted(kind)
    seed = random.randrange(1 << 30)
    kill_step = random.Random(seed).randrange(4, TOTAL_STEPS - 1)
    note = f"({kind}, {path}: rank 1 killed after step {kill_step}, seed {seed})"
    states, state, steps = run(
        token_dir, tmp_path, path, kind, backend=RESTART_PATHS[path](), kill_step=kill_step, max_restarts=1
    )
    assert [a["status"] for a in state["attempts"]] == ["failed", "succeeded"], note
    resumed = [entry for entry in steps.values() if entry["attempt"] == 1]
    assert resumed, f"no step ran in the restarted attempt {note}"
    # Compared with the uninterrupted run: the killed attempt's records may all be superseded
    # when its last checkpoint had not committed before the kill.
    expected_threads = {tuple(e["threads"]) for e in plain_steps.values()}
    assert {tuple(e["threads"]) for e in resumed} == expected_threads, (
        f"the restarted ranks ran with other thread settings than an uninterrupted run {note}"
    )
    assert_same_run(states, steps, plain, plain_steps, all_blocks, note)


def test_the_runtime_cap_stops_and_resumes_bitwise_equal(uninterrupted, token_dir, all_blocks, tmp_path):
    plain, plain_steps = uninterrupted("ddp")
    # Detached: the cap's checkpoint-and-resume is the job's own supervisor's work, not this process's.
    states, state, steps = run(
        token_dir, tmp_path, "capped", "ddp", step_sleep=1.0, max_runtime=20, checkpoint_grace=10, detach=True
    )
    assert state["preemptions"] >= 1 and state["restarts"] == 0, state
    assert state["attempts"][-1]["status"] == "succeeded"
    assert {e["attempt"] for e in steps.values()} >= {0, 1}
    assert_same_run(states, steps, plain, plain_steps, all_blocks, "(runtime cap)")


RESUMED_CLIENT = """
from sparkgpu import distributed
from tests.integration.test_transformer_restart_exactness import train_transformer

distributed(gpus=2, gpu_type="cpu")(train_transformer).distributed({data!r}, {record!r}, "ddp", step_sleep=0.5)
"""


def test_sparkgpu_resume_finishes_a_job_whose_client_was_killed_bitwise_equal(
    uninterrupted, token_dir, all_blocks, tmp_path, _isolated_sparkgpu_home
):
    from sparkgpu.launch.client.resume import resume_job
    from tests.integration.processes import assert_no_orphans, start_client, wait_for

    plain, plain_steps = uninterrupted("ddp")
    record = tmp_path / "resumed.jsonl"
    client = start_client(
        tmp_path,
        _isolated_sparkgpu_home,
        RESUMED_CLIENT.format(data=token_dir, record=str(record)),
        stdout=subprocess.DEVNULL,
    )
    runs = _isolated_sparkgpu_home / "runs"
    if not wait_for(lambda: any(runs.glob("*/checkpoints/step-*/_COMPLETE.json")), within=180):
        client.kill()
        pytest.fail("the client's job never committed a checkpoint")
    client.kill()  # SIGKILL: the client's supervisor dies with no cleanup
    client.wait()
    run_dir = next(runs.iterdir())
    assert_no_orphans(run_dir, within=15)

    states = resume_job(run_dir.name)
    state = json.loads((run_dir / "state.json").read_text())
    assert [a["status"] for a in state["attempts"]] == ["lost", "succeeded"]
    assert_same_run(states, read_records(record), plain, plain_steps, all_blocks, "(sparkgpu resume)")


DETACHED_CLIENT = """
import os, signal
from sparkgpu import distributed
from tests.integration.test_transformer_restart_exactness import train_transformer

job = distributed(gpus=2, gpu_type="cpu", max_restarts=1)(train_transformer)
call = job.submit({data!r}, {record!r}, "ddp", kill_step={kill_step}, step_sleep=0.5, slow_attempts=2)
print(call.job_id, flush=True)
os.killpg(0, signal.SIGKILL)  # the submitter and its whole process group, the moment it submitted
"""


def test_a_detached_job_ends_bitwise_equal_with_its_submitter_a_rank_and_its_supervisor_killed(
    uninterrupted, token_dir, all_blocks, tmp_path, _isolated_sparkgpu_home
):
    import os
    import signal

    from sparkgpu import attach
    from tests.integration.processes import start_client, wait_for

    plain, plain_steps = uninterrupted("ddp")
    record = tmp_path / "detached.jsonl"
    kill_step = 4
    client = start_client(
        tmp_path,
        _isolated_sparkgpu_home,
        DETACHED_CLIENT.format(data=token_dir, record=str(record), kill_step=kill_step),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    job_id = client.stdout.readline().strip()
    assert client.wait(timeout=60) == -signal.SIGKILL
    state_file = settings().staging_root / job_id / "state.json"

    rank_0 = tmp_path / "detached.jsonl.0"

    def in_attempt_1() -> bool:  # rank 1 died after step 4 and the restarted attempt is training
        lines = rank_0.read_text().split("\n")[:-1] if rank_0.exists() else []  # whole lines only
        return any(json.loads(line)["attempt"] == 1 for line in lines)

    assert wait_for(in_attempt_1, within=300), "the job never restarted after its rank was killed"
    os.kill(json.loads(state_file.read_text())["client"]["pid"], signal.SIGKILL)  # the supervisor itself
    states = attach(job_id).result(timeout=300)
    state = json.loads(state_file.read_text())
    assert [a["status"] for a in state["attempts"]] == ["failed", "lost", "succeeded"], state
    note = f"(detached: submitter killed, rank 1 killed after step {kill_step}, supervisor killed in attempt 1)"
    assert_same_run(states, read_records(record), plain, plain_steps, all_blocks, note)
