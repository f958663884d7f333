"""A 2-rank job trains from a Delta table with deletion vectors, deleted rows and a filter.

Every epoch sees exactly the surviving rows once, and a rank killed by SIGKILL mid-epoch
resumes (from the loader position in the checkpoint) onto exactly the batches an
uninterrupted reading of the table gives each rank.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pyarrow as pa
import pytest

from sparkgpu import distributed
from sparkgpu.config import settings
from tests.unit.delta_dv import delete_rows

pytestmark = pytest.mark.integration

ROWS, FEATURES, BATCH, WORLD, EPOCHS = 240, 4, 8, 2, 2


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """(table URI, filter, surviving ids): surviving rows a multiple of BATCH * WORLD."""
    from deltalake import DeltaTable, WriterProperties, write_deltalake

    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, FEATURES), dtype=np.float32)
    ids = np.arange(ROWS, dtype=np.int64)
    frame = pa.table(
        {
            **{f"f{i}": x[:, i] for i in range(FEATURES)},
            "y": x.sum(axis=1),
            "id": ids,
            "part": pa.array([f"p{i % 2}" for i in range(ROWS)]),
        }
    )
    uri = str(tmp_path_factory.mktemp("dvtable") / "t")
    write_deltalake(
        uri,
        frame,
        partition_by=["part"],
        configuration={"delta.enableDeletionVectors": "true"},
        writer_properties=WriterProperties(max_row_group_size=30),
    )
    deleted = set()
    for add in pa.table(DeltaTable(uri).get_add_actions(flatten=True)).to_pylist():
        import pyarrow.parquet as pq

        file_ids = pq.read_table(os.path.join(uri, add["path"]), columns=["id"]).column("id").to_pylist()
        positions = [3, 17, 41, 42, 90]
        delete_rows(uri, add["path"], positions)
        deleted |= {file_ids[p] for p in positions}
    alive = sorted(set(range(ROWS)) - deleted)
    threshold = alive[len(alive) % (BATCH * WORLD)]
    return uri, f"id >= {threshold}", [i for i in alive if i >= threshold]


def train_on_table(uri, row_filter, record_file, kill_rank=None, kill_step=None):
    import signal

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparkgpu import data, runtime
    from sparkgpu.train import Checkpointer

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(FEATURES, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rows = data.table_dataset(
        uri,
        filter=row_filter,
        columns=[*(f"f{i}" for i in range(FEATURES)), "y", "id"],
        batch_size=BATCH,
        shuffle=True,
        seed=11,
        shuffle_block_size=64,
    )
    ckpt = Checkpointer(every_steps=4, keep_last=2)
    step = ckpt.restore(model=model, optimizer=opt, loader=rows)
    total = EPOCHS * len(rows)
    rank = runtime.get_global_rank()
    with open(f"{record_file}.{rank}", "a") as record:
        while step < total:
            for batch in rows:
                record.write(json.dumps([step, batch["id"].tolist()]) + "\n")
                record.flush()
                x = torch.stack([batch[f"f{i}"] for i in range(FEATURES)], dim=1)
                loss = ((model(x).squeeze(1) - batch["y"]) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if runtime.attempt() == 0 and rank == kill_rank and step == kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                ckpt.maybe_save(step, model=model, optimizer=opt, loader=rows)
                step += 1
                if step >= total:
                    break
    ckpt.close()
    return {name: t.clone() for name, t in model.module.state_dict().items()}


def run(table, tmp_path, tag, **options):
    uri, row_filter, _ = table
    record = tmp_path / f"{tag}.jsonl"
    job = distributed(gpus=WORLD, gpu_type="cpu", max_restarts=options.pop("max_restarts", 0))(train_on_table)
    weights = job.distributed(uri, row_filter, str(record), **options)
    state = json.loads((settings().staging_root / job.last_job_id / "state.json").read_text())
    batches = {}
    for rank in range(WORLD):
        for line in open(f"{record}.{rank}"):
            step, ids = json.loads(line)
            batches[(rank, step)] = ids  # the attempt whose step counted is the last one written
    return weights, state, batches


def expected_batches(table) -> dict:
    """(rank, step) -> row ids of an uninterrupted run, read in this process rank by rank."""
    from sparkgpu import data

    uri, row_filter, _ = table
    batches = {}
    for rank in range(WORLD):
        rows = data.table_dataset(
            uri,
            filter=row_filter,
            batch_size=BATCH,
            shuffle=True,
            seed=11,
            shuffle_block_size=64,
            rank=rank,
            world_size=WORLD,
        )
        step = 0
        for _ in range(EPOCHS):
            for batch in rows:
                batches[(rank, step)] = batch["id"].tolist()
                step += 1
    return batches


def test_dv_table_job_sees_surviving_rows_once_per_epoch_and_resumes_exactly_after_sigkill(table, tmp_path):
    survivors = table[2]
    steps_per_epoch = len(survivors) // (BATCH * WORLD)
    plain = expected_batches(table)
    for epoch in range(EPOCHS):
        ids = [i for (rank, step), b in plain.items() if step // steps_per_epoch == epoch for i in b]
        assert sorted(ids) == survivors, f"epoch {epoch} did not see exactly the surviving rows once"
    seed = random.randrange(1 << 30)
    kill_step = random.Random(seed).randrange(steps_per_epoch + 1, EPOCHS * steps_per_epoch - 1)  # mid-epoch 2
    weights, state, killed = run(table, tmp_path, "killed", kill_rank=1, kill_step=kill_step, max_restarts=1)
    note = f"(kill at step {kill_step}, seed {seed})"
    assert [a["status"] for a in state["attempts"]] == ["failed", "succeeded"], note
    assert killed == plain, f"the ranks trained on other batches than an uninterrupted reading {note}"
    assert all(weights[0][name].equal(weights[1][name]) for name in weights[0])  # DDP kept the ranks in step
