"""TRL's SFTTrainer trains on sparkgpu's packed SFT loader at the job's world size, and resumes it by position.

Prompt/completion pairs are tokenized by ``data.tokenize`` (a word-level tokenizer, no hub) and
read by ``data.sft_dataset`` on two gloo CPU ranks; an ``SFTTrainer`` with a LoRA adapter gets
the loader through ``sparkgpu.hf.as_hf_dataset``. A forward hook records, per rank and step,
the documents of every packed row (cut where ``position_ids`` restart) with their ids and
labels: each document must be trained on once per epoch across the ranks, whole, with its
prompt, its first token and the padding out of the loss. Rank 1 is killed after a checkpoint;
the resumed attempt must continue at the loader's saved position, with the same documents and
loss at every step as an uninterrupted run.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.test_hf_trainer import VOCAB, read_records, tiny_llama, word_tokenizer

from sparkgpu import distributed
from sparkgpu.config import settings

# One worker runs the module: its module-scoped fixtures (a reference run, built data) are built
# once, not once on every worker a test of it lands on.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("trl-loader")]

WORLD, DOCS, SEQ, BATCH, EPOCHS, SAVE_STEPS = 2, 40, 32, 2, 2, 3
PAD, EOS, FIRST_WORD = 0, 1, 3  # word_tokenizer's ids: "<pad>", "<eos>", then "w0", "w1", ...


@pytest.fixture(autouse=True)
def _in_a_folder_of_its_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def pairs() -> tuple[list[str], list[str]]:
    """Prompts whose first word names the document, completions of 2 to 11 words."""
    import numpy as np

    rng = np.random.default_rng(0)
    words = VOCAB - FIRST_WORD
    prompts = [
        " ".join([f"w{i}"] + [f"w{rng.integers(0, words)}" for _ in range(rng.integers(1, 6))]) for i in range(DOCS)
    ]
    completions = [
        " " + " ".join(f"w{rng.integers(0, words)}" for _ in range(rng.integers(2, 12))) for _ in range(DOCS)
    ]
    return prompts, completions


def expected_documents() -> dict[int, tuple[list[int], list[int]]]:
    """Document -> (its ids, its labels): -100 on the prompt and on the first token, EOS a target."""
    tok = word_tokenizer()
    docs = {}
    for i, (prompt, completion) in enumerate(zip(*pairs())):
        head, tail = tok(prompt)["input_ids"], tok(completion)["input_ids"] + [EOS]
        ids = head + tail
        docs[i] = (ids, [-100] * len(head) + tail)
    return docs


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    import pyarrow as pa

    from sparkgpu import data

    prompts, completions = pairs()
    out = tmp_path_factory.mktemp("sft") / "tokens"
    result = data.tokenize(
        pa.table({"prompt": prompts, "completion": completions}), str(out), tokenizer=word_tokenizer(), progress=False
    )
    assert result.stats["documents"] == DOCS
    return result.url


def segments(ids, labels, positions):
    """The documents of one packed row, cut where ``position_ids`` restart (padding left out)."""
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
    found = []
    for begin, end in zip(starts, starts[1:]):
        if ids[begin] != PAD:
            found.append({"doc": ids[begin] - FIRST_WORD, "ids": ids[begin:end], "labels": labels[begin:end]})
        else:
            assert set(ids[begin:end]) == {PAD} and set(labels[begin:end]) == {-100}, "padding is no target"
    return found


def sft_on_loader(data_url, record_file, kill_step=None, as_written=False):
    """An SFTTrainer with LoRA as written for GPUs; its dataset is the packed loader: as it is
    (``as_written``, the rank's patch of TRL wraps it), or through ``as_hf_dataset``."""
    import os
    import signal

    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    import sparkgpu.hf
    from sparkgpu import data, runtime

    rows = data.sft_dataset(local=data_url, seq_len=SEQ, batch_size=BATCH, shuffle=True, seed=3)
    config = SFTConfig(
        output_dir="out",
        num_train_epochs=EPOCHS,
        learning_rate=1e-2,
        save_steps=SAVE_STEPS,
        report_to="none",
        seed=7,
        dataset_kwargs=None if as_written else {"skip_prepare_dataset": True},
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = SFTTrainer(
        model=tiny_llama(),
        args=config,
        train_dataset=rows if as_written else sparkgpu.hf.as_hf_dataset(rows),
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
        ids, labels, positions = (kwargs[k].tolist() for k in ("input_ids", "labels", "position_ids"))
        entry = {
            "attempt": runtime.attempt(),
            "step": step,
            "loss": output.loss.item().hex(),
            "shape": list(kwargs["input_ids"].shape),
            "attention_mask": "attention_mask" in kwargs,
            "use_cache": kwargs.get("use_cache"),
            "rows": [segments(*row) for row in zip(ids, labels, positions)],
        }
        record.write(json.dumps(entry) + "\n")
        record.flush()

    trainer.model.register_forward_hook(on_forward, with_kwargs=True)
    trainer.train()
    record.close()
    return {"world_size": trainer.args.world_size, "steps": trainer.state.global_step, "rows_per_epoch": len(rows)}


def run(data_url, tmp_path, tag, **options):
    record = tmp_path / f"{tag}.jsonl"
    (tmp_path / tag).mkdir()
    policy = {k: options.pop(k) for k in ("max_restarts",) if k in options}
    job = distributed(gpus=WORLD, gpu_type="cpu", **policy)(sft_on_loader)
    import os

    os.chdir(tmp_path / tag)  # each job its own output_dir (the fixture restores the folder)
    states = job.distributed(data_url, str(record), **options)
    run_dir = settings().staging_root / job.last_job_id
    state = json.loads((run_dir / "state.json").read_text())
    return states, state, read_records(record), run_dir


def assert_each_document_once_per_epoch_and_masked(steps, steps_per_epoch):
    expected = expected_documents()
    for epoch in range(EPOCHS):
        seen = []
        for (_rank, step), entry in steps.items():
            if (step - 1) // steps_per_epoch != epoch:
                continue
            assert entry["shape"][1] == SEQ, "rows of seq_len as the loader cut them, not re-packed"
            assert not entry["attention_mask"] and entry["use_cache"] is False, "documents kept apart"
            for row in entry["rows"]:
                for doc in row:
                    ids, labels = expected[doc["doc"]]
                    assert doc["ids"] == ids, f"document {doc['doc']} not whole in its row"
                    assert doc["labels"] == [-100] + labels[1:], f"document {doc['doc']}: wrong labels"
                    seen.append(doc["doc"])
        assert sorted(seen) == list(range(DOCS)), f"epoch {epoch} skipped or repeated documents"


def test_sft_trainer_trains_each_packed_document_once_and_resumes_at_the_loader_position(sft_data, tmp_path):
    # The uninterrupted run passes the loader as written; the killed one through as_hf_dataset:
    # the same rows and losses at every step show the two ways are one.
    states, state, plain, _ = run(sft_data, tmp_path, "plain", as_written=True)
    assert [s["world_size"] for s in states] == [WORLD, WORLD]
    per_epoch = states[0]["rows_per_epoch"]
    assert states[0]["steps"] == EPOCHS * per_epoch > SAVE_STEPS + 1
    assert sorted(plain) == [(r, s) for r in range(WORLD) for s in range(1, EPOCHS * per_epoch + 1)]
    assert_each_document_once_per_epoch_and_masked(plain, per_epoch)

    kill = SAVE_STEPS + 2
    _, state, steps, run_dir = run(sft_data, tmp_path, "killed", kill_step=kill, max_restarts=1)
    assert [a["status"] for a in state["attempts"]] == ["failed", "succeeded"]
    assert min(e["step"] for e in steps.values() if e["attempt"] == 1) == SAVE_STEPS + 1  # from checkpoint-3
    assert_each_document_once_per_epoch_and_masked(steps, per_epoch)
    assert {k: (v["loss"], v["rows"]) for k, v in steps.items()} == {
        k: (v["loss"], v["rows"]) for k, v in plain.items()
    }, "the resumed run trained on other rows or reached another loss"
    log = (run_dir / "attempts" / "1" / "logs" / "rank-1.log").read_text()
    assert "resumes at its saved position" in log


def test_the_view_leaves_the_loader_position_and_refuses_trl_preparation(sft_data, tmp_path):
    from trl import SFTConfig, SFTTrainer

    import sparkgpu.hf
    from sparkgpu import data
    from sparkgpu.errors import ConfigurationError

    rows = data.sft_dataset(local=sft_data, seq_len=SEQ, batch_size=BATCH, rank=0, world_size=1)
    view = sparkgpu.hf.as_hf_dataset(rows)
    first = next(iter(view))
    assert sorted(first) == ["input_ids", "labels", "position_ids"] and first["input_ids"].shape == (SEQ,)
    assert rows.state_dict()["rows_consumed"] == 0, "looking at the view moved the loader"
    assert next(iter(rows))["input_ids"][0].tolist() == first["input_ids"].tolist()

    config = SFTConfig(output_dir="out", report_to="none", use_cpu=True)  # no skip_prepare_dataset
    with pytest.raises(ConfigurationError, match="skip_prepare_dataset"):
        SFTTrainer(model=tiny_llama(), args=config, train_dataset=view, processing_class=word_tokenizer())


def test_a_patched_sft_trainer_takes_the_loader_as_it_is(sft_data, monkeypatch):
    """What the rank's patch on importing TRL would give: ``train_dataset=data.sft_dataset(...)`` as written."""
    from trl import SFTConfig, SFTTrainer

    import sparkgpu.hf
    from sparkgpu import data
    from sparkgpu.hf.sft import patch_sft_trainer

    monkeypatch.setattr(SFTTrainer, "__init__", SFTTrainer.__init__)  # put back after the test
    patch_sft_trainer(SFTTrainer)
    rows = data.sft_dataset(local=sft_data, seq_len=SEQ, batch_size=BATCH, rank=0, world_size=1)
    config = SFTConfig(output_dir="out", report_to="none", use_cpu=True, max_steps=2, save_strategy="no")
    trainer = sparkgpu.hf.resumable(
        SFTTrainer(model=tiny_llama(), args=config, train_dataset=rows, processing_class=word_tokenizer())
    )
    assert config.dataset_kwargs == {"skip_prepare_dataset": True}
    shapes = []
    trainer.model.register_forward_hook(
        lambda module, args, kwargs, out: shapes.append(
            sorted((k, tuple(v.shape)) for k, v in kwargs.items() if k.endswith("_ids") or k == "labels")
        ),
        with_kwargs=True,
    )
    trainer.train()
    assert shapes == [[("input_ids", (BATCH, SEQ)), ("labels", (BATCH, SEQ)), ("position_ids", (BATCH, SEQ))]] * 2
    assert rows.state_dict()["rows_consumed"] == 2 * BATCH, "the trainer read the loader itself, two batches"
