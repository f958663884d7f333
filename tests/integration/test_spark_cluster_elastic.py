"""An elastic job on a real Spark standalone cluster shrinks when a lost worker is not replaced
in time and grows back once it is, training every block of every epoch once.

A decoder-only transformer (the restart-exactness tests' model, DDP on gloo) trains two epochs
of a token dataset whose documents follow a pattern, so its loss falls. Attempt 0 runs on 4
GPUs (2 nodes); its second node's worker is killed. The next attempt waits ``elastic_wait`` for
4 GPUs, is withdrawn, and the job goes on from its checkpoint on the 2 GPUs left. Once the
worker is back, that attempt is asked to checkpoint and stop, and the job ends on 4 GPUs.

Runs on the session's disposable cluster (it kills a worker). Named ``test_spark_cluster_*``
so the session orders it with the other cluster tests.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from sparkgpu.config import settings
from sparkgpu.usage import UsageLedger
from sparkgpu.usage.rates import billed_seconds
from tests.integration.test_spark_cluster_faults import fault_cluster, fault_spark, wait_for  # noqa: F401 - fixtures
from tests.sealed import sealed_json

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.usefixtures("workers_share_this_image")]

SEQ, BATCH, BLOCKS, EPOCHS = 32, 4, 64, 2


@pytest.fixture(scope="module")
def pattern_tokens(tmp_path_factory):
    """Documents of counting sequences (each token one more than the last, mod the vocabulary),
    cut by the loader into exactly ``BLOCKS`` blocks: a transformer learns them in a few steps."""
    from streaming import MDSWriter

    from tests.integration.test_transformer_restart_exactness import VOCAB

    rng = np.random.default_rng(3)
    wanted = BLOCKS * SEQ + 1
    docs, total = [], 0
    while total < wanted:
        length = min(int(rng.integers(40, 160)), wanted - total - 1) or 1
        first = int(rng.integers(1, VOCAB))
        docs.append((first + np.arange(length)) % (VOCAB - 1) + 1)
        total += length + 1
    out = tmp_path_factory.mktemp("pattern") / "mds"
    with MDSWriter(out=str(out), columns={"ids": "ndarray:int64"}, size_limit=1 << 12) as writer:
        for doc in docs:
            writer.write({"ids": doc.astype(np.int64)})
    return str(out)


def train_elastically(data_dir, record_dir, marks):
    """Trains EPOCHS epochs on however many ranks this attempt has, checkpointing every step.

    Attempt 0 (4 ranks) stops moving after step 2, to lose a node there; an attempt on 2 ranks
    trains a step, then waits until it is asked to checkpoint (to grow back in mid-epoch).
    """
    import torch
    import torch.nn.functional as F

    from sparkgpu import data, runtime
    from sparkgpu.train import Checkpointer
    from tests.integration.test_transformer_restart_exactness import VOCAB, block_hash, build_model

    model = build_model("ddp")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    blocks = data.token_dataset(
        local=data_dir, column="ids", seq_len=SEQ, batch_size=BATCH, eos_id=0, shuffle=True, seed=5
    )
    ckpt = Checkpointer(every_steps=1, keep_last=3, async_save=False)
    step = start = ckpt.restore(model=model, optimizer=opt, loader=blocks)
    attempt, rank, world = runtime.attempt(), runtime.get_global_rank(), runtime.get_world_size()
    with open(Path(record_dir, f"a{attempt}-r{rank}.jsonl"), "a") as record:
        while blocks.epoch < EPOCHS:
            for batch in blocks:
                epoch = blocks.epoch  # the loader's epoch once it hands out a batch
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                entry = {"attempt": attempt, "world": world, "start": start, "step": step, "epoch": epoch}
                entry.update(loss=loss.item(), blocks=[block_hash(b) for b in batch])
                record.write(json.dumps(entry) + "\n")
                record.flush()
                ckpt.maybe_save(step, model=model, optimizer=opt, loader=blocks)
                if ckpt.should_stop:
                    ckpt.close()
                    runtime.stop_for_restart()
                if rank == 0:
                    Path(marks, f"a{attempt}.step").write_text(str(step))
                if attempt == 0 and step >= 2:
                    time.sleep(600)  # its node is killed here
                if world == 2 and step == start + 1:
                    deadline = time.monotonic() + 300
                    while not runtime.should_checkpoint() and time.monotonic() < deadline:
                        time.sleep(0.2)  # until the job grows back
    ckpt.close()
    return {"rank": rank, "world": world, "start": start, "steps": step}


def step_of(marks: Path, attempt: int) -> int:
    path = marks / f"a{attempt}.step"
    return int(path.read_text() or 0) if path.exists() else 0


def counted_steps(record_dir: Path) -> list[dict]:
    """Every rank's entries of the steps that the job kept: an attempt's steps after the one it
    restored, up to the one the next attempt restored (later ones were trained again)."""
    entries = [
        json.loads(line) for path in sorted(record_dir.glob("*.jsonl")) for line in path.read_text().splitlines()
    ]
    starts = sorted({(e["attempt"], e["start"]) for e in entries})
    ends = {a: starts[i + 1][1] if i + 1 < len(starts) else float("inf") for i, (a, _) in enumerate(starts)}
    return [e for e in entries if e["step"] <= ends[e["attempt"]]]


def test_an_elastic_job_shrinks_when_a_worker_is_not_replaced_and_grows_back_training_every_block_once(
    fault_cluster, fault_spark, pattern_tokens, tmp_path, monkeypatch
):
    from tests.integration.test_transformer_restart_exactness import block_hash

    monkeypatch.setattr("sparkgpu.launch.scheduling.elastic.CHECK_SECONDS", 2.0)
    marks, records = tmp_path / "marks", tmp_path / "records"
    marks.mkdir()
    records.mkdir()
    ledger = UsageLedger(settings().usage_ledger_uri)
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = fault_spark.gpu.train(
                train_elastically,
                gpus=(2, 4),
                gpu_type="A10",
                elastic_wait="5s",
                args=(pattern_tokens, str(records), str(marks)),
                max_restarts=1,
                name="elastic",
            )
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def reached(attempt: int, step: int) -> bool:
        assert "error" not in outcome, outcome["error"]
        return step_of(marks, attempt) >= step

    wait_for(lambda: reached(0, 2), 240, "attempt 0 to checkpoint two steps")
    (run_dir,) = settings().staging_root.glob("elastic-*")
    node = sealed_json(run_dir / "attempts" / "0" / "spark" / "node-1.started")
    _, worker = fault_cluster.executor_pids()[node["executor"]]
    fault_cluster.kill_worker(worker)

    # Attempt 1 waits for 4 GPUs, is withdrawn after elastic_wait; attempt 2 goes on with 2.
    wait_for(lambda: reached(2, 3), 240, "the job to go on with 2 GPUs")
    fault_cluster.restart_worker(worker)
    thread.join(300)
    assert not thread.is_alive(), "the job did not grow back and end"
    assert "error" not in outcome, outcome.get("error")

    state = json.loads((run_dir / "state.json").read_text())
    attempts = [(a["status"], a["gpus"]) for a in state["attempts"]]
    assert attempts == [("failed", 4), ("resized", 4), ("preempted", 2), ("succeeded", 4)]
    assert state["restarts"] == 1  # the lost node's; shrinking and growing use none
    withdrawn = state["attempts"][1]
    assert withdrawn["started_at"] == withdrawn["ended_at"]  # it ran nothing: nothing billed
    assert "elastic_wait" in withdrawn["cause"][0]
    results = outcome["result"]
    assert [r["world"] for r in results] == [4, 4, 4, 4] and {r["rank"] for r in results} == {0, 1, 2, 3}

    # Every block of every epoch trained on once, across 4, then 2, then 4 ranks.
    steps = counted_steps(records)
    from sparkgpu import data

    every = data.token_dataset(
        local=pattern_tokens, column="ids", seq_len=SEQ, batch_size=1, eos_id=0, rank=0, world_size=1
    )
    all_blocks = sorted(block_hash(b[0]) for b in every)
    assert len(all_blocks) == BLOCKS
    for epoch in range(EPOCHS):
        seen = sorted(h for e in steps if e["epoch"] == epoch for h in e["blocks"])
        assert seen == all_blocks, f"epoch {epoch} skipped or repeated blocks"
    assert {e["world"] for e in steps if e["attempt"] == 2} == {2}
    assert {e["epoch"] for e in steps if e["attempt"] == 3} == {0, 1}  # it grew back in mid-epoch

    # The loss curve goes on from where each attempt left it, instead of starting over.
    losses = {}
    for e in sorted(steps, key=lambda e: e["step"]):
        losses.setdefault(e["step"], []).append(e["loss"])
    curve = [float(np.mean(losses[s])) for s in sorted(losses)]
    assert sorted(losses) == list(range(1, len(curve) + 1))  # no step missing or trained twice
    first_of = {a["attempt"]: None for a in state["attempts"]}
    for e in steps:
        if e["step"] == e["start"] + 1:
            first_of[e["attempt"]] = e["step"]
    for attempt in (2, 3):
        resumed = first_of[attempt]
        assert resumed is not None and resumed > 1
        # An untrained model's loss is ln(vocabulary) on any batch (the first step's, within 0.05).
        assert curve[resumed - 1] < curve[0] - 0.2, f"attempt {attempt} started over: {curve}"
        assert curve[resumed - 1] < curve[resumed - 2] * 1.1, f"attempt {attempt} lost progress: {curve}"
    assert curve[-1] < 0.5 * curve[0], curve

    # Each attempt is billed for the GPUs it ran on.
    rows = {r["attempt"]: r for r in ledger.read().to_pylist() if r["job_id"] == state["job_id"]}
    assert {a: rows[a]["gpus"] for a in rows} == {0: 4, 1: 4, 2: 2, 3: 4}
    third = state["attempts"][2]
    assert rows[2]["gpu_seconds"] == 2 * billed_seconds(third["started_at"], third["ended_at"])
    assert rows[1]["gpu_seconds"] == 0
