"""Checkpoint-and-restart is exact: interrupted runs end bitwise equal to an uninterrupted one.

A small deterministic CPU training run on the project's own loader and checkpointer, on 2
gloo ranks, is interrupted once by SIGKILL of a rank at a random step (the supervisor
restarts it from the latest complete checkpoint) and once by the runtime cap (the ranks
checkpoint and stop, the supervisor resumes them). Both end with weights bitwise equal to an
uninterrupted run's, and within every epoch every sample is trained on exactly once.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from sparkgpu import distributed
from sparkgpu.config import settings
from tests.integration.homes import home_of_its_own

# One worker runs the module: its module-scoped fixtures (a reference run, built data) are built
# once, not once on every worker a test of it lands on.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("restart-exactness")]

SAMPLES, FEATURES, BATCH, WORLD, EPOCHS = 256, 8, 8, 2, 3
STEPS_PER_EPOCH = SAMPLES // (BATCH * WORLD)


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    import pyarrow as pa

    from sparkgpu.data import to_mds

    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, FEATURES), dtype=np.float32)
    y = (x @ np.linspace(-1, 1, FEATURES, dtype=np.float32)).astype(np.float32)
    columns = {f"f{i}": x[:, i] for i in range(FEATURES)}
    table = pa.table({**columns, "y": y, "id": np.arange(SAMPLES, dtype=np.int64)})
    out = tmp_path_factory.mktemp("exactness") / "mds"
    to_mds(table, str(out), size_limit=2048)  # many small shards: resume crosses shard borders
    return str(out)


def train_exactly(data_dir, record_file, kill_rank=None, kill_step=None, step_sleep=0.0, hold_from=None):
    """``hold_from``: from that step on, the first attempt waits after each step until it is asked
    to stop (for a preemption test, whose critical job may take a loaded machine long to queue)."""
    import signal
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparkgpu import data, runtime
    from sparkgpu.train import Checkpointer

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ds = data.dataset(local=data_dir, batch_size=BATCH, shuffle=True, seed=7)
    ckpt = Checkpointer(every_steps=4, keep_last=2)
    step = ckpt.restore(model=model, optimizer=opt, loader=ds)
    total = EPOCHS * STEPS_PER_EPOCH
    rank = runtime.get_global_rank()
    with open(f"{record_file}.{rank}", "a") as record:
        while step < total:
            for batch in ds:
                record.write(json.dumps([runtime.attempt(), step, batch["id"].tolist()]) + "\n")
                record.flush()
                x = torch.stack([batch[f"f{i}"] for i in range(FEATURES)], dim=1)
                loss = ((model(x).squeeze(1) - batch["y"]) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if runtime.attempt() == 0 and rank == kill_rank and step == kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                if runtime.attempt() == 0:  # only the attempt the runtime cap stops is slowed down
                    time.sleep(step_sleep)
                    held = time.monotonic()
                    while hold_from is not None and step >= hold_from and not runtime.should_checkpoint():
                        assert time.monotonic() - held < 240, "the held attempt was never asked to stop"
                        time.sleep(0.1)
                ckpt.maybe_save(step, model=model, optimizer=opt, loader=ds)
                if ckpt.should_stop:
                    ckpt.close()
                    runtime.stop_for_restart()
                step += 1
                if step >= total:
                    break
    ckpt.close()
    return {name: t.clone() for name, t in model.module.state_dict().items()}


def run(dataset_dir, tmp_path, tag, **options):
    record = tmp_path / f"{tag}.jsonl"
    policy = {k: options.pop(k) for k in ("max_runtime", "checkpoint_grace", "max_restarts") if k in options}
    job = distributed(gpus=WORLD, gpu_type="cpu", **policy)(train_exactly)
    weights = job.distributed(dataset_dir, str(record), **options)
    state = json.loads((settings().staging_root / job.last_job_id / "state.json").read_text())
    return weights, state, trained_batches(record)


def trained_batches(record) -> dict[tuple[int, int], list[int]]:
    """(rank, step) -> sample ids, keeping the attempt whose step counted (the last one)."""
    batches = {}
    for rank in range(WORLD):
        for line in open(f"{record}.{rank}"):
            attempt, step, ids = json.loads(line)
            batches[(rank, step)] = ids
    return batches


def assert_each_epoch_sees_every_sample_once(batches):
    for epoch in range(EPOCHS):
        ids = [i for (rank, step), b in batches.items() if step // STEPS_PER_EPOCH == epoch for i in b]
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch} skipped or repeated samples"


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].equal(b[name]), f"{name} differs"


@pytest.fixture(scope="module")
def uninterrupted(dataset_dir, tmp_path_factory):
    with home_of_its_own(tmp_path_factory):
        weights, state, batches = run(dataset_dir, tmp_path_factory.mktemp("plain"), "plain")
    assert len(state["attempts"]) == 1
    assert_each_epoch_sees_every_sample_once(batches)
    return weights, batches


def test_sigkill_of_a_rank_at_a_random_step_resumes_exactly(dataset_dir, tmp_path, uninterrupted):
    seed = random.randrange(1 << 30)
    kill_step = random.Random(seed).randrange(5, EPOCHS * STEPS_PER_EPOCH - 2)
    weights, state, batches = run(dataset_dir, tmp_path, "killed", kill_rank=1, kill_step=kill_step, max_restarts=1)
    note = f"(kill at step {kill_step}, seed {seed})"
    assert [a["status"] for a in state["attempts"]] == ["failed", "succeeded"], note
    assert state["restarts"] == 1, note
    assert_bitwise_equal(weights[0], uninterrupted[0][0])
    assert_bitwise_equal(weights[1], weights[0])
    assert batches == uninterrupted[1], f"the resumed run trained on other batches {note}"
    assert_each_epoch_sees_every_sample_once(batches)


def test_the_runtime_cap_checkpoints_and_resumes_exactly(dataset_dir, tmp_path, uninterrupted):
    weights, state, batches = run(dataset_dir, tmp_path, "capped", step_sleep=0.5, max_runtime=20, checkpoint_grace=8)
    assert state["preemptions"] >= 1 and state["restarts"] == 0
    assert state["attempts"][-1]["status"] == "succeeded"
    assert_bitwise_equal(weights[0], uninterrupted[0][0])
    assert batches == uninterrupted[1]
    assert_each_epoch_sees_every_sample_once(batches)
