"""Lightning's Trainer in a job checkpoints into the job's store, signed, and resumes exactly, with no line of ours.

A tiny transformer language model trains with ``Trainer(strategy="ddp")`` on 2 gloo ranks, as
a user writes it. Once, one rank alone is asked to checkpoint mid-epoch (what the runtime
cap, a usage budget or SIGTERM do): the ranks agree, save, stop for a restart, and the next
attempt resumes by itself. It ends bitwise equal to an uninterrupted run, having trained on
the same batches. Once, a rank is killed after the periodic save of ``JobCheckpoints``. Once,
the saved checkpoint is replaced by a pickle that runs code: the next attempt does not load it
and trains from the start. One test in a single process: a stop asked for in the middle of a
gradient accumulation waits for the optimizer step.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.test_restart_exactness import assert_bitwise_equal

from sparkgpu import distributed
from sparkgpu.config import settings
from tests.integration.homes import home_of_its_own

# One worker runs the module: its module-scoped fixtures (a reference run, built data) are built
# once, not once on every worker a test of it lands on.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.xdist_group("lightning"),
]

VOCAB, SEQ, BATCHES, EPOCHS = 32, 8, 6, 2


class RankBatches:
    """A rank's share of fixed token batches in a per-epoch order, carrying its position.

    Lightning saves ``state_dict()`` in its checkpoints and restores it: what makes a resume
    in the middle of an epoch exact (sparkgpu's own loaders do the same).
    """

    def __init__(self, rank: int, world: int):
        import torch

        tokens = torch.randint(0, VOCAB, (BATCHES * world * 4, SEQ), generator=torch.Generator().manual_seed(0))
        self.batches = list(tokens[rank::world].split(4))
        self.epoch = self.position = 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        import torch

        if self.position == len(self.batches):  # Lightning stops at len() without exhausting the last one
            self.epoch, self.position = self.epoch + 1, 0
        order = torch.randperm(len(self.batches), generator=torch.Generator().manual_seed(self.epoch)).tolist()
        while self.position < len(order):
            self.position += 1
            yield self.batches[order[self.position - 1]]

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state):
        self.epoch, self.position = state["epoch"], state["position"]


class Planted:
    """Unpickling it creates ``path``: the proof that a forged checkpoint was loaded."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        import os

        return (os.makedirs, (self.path,))


def fit_tiny_transformer(record: str, stop_step=None, kill_step=None, every_n_train_steps=None, forge=None):
    """The user's function: a LightningModule and a Trainer, nothing of sparkgpu but the test's triggers."""
    import os
    import signal

    import lightning.pytorch as pl
    import torch

    from sparkgpu import runtime

    rank = runtime.get_global_rank()

    class TinyLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(VOCAB, 16)
            self.block = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.head = torch.nn.Linear(16, VOCAB)

        def training_step(self, batch, batch_idx):
            with open(f"{record}.{rank}", "a") as f:
                f.write(json.dumps([runtime.attempt(), self.global_step, batch[:, 0].tolist()]) + "\n")
            if runtime.attempt() == 0 and rank == 1 and self.global_step == stop_step:
                runtime.request_checkpoint()  # on one rank only: the ranks must agree
            if runtime.attempt() == 0 and rank == 1 and self.global_step == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            mask = torch.nn.Transformer.generate_square_subsequent_mask(SEQ - 1)
            hidden = self.block(self.embed(batch[:, :-1]), src_mask=mask, is_causal=True)
            return torch.nn.functional.cross_entropy(self.head(hidden).reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    callbacks = []
    if every_n_train_steps is not None:
        from sparkgpu.train.lightning import JobCheckpoints

        callbacks.append(JobCheckpoints(every_n_train_steps=every_n_train_steps))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=EPOCHS,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if forge is not None and runtime.attempt() == 1:
        import pickle

        import torch.distributed as dist

        if rank == 0:  # someone who can write to the job's store replaces its checkpoint
            folder = f"{runtime.checkpoint_dir()}/lightning"
            (name,) = [n for n in os.listdir(folder) if n.endswith(".ckpt")]
            with open(f"{folder}/{name}", "wb") as f:
                f.write(pickle.dumps(Planted(forge)))
        dist.barrier()
    model = TinyLM()
    trainer.fit(model, train_dataloaders=RankBatches(rank, 2))
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def run(tmp_path, tag, **options):
    record = tmp_path / f"{tag}.jsonl"
    policy = {k: options.pop(k) for k in ("max_restarts",) if k in options}
    job = distributed(gpus=2, gpu_type="cpu", **policy)(fit_tiny_transformer)
    weights = job.distributed(str(record), **options)
    state = json.loads((settings().staging_root / job.last_job_id / "state.json").read_text())
    return weights, state, trained_batches(record), job.last_job_id


def trained_batches(record) -> dict[tuple[int, int], list[int]]:
    """(rank, step) -> first token of each sequence, from the attempt whose step counted (the last)."""
    batches = {}
    for rank in range(2):
        for line in open(f"{record}.{rank}"):
            _, step, firsts = json.loads(line)
            batches[(rank, step)] = firsts
    return batches


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    with home_of_its_own(tmp_path_factory):
        weights, state, batches, _ = run(tmp_path_factory.mktemp("plain"), "plain")
    assert len(state["attempts"]) == 1 and len(batches) == 2 * BATCHES * EPOCHS
    return weights, batches


def test_a_checkpoint_request_saves_signed_stops_and_the_next_attempt_resumes_exactly(tmp_path, uninterrupted):
    weights, state, batches, job_id = run(tmp_path, "stopped", stop_step=BATCHES + 2)  # mid second epoch
    assert [a["status"] for a in state["attempts"]][-1] == "succeeded" and len(state["attempts"]) == 2
    assert state["restarts"] == 0  # a stop for a restart, not a failure
    assert_bitwise_equal(weights[0], uninterrupted[0][0])
    assert_bitwise_equal(weights[1], weights[0])
    assert batches == uninterrupted[1]
    saved = settings().staging_root / job_id / "checkpoints" / "lightning"
    marker = json.loads((saved / f"step-{BATCHES + 3:010d}.ckpt.signed.json").read_text())
    assert marker["signed"]["job_id"] == job_id and len(marker["mac"]) == 64


def test_a_changed_checkpoint_is_not_loaded_and_the_next_attempt_starts_over(tmp_path, uninterrupted):
    forged = tmp_path / "the-forgery-ran"
    weights, state, batches, _ = run(tmp_path, "forged", stop_step=4, forge=str(forged))
    assert len(state["attempts"]) == 2 and state["attempts"][-1]["status"] == "succeeded"
    assert not forged.exists()
    attempts = [json.loads(line)[:2] for line in open(tmp_path / "forged.jsonl.0")]
    assert attempts[4:6] == [[0, 4], [1, 0]]  # the second attempt trained from its first step
    assert_bitwise_equal(weights[0], uninterrupted[0][0])  # from scratch, to the same end
    assert batches == uninterrupted[1]


def test_a_killed_rank_resumes_from_the_last_periodic_checkpoint_exactly(tmp_path, uninterrupted):
    weights, state, batches, _ = run(tmp_path, "killed", kill_step=7, every_n_train_steps=3, max_restarts=1)
    assert [a["status"] for a in state["attempts"]] == ["failed", "succeeded"] and state["restarts"] == 1
    assert_bitwise_equal(weights[0], uninterrupted[0][0])
    assert batches == uninterrupted[1]


def test_a_stop_asked_for_inside_a_gradient_accumulation_waits_for_its_optimizer_step(tmp_path, monkeypatch):
    """In one process: a request between two accumulated batches saves after the step, and resumes exactly."""
    import lightning.pytorch as pl
    import torch

    from sparkgpu import runtime
    from sparkgpu.train.lightning import JobCheckpoints, latest_checkpoint_path

    monkeypatch.setenv("SPARKGPU_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))
    monkeypatch.setattr(runtime, "_checkpoint_requested", __import__("threading").Event())

    class TinyLM(pl.LightningModule):
        def __init__(self, stop_at_batch=None):
            super().__init__()
            torch.manual_seed(0)
            self.embed, self.head = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)
            self.stop_at_batch, self.batches = stop_at_batch, 0

        def training_step(self, batch, batch_idx):
            self.batches += 1
            if self.batches == self.stop_at_batch:
                runtime.request_checkpoint()
            logits = self.head(self.embed(batch[:, :-1]))
            return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    def fit(model, ckpt_path=None):
        trainer = pl.Trainer(
            max_epochs=EPOCHS,
            accumulate_grad_batches=2,
            callbacks=[JobCheckpoints(handle_sigterm=False)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, train_dataloaders=RankBatches(0, 1), ckpt_path=ckpt_path)

    fit(plain := TinyLM())
    with pytest.raises(runtime.StopForRestart):
        fit(TinyLM(stop_at_batch=3))  # the first batch of the second accumulation
    runtime._checkpoint_requested.clear()
    resumed_from = latest_checkpoint_path()
    assert resumed_from.endswith("step-0000000002.ckpt")  # after the second optimizer step, not before
    fit(resumed := TinyLM(), ckpt_path=resumed_from)
    assert_bitwise_equal(resumed.state_dict(), plain.state_dict())


def test_a_trainer_with_a_checkpoint_io_of_its_own_is_left_alone_with_a_warning(tmp_path, monkeypatch, caplog):
    import logging
    import threading

    import lightning.pytorch as pl
    import torch
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from sparkgpu import runtime
    from sparkgpu.train.lightning import JobCheckpoints

    monkeypatch.setenv("SPARKGPU_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))
    monkeypatch.setattr(runtime, "_checkpoint_requested", threading.Event())
    runtime.request_checkpoint()

    class TheirIO(TorchCheckpointIO):
        pass

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(SEQ, 1)

        def training_step(self, batch, batch_idx):
            return self.head(batch.float()).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = pl.Trainer(
        max_epochs=1,
        plugins=[TheirIO()],
        callbacks=[JobCheckpoints(handle_sigterm=False)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with caplog.at_level(logging.WARNING, logger="sparkgpu.train.lightning"):
        trainer.fit(Tiny(), train_dataloaders=RankBatches(0, 1))  # no stop: it saves nothing for the job
    assert type(trainer.strategy.checkpoint_io) is TheirIO and "TheirIO" in caplog.text
    assert not (tmp_path / "checkpoints").exists()
