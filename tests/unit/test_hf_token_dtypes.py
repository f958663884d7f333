"""Token ids stored as int32, uint16, uint32 or int64 reach a Hugging Face model as int64, unchanged.

Megatron and litdata store token ids as ``uint16`` or ``int32``, ``data.tokenize`` as ``int32``; HF
models index their embeddings and compute their loss with ``int64`` only. Every loader a Trainer
reads (token blocks, packed SFT rows, MDS datasets and their mixtures) is read here the way the
patched Trainer reads it, and the batches must be ``int64`` holding exactly the stored values,
while the shards on disk keep the dtype they were written with.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from sparkgpu import data
from sparkgpu.hf.datasets import dataloader_for, train_dataset

DTYPES = ["int32", "uint16", "uint32", "int64"]
SEQ = 16


def _top(dtype: str) -> int:
    """A token id near the top of what ``dtype`` holds (above the signed range of the next smaller
    type), so a sign or width mix-up changes it."""
    return {"uint16": 65_000, "int32": 2_000_000_000, "uint32": 4_000_000_000, "int64": 9_000_000_000}[dtype]


def _documents(dtype: str, count: int = 60, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    top = _top(dtype)
    return [rng.integers(top - 1000, top, int(rng.integers(3, 40))).astype(dtype) for _ in range(count)]


def _write(path, columns: dict[str, str], rows: list[dict]) -> str:
    from streaming import MDSWriter

    with MDSWriter(out=str(path), columns=columns, size_limit=1 << 12) as writer:
        for row in rows:
            writer.write(row)
    return str(path)


def _encodings(path: str) -> dict[str, str]:
    with open(os.path.join(path, "index.json")) as handle:
        shard = json.load(handle)["shards"][0]
    return dict(zip(shard["column_names"], shard["column_encodings"]))


def _batches(loader) -> list[dict]:
    """The loader's epoch 0 as the patched Trainer reads it, and as ``train_dataset`` yields it."""
    through_trainer = list(dataloader_for(loader))
    loader.set_epoch(0)
    wrapped = list(train_dataset(loader))
    assert len(through_trainer) == len(wrapped) > 0
    for a, b in zip(through_trainer, wrapped):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return through_trainer


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_blocks_reach_the_model_as_int64_equal_to_the_stored_tokens(tmp_path, dtype):
    docs = _documents(dtype)
    path = _write(tmp_path / "tokens", {"ids": f"ndarray:{dtype}"}, [{"ids": d} for d in docs])
    loader = data.token_dataset(local=path, column="ids", seq_len=SEQ, batch_size=3, eos_id=7, rank=0, world_size=1)
    stream = np.concatenate([np.append(d.astype(np.int64), 7) for d in docs])
    blocks = []
    for batch in _batches(loader):
        assert set(batch) == {"input_ids", "labels"}
        assert batch["input_ids"].dtype == torch.int64 and batch["labels"].dtype == torch.int64
        torch.testing.assert_close(batch["labels"], batch["input_ids"])
        blocks.append(batch["input_ids"].numpy())
    blocks = np.concatenate(blocks)
    assert len(blocks) == loader.num_blocks
    np.testing.assert_array_equal(blocks[:, :-1].ravel(), stream[: len(blocks) * SEQ])
    np.testing.assert_array_equal(blocks[:, 1:].ravel(), stream[1 : len(blocks) * SEQ + 1])
    assert _encodings(path)["ids"] == f"ndarray:{dtype}"  # nothing rewritten on disk
    assert next(iter(loader)).dtype == torch.from_numpy(np.zeros(1, dtype)).dtype  # the loader's own batches


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_sft_rows_reach_the_model_as_int64_equal_to_the_stored_tokens(tmp_path, dtype):
    docs = _documents(dtype, seed=1)
    rows = [{"input_ids": d, "loss_mask": np.ones(len(d), np.uint8)} for d in docs]
    path = _write(tmp_path / "sft", {"input_ids": f"ndarray:{dtype}", "loss_mask": "ndarray:uint8"}, rows)
    loader = data.sft_dataset(
        local=path, seq_len=SEQ, batch_size=4, attention_mask=True, pad_id=5, rank=0, world_size=1
    )
    tokens = []
    for batch in _batches(loader):
        assert set(batch) == {"input_ids", "labels", "position_ids", "attention_mask"}
        assert all(value.dtype == torch.int64 for value in batch.values())
        real = batch["attention_mask"] == 1
        tokens.extend(batch["input_ids"][real].tolist())
        labelled = batch["labels"] != -100
        torch.testing.assert_close(batch["labels"][labelled], batch["input_ids"][labelled])
    kept = [int(t) for d in docs for t in d[:SEQ]]  # documents longer than a row are truncated
    assert sorted(tokens) == sorted(kept)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mds_batches_and_mixtures_reach_the_model_as_int64_equal_to_the_stored_tokens(tmp_path, dtype):
    top = _top(dtype)
    paths = []
    for stream in range(2):
        rows = [
            {
                "input_ids": (top - 100 * stream - np.arange(8)).astype(dtype),
                "labels": (top - 100 * stream - np.arange(8) - i).astype(dtype),
                "pixels": np.full(4, i, np.uint8),
                "sample": 1000 * stream + i,
            }
            for i in range(30)
        ]
        columns = {
            "input_ids": f"ndarray:{dtype}:8",
            "labels": f"ndarray:{dtype}:8",
            "pixels": "ndarray:uint8:4",
            "sample": "int64",
        }
        paths.append(_write(tmp_path / f"s{stream}", columns, rows))
    single = data.dataset(local=paths[0], batch_size=8, rank=0, world_size=1)
    mixture = data.dataset(
        streams=[data.Stream(local=p) for p in paths], batch_size=8, shuffle=True, seed=2, rank=0, world_size=1
    )
    for loader in (single, mixture):
        seen = 0
        for batch in _batches(loader):
            assert batch["input_ids"].dtype == torch.int64 and batch["labels"].dtype == torch.int64
            assert batch["pixels"].dtype == torch.uint8  # not an id: left as stored
            stream, i = batch["sample"] // 1000, batch["sample"] % 1000
            want = top - 100 * stream[:, None] - torch.arange(8)
            torch.testing.assert_close(batch["input_ids"], want)
            torch.testing.assert_close(batch["labels"], want - i[:, None])
            seen += len(batch["sample"])
        assert seen == loader.num_samples


def _qwen2(vocab_size: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(config)


@pytest.mark.parametrize("dtype", ["int32", "uint16"])
def test_a_trainer_trains_a_step_on_tokens_stored_as(tmp_path, dtype):
    from transformers import Trainer, TrainingArguments

    from sparkgpu.hf import resumable

    vocab = 96
    rng = np.random.default_rng(3)
    docs = [rng.integers(1, vocab, int(rng.integers(5, 30))).astype(dtype) for _ in range(40)]
    path = _write(tmp_path / "tokens", {"ids": f"ndarray:{dtype}"}, [{"ids": d} for d in docs])
    loader = data.token_dataset(local=path, column="ids", seq_len=SEQ, batch_size=2, eos_id=0, rank=0, world_size=1)
    first = next(iter(loader)).to(torch.int64)
    loader.set_epoch(0)
    model = _qwen2(vocab)
    before = model.model.embed_tokens.weight.detach().clone()
    seen = []
    model.register_forward_pre_hook(lambda _module, _args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=1)
    result = resumable(Trainer(model=model, args=args, train_dataset=loader)).train()
    assert result.global_step == 1 and np.isfinite(result.training_loss)
    (inputs,) = seen
    assert inputs["input_ids"].dtype == torch.int64 and inputs["labels"].dtype == torch.int64
    torch.testing.assert_close(inputs["input_ids"], first)  # the stored tokens, in the loader's order
    torch.testing.assert_close(inputs["labels"], first)
    assert not torch.equal(model.model.embed_tokens.weight.detach(), before)  # the step updated the model
