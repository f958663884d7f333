"""A Hugging Face Trainer written as for GPUs runs at the job's world size and resumes by itself.

Two gloo CPU ranks train a tiny Llama (built from a config: no hub) with a plain
``Trainer(...)``: no ``use_cpu``, no ``resume_from_checkpoint``, nothing from sparkgpu. A
forward hook records, per rank and step, the samples trained on and the loss. Rank 1 is killed
with SIGKILL late in the run, or the runtime cap stops the job; the restarted attempt must end
bitwise equal to an uninterrupted run (weights, optimizer state, the loss of every step) with
every sample trained on once per epoch. A writer of the checkpoint store plants checkpoints
that must be refused without being unpickled.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest

from tests.integration.test_transformer_restart_exactness import assert_bitwise_equal

from sparkgpu import distributed
from sparkgpu.config import settings
from tests.integration.homes import home_of_its_own

# One worker runs this module and test_hf_trainer_stops.py: the uninterrupted run both compare
# against (tests/integration/conftest.py) is trained once.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("hf-trainer")]


@pytest.fixture(autouse=True)
def _in_a_folder_of_its_own(tmp_path, monkeypatch):
    """Ranks run in the client's folder, and the Trainers write ``output_dir="out"`` there."""
    monkeypatch.chdir(tmp_path)


WORLD, BATCH, SAMPLES, EPOCHS, SEQ, VOCAB = 2, 4, 48, 2, 12, 64
STEPS_PER_EPOCH = SAMPLES // (BATCH * WORLD)
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH  # 12
SAVE_STEPS = 3


class Planted:
    """Unpickles as ``open(path, "w")``: the file appears if anything unpickles it."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(config)


class Samples:
    """A map-style dataset whose first two tokens name the sample."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        import torch

        g = torch.Generator().manual_seed(i)
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g)
        ids[0], ids[1] = 1 + i // VOCAB, i % VOCAB
        return {"input_ids": ids, "labels": ids.clone()}


def _plant(store_dir: str, sentinel: str) -> None:
    """What a writer of the job's checkpoint store can do once the job sealed steps 3, 6 and 9."""
    import shutil
    from pathlib import Path

    root = Path(store_dir) / "hf"
    payload = pickle.dumps(Planted(sentinel))
    (root / "checkpoint-9" / "optimizer.pt").write_bytes(payload)  # a genuine seal, a changed file
    for step, keep_mac in ((99, True), (98, False)):
        planted = root / f"checkpoint-{step}"
        shutil.copytree(root / "checkpoint-6", planted)
        marker = json.loads((planted / "_SEALED.json").read_text())
        marker["step"] = step  # its MAC no longer matches
        if not keep_mac:
            marker.pop("mac")
        (planted / "_SEALED.json").write_text(json.dumps(marker))
        (planted / "optimizer.pt").write_bytes(payload)
        (planted / "rng_state_0.pth").write_bytes(payload)


def train_plainly(
    record_file,
    kill_step=None,
    step_sleep=0.0,
    plant=None,
    kill_executor_of=None,
    save_steps=SAVE_STEPS,
    hold_from=None,
):
    """A Trainer as people write it for GPUs; the test's only additions are the hook and the faults.

    Faults in the first attempt, at step ``kill_step + 1``: rank 1 kills itself (SIGKILL), or,
    with ``kill_executor_of``, that rank kills the Spark executor it runs under (a lost machine).
    ``hold_from``: from that step on, the first attempt waits in each step until it is asked to
    checkpoint (the runtime cap's request), so the cap always lands mid-training.
    """
    import os
    import signal
    import time

    import psutil
    from transformers import Trainer, TrainingArguments

    from sparkgpu import runtime
    from sparkgpu.train import sealed_files

    model = tiny_llama()
    args = TrainingArguments(
        output_dir="out",
        per_device_train_batch_size=BATCH,
        num_train_epochs=EPOCHS,
        learning_rate=3e-3,
        weight_decay=0.1,
        save_steps=save_steps,
        logging_steps=1,
        report_to="none",
        seed=7,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Samples())
    rank = runtime.get_global_rank()
    record = open(f"{record_file}.{rank}", "a")

    def on_forward(module, inputs, kwargs, output):
        if not module.training:
            return
        step = trainer.state.global_step + 1
        if kill_step is not None and runtime.attempt() == 0 and step == kill_step + 1:
            # The newest save's seal is written on a thread: wait for its marker, or on a loaded
            # machine the fault may come first and the restart truly starts from an older one.
            newest = f"checkpoint-{kill_step // save_steps * save_steps}"
            sealed = os.path.join(
                runtime.checkpoint_dir(), sealed_files.TRAINER_FOLDER, newest, sealed_files.SEALED_MARKER
            )
            while not os.path.exists(sealed):
                time.sleep(0.01)
            if kill_executor_of is not None and rank == kill_executor_of:
                parents = psutil.Process().parents()
                (executor,) = [p for p in parents if "CoarseGrainedExecutorBackend" in p.cmdline()]
                os.kill(executor.pid, signal.SIGKILL)  # the machine is gone: this rank goes with it
            elif kill_executor_of is None and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if plant:
                _plant(runtime.checkpoint_dir(), plant)
        ids = kwargs["input_ids"]
        entry = {
            "attempt": runtime.attempt(),
            "step": step,
            "loss": output.loss.item().hex(),
            "samples": [int(r[0]) * VOCAB + int(r[1]) - VOCAB for r in ids],
        }
        record.write(json.dumps(entry) + "\n")
        record.flush()
        if runtime.attempt() == 0:
            time.sleep(step_sleep)
            held = time.monotonic()
            while hold_from is not None and step >= hold_from and not runtime.should_checkpoint():
                assert time.monotonic() - held < 300, "the held attempt was never asked to checkpoint"
                time.sleep(0.1)

    model.register_forward_hook(on_forward, with_kwargs=True)
    trainer.train()
    record.close()
    optimizer = trainer.optimizer.state_dict()
    return {
        "world_size": trainer.args.world_size,
        "process_zero": trainer.is_world_process_zero(),
        "device": str(trainer.args.device),
        "model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": {f"{p}.{k}": v.clone() for p, s in optimizer["state"].items() for k, v in s.items()},
    }


def run(tmp_path, tag, **options):
    record = tmp_path / f"{tag}.jsonl"
    policy = {k: options.pop(k) for k in ("max_restarts", "max_runtime", "checkpoint_grace") if k in options}
    job = distributed(gpus=WORLD, gpu_type="cpu", **policy)(train_plainly)
    states = job.distributed(str(record), **options)
    state = json.loads((settings().staging_root / job.last_job_id / "state.json").read_text())
    return states, state, read_records(record), job.last_job_id


def read_records(record) -> dict[tuple[int, int], dict]:
    """(rank, step) -> what that step trained on, from the last attempt that ran it."""
    steps = {}
    for rank in range(WORLD):
        for line in open(f"{record}.{rank}"):
            entry = json.loads(line)
            steps[(rank, entry["step"])] = entry
    return steps


def assert_every_sample_once_per_epoch(steps):
    for epoch in range(EPOCHS):
        seen = [s for (rank, step), e in steps.items() if (step - 1) // STEPS_PER_EPOCH == epoch for s in e["samples"]]
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch} skipped or repeated samples"


def test_a_plain_trainer_trains_at_the_job_world_size(trainer_uninterrupted):
    states, state, steps = trainer_uninterrupted
    assert len(state["attempts"]) == 1
    assert [s["world_size"] for s in states] == [WORLD, WORLD]
    assert [s["process_zero"] for s in states] == [True, False], "one rank, not both, logs as process zero"
    assert {s["device"].split(":")[0] for s in states} == {"cpu"}
    assert sorted(steps) == [(r, s) for r in range(WORLD) for s in range(1, TOTAL_STEPS + 1)]
    assert_every_sample_once_per_epoch(steps)
    assert_bitwise_equal(states[0], states[1])


def assert_same_run(states, steps, trainer_uninterrupted, note):
    plain_states, _, plain_steps = trainer_uninterrupted
    assert {k: (v["loss"], v["samples"]) for k, v in steps.items()} == {
        k: (v["loss"], v["samples"]) for k, v in plain_steps.items()
    }, f"the loss curve or the data differ {note}"
    assert_every_sample_once_per_epoch(steps)
    for rank_state in states:
        assert_bitwise_equal(rank_state, plain_states[0])


def test_a_sigkilled_rank_resumes_bitwise_equal_and_planted_checkpoints_are_refused(
    trainer_uninterrupted, tmp_path, capfd
):
    sentinel = tmp_path / "unpickled"
    states, state, steps, job_id = run(tmp_path, "killed", kill_step=10, max_restarts=1, plant=str(sentinel))
    assert [a["status"] for a in state["attempts"]] == ["failed", "succeeded"]
    assert not sentinel.exists(), "a planted checkpoint was unpickled"
    # checkpoint-9's seal is genuine but a file changed: the attempt resumes from step 6.
    assert min(e["step"] for e in steps.values() if e["attempt"] == 1) == 7
    assert_same_run(states, steps, trainer_uninterrupted, "(rank 1 killed after step 10)")
    # The client names the newest checkpoint whose seal verifies (its files are hashed by the ranks).
    out = capfd.readouterr().out
    assert "restarting from step 9 (restart 1 of 1)" in out, out[-2000:]


def test_the_runtime_cap_saves_stops_and_resumes_bitwise_equal(trainer_uninterrupted, tmp_path):
    # The first attempt holds at step 3 until the cap's request, 30 s after its ranks started (a
    # loaded machine may take most of that to build the Trainer: then it stops at step 1).
    states, state, steps, _ = run(tmp_path, "capped", hold_from=3, max_runtime=60, checkpoint_grace=30)
    assert state["preemptions"] == 1 and state["restarts"] == 0, state
    assert state["attempts"][-1]["status"] == "succeeded"
    assert {e["attempt"] for e in steps.values()} >= {0, 1}
    assert_same_run(states, steps, trainer_uninterrupted, "(runtime cap)")


# -- a sparkgpu loader as the Trainer's train_dataset ---------------------------------------

BLOCKS = 32  # token blocks per epoch: 4 steps of 4 blocks on each of 2 ranks
LOADER_BATCH = 4
LOADER_STEPS = EPOCHS * BLOCKS // (LOADER_BATCH * WORLD)  # 8


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    """Documents of random tokens that cut into exactly ``BLOCKS`` blocks of ``SEQ`` tokens."""
    import numpy as np
    from streaming import MDSWriter

    rng = np.random.default_rng(0)
    wanted = BLOCKS * (SEQ - 1) + 1  # blocks of SEQ tokens overlap by one
    docs, total = [], 0
    while total < wanted:
        length = min(int(rng.integers(5, 40)), wanted - total - 1) or 1
        docs.append(rng.integers(1, VOCAB, length, dtype=np.int64))
        total += length + 1
    out = tmp_path_factory.mktemp("tokens") / "mds"
    with MDSWriter(out=str(out), columns={"ids": "ndarray:int64"}, size_limit=1 << 10) as writer:
        for doc in docs:
            writer.write({"ids": doc})
    return str(out)


def train_on_loader(data_dir, record_file, dispatch_batches=None, kill_step=None):
    """A Trainer whose train_dataset is ``data.token_dataset(...)`` as it is."""
    import hashlib
    import os
    import signal

    from transformers import Trainer, TrainingArguments

    from sparkgpu import data, runtime

    blocks = data.token_dataset(
        local=data_dir, column="ids", seq_len=SEQ - 1, batch_size=LOADER_BATCH, eos_id=0, shuffle=True, seed=3
    )
    accelerator_config = {} if dispatch_batches is None else {"dispatch_batches": dispatch_batches}
    args = TrainingArguments(
        output_dir="out",
        num_train_epochs=EPOCHS,
        learning_rate=3e-3,
        save_steps=3,
        report_to="none",
        seed=7,
        accelerator_config=accelerator_config,
    )
    model = tiny_llama()
    trainer = Trainer(model=model, args=args, train_dataset=blocks)
    rank = runtime.get_global_rank()
    record = open(f"{record_file}.{rank}", "a")

    def on_forward(module, inputs, kwargs, output):
        step = trainer.state.global_step + 1
        if kill_step is not None and runtime.attempt() == 0 and rank == 1 and step == kill_step + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        ids = kwargs["input_ids"]
        entry = {
            "attempt": runtime.attempt(),
            "step": step,
            "loss": output.loss.item().hex(),
            "samples": [hashlib.sha256(r.numpy().tobytes()).hexdigest()[:16] for r in ids],
        }
        record.write(json.dumps(entry) + "\n")
        record.flush()

    model.register_forward_hook(on_forward, with_kwargs=True)
    trainer.train()
    record.close()
    return {"world_size": trainer.args.world_size, "stats": blocks.state_dict()}


@pytest.fixture(scope="module")
def all_blocks(token_dir):
    import hashlib

    from sparkgpu import data

    loader = data.token_dataset(
        local=token_dir, column="ids", seq_len=SEQ - 1, batch_size=1, eos_id=0, rank=0, world_size=1
    )
    hashes = sorted(hashlib.sha256(b[0].numpy().tobytes()).hexdigest()[:16] for b in loader)
    assert len(hashes) == BLOCKS == len(set(hashes))
    return hashes


def run_loader(token_dir, tmp_path, tag, **options):
    record = tmp_path / f"{tag}.jsonl"
    policy = {k: options.pop(k) for k in ("max_restarts",) if k in options}
    job = distributed(gpus=WORLD, gpu_type="cpu", **policy)(train_on_loader)
    states = job.distributed(token_dir, str(record), **options)
    state = json.loads((settings().staging_root / job.last_job_id / "state.json").read_text())
    run_dir = settings().staging_root / job.last_job_id
    return states, state, read_records(record), run_dir


def assert_every_block_once_per_epoch(steps, all_blocks):
    per_epoch = LOADER_STEPS // EPOCHS
    assert sorted(steps) == [(r, s) for r in range(WORLD) for s in range(1, LOADER_STEPS + 1)]
    for epoch in range(EPOCHS):
        seen = [h for (rank, step), e in steps.items() if (step - 1) // per_epoch == epoch for h in e["samples"]]
        assert sorted(seen) == all_blocks, f"epoch {epoch} skipped or repeated blocks"


@pytest.fixture(scope="module")
def loader_plain(token_dir, tmp_path_factory):
    """The loader's Trainer run to its end with Accelerate's default dispatch: a run of its own in
    the dispatch test, the reference of the resumed one."""
    with home_of_its_own(tmp_path_factory, cwd=True):
        return run_loader(token_dir, tmp_path_factory.mktemp("loader"), "plain")


def test_a_loader_as_train_dataset_gives_each_rank_its_share_whatever_the_dispatch(
    token_dir, all_blocks, loader_plain, tmp_path
):
    runs = {}
    for dispatch in (None, False):
        found = (
            loader_plain
            if dispatch is None
            else run_loader(token_dir, tmp_path, "dispatch-False", dispatch_batches=False)
        )
        states, state, steps, _ = found
        assert [s["world_size"] for s in states] == [WORLD, WORLD]
        assert_every_block_once_per_epoch(steps, all_blocks)
        runs[dispatch] = {k: (v["loss"], v["samples"]) for k, v in steps.items()}
    assert runs[None] == runs[False]


def test_a_resumed_trainer_restores_the_loader_position_without_replay(token_dir, all_blocks, loader_plain, tmp_path):
    plain_states, _, plain, _ = loader_plain
    states, state, steps, run_dir = run_loader(token_dir, tmp_path, "killed", kill_step=5, max_restarts=1)
    assert [a["status"] for a in state["attempts"]] == ["failed", "succeeded"]
    assert min(e["step"] for e in steps.values() if e["attempt"] == 1) == 4  # resumed from checkpoint-3
    assert_every_block_once_per_epoch(steps, all_blocks)
    assert {k: (v["loss"], v["samples"]) for k, v in steps.items()} == {
        k: (v["loss"], v["samples"]) for k, v in plain.items()
    }
    log = (run_dir / "attempts" / "1" / "logs" / "rank-1.log").read_text()
    assert "resumes at its saved position" in log


# -- Accelerator() and TRL's SFTTrainer with a LoRA adapter ---------------------------------


def plain_accelerator():
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator()
    ranks = accelerator.gather(torch.tensor([accelerator.process_index]))
    return accelerator.num_processes, accelerator.process_index, str(accelerator.device), ranks.tolist()


def test_a_plain_accelerator_sees_the_job_world():
    results = distributed(gpus=WORLD, gpu_type="cpu")(plain_accelerator).distributed()
    assert [(n, i, device.split(":")[0], ranks) for n, i, device, ranks in results] == [
        (2, 0, "cpu", [0, 1]),
        (2, 1, "cpu", [0, 1]),
    ]


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(VOCAB - 3)]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def sft_with_lora(record_file, kill_step=None):
    """TRL's SFTTrainer with a peft LoraConfig, as written for GPUs."""
    import os
    import random
    import signal

    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from sparkgpu import runtime

    rng = random.Random(0)
    texts = [" ".join(f"w{rng.randrange(VOCAB - 3)}" for _ in range(rng.randrange(4, SEQ - 2))) for _ in range(32)]
    texts = [f"w{i} {t}" for i, t in enumerate(texts)]  # the first word names the sample
    config = SFTConfig(
        output_dir="out",
        per_device_train_batch_size=2,
        num_train_epochs=1,
        learning_rate=1e-2,
        save_steps=3,
        max_length=SEQ,
        report_to="none",
        seed=7,
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    trainer = SFTTrainer(
        model=tiny_llama(),
        args=config,
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=word_tokenizer(),
        peft_config=lora,
    )
    rank = runtime.get_global_rank()
    record = open(f"{record_file}.{rank}", "a")

    def on_forward(module, inputs, kwargs, output):
        if not module.training:
            return
        step = trainer.state.global_step + 1
        if kill_step is not None and runtime.attempt() == 0 and rank == 1 and step == kill_step + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        entry = {
            "attempt": runtime.attempt(),
            "step": step,
            "loss": output.loss.item().hex(),
            "samples": [int(r[0]) - 3 for r in kwargs["input_ids"]],
        }
        record.write(json.dumps(entry) + "\n")
        record.flush()

    trainer.model.register_forward_hook(on_forward, with_kwargs=True)
    trainer.train()
    record.close()
    adapter = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if "lora_" in k}
    optimizer = trainer.optimizer.state_dict()
    return {
        "world_size": trainer.args.world_size,
        "process_zero": trainer.is_world_process_zero(),
        "model": adapter,
        "optimizer": {f"{p}.{k}": v.clone() for p, s in optimizer["state"].items() for k, v in s.items()},
    }


def test_sft_trainer_with_lora_trains_at_the_job_world_size_and_resumes_bitwise_equal(tmp_path):
    results = {}
    for tag, options in (("plain", {}), ("killed", {"kill_step": 4, "max_restarts": 1})):
        (tmp_path / tag).mkdir()
        os.chdir(tmp_path / tag)  # each job its own output_dir (the fixture restores the folder)
        record = tmp_path / f"sft-{tag}.jsonl"
        policy = {k: options.pop(k) for k in ("max_restarts",) if k in options}
        job = distributed(gpus=WORLD, gpu_type="cpu", **policy)(sft_with_lora)
        states = job.distributed(str(record), **options)
        state = json.loads((settings().staging_root / job.last_job_id / "state.json").read_text())
        results[tag] = states, state, read_records(record)
    states, state, steps = results["plain"]
    assert [s["world_size"] for s in states] == [WORLD, WORLD]
    assert [s["process_zero"] for s in states] == [True, False]
    assert states[0]["model"], "no LoRA weights"
    seen = sorted(s for e in steps.values() for s in e["samples"])
    assert seen == list(range(32)), "each sample once across the ranks"
    killed_states, killed_state, killed_steps = results["killed"]
    assert [a["status"] for a in killed_state["attempts"]] == ["failed", "succeeded"]
    assert min(e["step"] for e in killed_steps.values() if e["attempt"] == 1) == 4  # from checkpoint-3
    assert {k: (v["loss"], v["samples"]) for k, v in killed_steps.items()} == {
        k: (v["loss"], v["samples"]) for k, v in steps.items()
    }
    for rank_state in killed_states:
        assert_bitwise_equal(rank_state, states[0])
