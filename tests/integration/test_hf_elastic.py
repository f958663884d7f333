"""An elastic fine-tune: a plain Trainer goes on with fewer ranks after a lost node and grows
back, training every block of every epoch once, with its step accounting continuous.

The job is elastic (``min_gpus=1`` of 2) and its decisions are the supervisor's own
(:class:`~sparkgpu.launch.scheduling.elastic.ElasticPlan`); only the cluster is played by this host: a
local backend whose ranks wait for GPUs when it counts fewer free than an attempt asks for,
and that counts one of its two GPUs lost from when rank 1 kills itself until the shrunken
attempt says its node is back. No Spark cluster is needed for the Trainer's part, which is
what differs from the elastic loops of ``test_spark_cluster_elastic.py``.

The rank runs a ``Trainer`` on a LoRA adapter of a tiny Llama, its ``train_dataset`` the
sparkgpu loader as written for GPUs. Attempt 0 trains on 2 ranks and loses rank 1 in epoch 0;
attempt 1 waits ``elastic_wait`` for 2 ranks and is withdrawn; attempt 2 goes on with 1 rank
from the sealed checkpoint, finishes epoch 0 and starts epoch 1; the supervisor sees the
second GPU free again and asks for a checkpoint; attempt 3 ends the job on 2 ranks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from sparkgpu.launch.backends.local.backend import LocalBackend
from tests.integration.test_hf_trainer import (  # noqa: F401 - fixtures
    BLOCKS,
    EPOCHS,
    SEQ,
    all_blocks,
    tiny_llama,
    token_dir,
)

pytestmark = pytest.mark.integration

BATCH = 4  # per rank: 4 steps an epoch on 2 ranks, 8 on 1
LOST_AT = 3  # rank 1 dies in step 3 of attempt 0, once checkpoint-2 is sealed
GROW_AT = 7  # the 1-rank attempt asks for its second GPU back in step 7, its first of epoch 1


@pytest.fixture(autouse=True)
def _in_a_folder_of_its_own(tmp_path, monkeypatch):
    """Ranks run in the client's folder, and the Trainer writes ``output_dir="out"`` there."""
    monkeypatch.chdir(tmp_path)


class _Waiting:
    """An attempt whose ranks wait for GPUs the cluster does not have: nothing runs."""

    def __init__(self, attempt: int):
        self.attempt = attempt


class ElasticHost(LocalBackend):
    """This host's CPU ranks, with a cluster's answers to an elastic job: 2 GPUs, one of them
    lost from the file ``lost`` in ``marks`` until the file ``back``. An attempt asking for more
    than are free waits for them, as a Spark attempt does, until the supervisor withdraws it
    (``DeferredStart`` and ``ElasticCapacity``, beside the local backend's own capabilities)."""

    def __init__(self, marks: Path):
        super().__init__(standby=False)
        self.marks = marks
        self._started: dict[int, float] = {}

    def available_gpus(self, job) -> int:
        return 1 if (self.marks / "lost").exists() and not (self.marks / "back").exists() else 2

    def submit(self, job, run_dir, attempt, env, placement=None):
        if job.world_size > self.available_gpus(job):
            run_dir.prepare_attempt(attempt)
            return _Waiting(attempt)
        handle = super().submit(job, run_dir, attempt, env, placement)
        self._started[id(handle)] = time.time()
        return handle

    def poll(self, handle):
        return None if isinstance(handle, _Waiting) else super().poll(handle)

    def cancel(self, handle, grace: float) -> None:
        if not isinstance(handle, _Waiting):
            super().cancel(handle, grace)

    def ranks_started_at(self, handle):
        return None if isinstance(handle, _Waiting) else self._started[id(handle)]


def finetune(data_dir, records, marks):
    """A Trainer on a LoRA adapter with a sparkgpu loader, as written for GPUs; the test's only
    additions are the hook that records each step and the lost and returning node."""
    import hashlib
    import os
    import signal

    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from sparkgpu import data, runtime

    blocks = data.token_dataset(
        local=data_dir, column="ids", seq_len=SEQ - 1, batch_size=BATCH, eos_id=0, shuffle=True, seed=3
    )
    llama = tiny_llama()
    model = get_peft_model(llama, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    args = TrainingArguments(
        output_dir="out", num_train_epochs=EPOCHS, learning_rate=1e-2, save_steps=2, report_to="none", seed=7
    )
    trainer = Trainer(model=model, args=args, train_dataset=blocks)
    attempt, rank, world = runtime.attempt(), runtime.get_global_rank(), runtime.get_world_size()
    record = open(Path(records, f"a{attempt}-r{rank}.jsonl"), "a")

    def on_forward(module, inputs, kwargs, output):
        if not module.training:
            return
        step = trainer.state.global_step + 1
        if attempt == 0 and step == LOST_AT and rank == 1:
            sealed = Path(runtime.checkpoint_dir(), "hf", f"checkpoint-{LOST_AT - 1}", "_SEALED.json")
            while not sealed.exists():
                time.sleep(0.05)
            Path(marks, "lost").touch()
            os.kill(os.getpid(), signal.SIGKILL)  # its node is gone
        entry = {
            "attempt": attempt,
            "world": world,
            "step": step,
            "epoch": blocks.epoch,
            "max_steps": trainer.state.max_steps,
            "lr": trainer.lr_scheduler.get_last_lr()[0],
            "loss": output.loss.item(),
            "blocks": [hashlib.sha256(r.numpy().tobytes()).hexdigest()[:16] for r in kwargs["input_ids"]],
        }
        record.write(json.dumps(entry) + "\n")
        record.flush()
        if world == 1 and step == GROW_AT:
            Path(marks, "back").touch()  # the node is back: the supervisor grows the job at a checkpoint
            deadline = time.monotonic() + 120
            while not runtime.should_checkpoint() and time.monotonic() < deadline:
                time.sleep(0.1)

    llama.register_forward_hook(on_forward, with_kwargs=True)
    trainer.train()
    record.close()
    import torch

    adapter = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    optimizer = trainer.optimizer.state_dict()["state"]
    return {
        "world": trainer.args.world_size,
        "global_step": trainer.state.global_step,
        "max_steps": trainer.state.max_steps,
        "epoch": trainer.state.epoch,
        "optimizer_steps": sorted({int(s["step"]) for s in optimizer.values()}),
        "scheduler_steps": trainer.lr_scheduler.last_epoch,
        "last_lr": trainer.lr_scheduler.get_last_lr()[0],
        "adapter": adapter,
        "finite": all(bool(torch.isfinite(v).all()) for v in adapter.values()),
    }


def counted_steps(records: Path) -> list[dict]:
    """Every rank's entries of the steps the job kept: an attempt's steps up to the one the next
    attempt resumed from (the later ones were trained again)."""
    entries = [json.loads(line) for path in sorted(records.glob("*.jsonl")) for line in path.read_text().splitlines()]
    starts = {}
    for e in entries:
        starts[e["attempt"]] = min(starts.get(e["attempt"], e["step"]), e["step"] - 1)
    attempts = sorted(starts)
    ends = {a: starts[b] for a, b in zip(attempts, attempts[1:])} | {attempts[-1]: float("inf")}
    return [e for e in entries if e["step"] <= ends[e["attempt"]]]


def test_a_trainer_shrinks_after_a_lost_node_and_grows_back_training_every_block_once(
    token_dir, all_blocks, tmp_path, monkeypatch, capfd
):
    from sparkgpu.api.prepare import prepare
    from sparkgpu.spec import JobSpec, Resources, RunPolicy, new_job_id

    monkeypatch.setattr("sparkgpu.launch.scheduling.elastic.CHECK_SECONDS", 0.5)
    marks, records = tmp_path / "marks", tmp_path / "records"
    marks.mkdir()
    records.mkdir()
    job = JobSpec(
        job_id=new_job_id("elastic-hf"),
        name="elastic-hf",
        resources=Resources(gpus=2, gpu_type="cpu", remote=True, min_gpus=1),
        policy=RunPolicy(max_restarts=1, elastic_wait=1.0, timeout=600),
    )
    prepared = prepare(
        job, finetune, (token_dir, str(records), str(marks)), {}, backend=ElasticHost(marks), callbacks=[]
    ).write()
    results = prepared.supervisor().run()
    out = capfd.readouterr().out

    state = json.loads(prepared.run_dir.state_file.read_text())
    assert [(a["status"], a["gpus"]) for a in state["attempts"]] == [
        ("failed", 2),
        ("resized", 2),
        ("preempted", 1),
        ("succeeded", 2),
    ]
    assert state["restarts"] == 1  # the lost node's; shrinking and growing use none
    assert f"restarting from step {LOST_AT - 1}" in out, out[-3000:]

    # Every block of every epoch trained on once, across 2, then 1, then 2 ranks.
    steps = counted_steps(records)
    for epoch in range(EPOCHS):
        seen = sorted(h for e in steps if e["epoch"] == epoch for h in e["blocks"])
        assert seen == all_blocks, f"epoch {epoch} skipped or repeated blocks"
    assert {e["epoch"] for e in steps if e["attempt"] == 2} == {0, 1}  # shrunk in epoch 0, on into epoch 1
    assert {e["epoch"] for e in steps if e["attempt"] == 3} == {1}  # grew back in mid-epoch 1

    # Step numbers go on from each checkpoint, each step once on each of the attempt's ranks.
    last = max(e["step"] for e in steps)
    for step in range(1, last + 1):
        ranks = [e for e in steps if e["step"] == step]
        assert len(ranks) == ranks[0]["world"] and len({e["attempt"] for e in ranks}) == 1, step
    # 2 steps on 2 ranks, 4 + 1 on 1 rank, then the 28 blocks left of epoch 1 in 4 steps on 2 ranks.
    assert last == 2 + 5 + 4
    # Each attempt's max_steps is where the job ends if its world size stays: on 1 rank, after
    # the 4 steps left of epoch 0 and the 8 of epoch 1.
    assert {a: {e["max_steps"] for e in steps if e["attempt"] == a} for a in (0, 2, 3)} == {
        0: {2 * 4},
        2: {2 + 4 + 8},
        3: {last},
    }
    assert "saved at world size 2 and this attempt's is 1" in out, out[-3000:]
    assert "saved at world size 1 and this attempt's is 2" in out, out[-3000:]

    # Model, optimizer and scheduler carried across both changes, ending where the schedule ends.
    assert [r["world"] for r in results] == [2, 2]
    for r in results:
        assert (r["global_step"], r["max_steps"], r["epoch"]) == (last, last, EPOCHS)
        assert r["optimizer_steps"] == [last] and r["scheduler_steps"] == last
        assert r["last_lr"] == 0.0
        assert r["finite"] and any(bool(v.abs().sum() > 0) for k, v in r["adapter"].items() if "lora_B" in k)
    for name, value in results[0]["adapter"].items():
        assert value.equal(results[1]["adapter"][name]), name


@pytest.mark.parametrize(
    "epochs, max_steps, accumulation, step",
    [(2, -1, 1, 0), (2, -1, 1, 5), (2, -1, 1, 8), (2, -1, 2, 3), (1.5, -1, 1, 5), (2, 7, 1, 3), (2, 20, 1, 9)],
)
def test_at_an_unchanged_world_size_the_counts_are_the_trainers_own(epochs, max_steps, accumulation, step):
    """Resumed at the size it was saved at, the loader's position gives back the figures the
    Trainer works out from its step alone: the same run, whether or not the size ever changed."""
    import math
    from types import SimpleNamespace

    from sparkgpu.hf.elastic import Resume

    batches = 8  # per rank and epoch
    per_epoch = math.ceil(batches / accumulation)
    args = SimpleNamespace(
        num_train_epochs=epochs, max_steps=max_steps, gradient_accumulation_steps=accumulation, ignore_data_skip=False
    )
    if max_steps > 0:
        own_epochs, own_max = math.ceil(max_steps / per_epoch), max_steps
    else:
        own_epochs, own_max = math.ceil(epochs), math.ceil(epochs * per_epoch)
    own = (own_epochs, per_epoch, "examples", "samples", "total batch", batches, own_max)
    epoch, done = divmod(step, per_epoch)  # the loader's position after `step` steps
    resume = Resume(global_step=step, epoch=epoch, batches_left=batches - done * accumulation)
    assert resume.training_values(own, args) == own
    assert resume.training_state(args) == (epoch, done * accumulation)
