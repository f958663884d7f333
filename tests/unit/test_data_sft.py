"""sparkgpu.data.sft_dataset: packed rows keep documents apart, label only targets, cover the epoch once, resume exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparkgpu import data
from sparkgpu.data.loaders.packing import best_fit_decreasing, pack_epoch
from sparkgpu.errors import ConfigurationError

SEQ = 64


def _write(path, docs, masks) -> str:
    from streaming import MDSWriter

    # Small shards: rows draw documents from several shards.
    with MDSWriter(
        out=str(path), columns={"input_ids": "ndarray:int32", "loss_mask": "ndarray:uint8"}, size_limit=1 << 12
    ) as writer:
        for ids, mask in zip(docs, masks):
            writer.write({"input_ids": ids, "loss_mask": mask})
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Documents whose tokens are unique (10 + their position in the whole corpus), so a row tells
    which document and token each of its tokens came from; masks with a prompt and a target part."""
    rng = np.random.default_rng(0)
    lengths = np.clip(np.exp(rng.normal(np.log(20), 0.9, 400)), 2, 150).astype(int)  # some longer than SEQ
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    docs = [np.arange(10 + s, 10 + s + n, dtype=np.int32) for s, n in zip(starts, lengths)]
    masks = []
    for n in lengths:
        prompt = int(rng.integers(0, n))
        masks.append(np.r_[np.zeros(prompt, np.uint8), np.ones(n - prompt, np.uint8)])
    return _write(tmp_path_factory.mktemp("sft") / "corpus", docs, masks), docs, masks


def _open(path, **options):
    defaults = dict(seq_len=SEQ, batch_size=4, rank=0, world_size=1, pad_id=0)
    return data.sft_dataset(local=path, **{**defaults, **options})


def _epoch(loader) -> list[dict]:
    return [dict(batch) for batch in loader]


@pytest.mark.parametrize("overflow", ["truncate", "split"])
def test_every_document_is_in_exactly_one_row_across_ranks_and_only_targets_are_labels(corpus, overflow):
    path, docs, masks = corpus
    token_doc = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)])
    token_mask = np.concatenate(masks)
    seen = []
    for rank in range(3):
        loader = _open(path, rank=rank, world_size=3, shuffle=True, seed=5, overflow=overflow)
        batches = _epoch(loader)
        assert len(batches) == len(loader)
        for batch in batches:
            ids, labels, pos = batch["input_ids"].numpy(), batch["labels"].numpy(), batch["position_ids"].numpy()
            assert ids.shape[1] == SEQ and set(batch) == {"input_ids", "labels", "position_ids"}
            assert batch["input_ids"].dtype == torch.int64 and batch["labels"].dtype == torch.int64
            for row_ids, row_labels, row_pos in zip(ids, labels, pos):
                real = row_ids >= 10
                assert not real[np.argmin(real) :].any() if not real.all() else True  # padding only at the end
                starts = np.flatnonzero(row_pos == 0)
                for begin, end in zip(starts, np.r_[starts[1:], SEQ]):
                    piece = row_ids[begin:end]
                    if piece[0] < 10:
                        assert (piece == 0).all() and (row_labels[begin:end] == -100).all()  # padding
                        continue
                    doc = token_doc[piece[0] - 10]
                    assert (token_doc[piece - 10] == doc).all() and (np.diff(piece) == 1).all()
                    expected = np.where(token_mask[piece - 10] == 1, piece, -100)
                    expected[0] = -100  # never predicted from the document before
                    np.testing.assert_array_equal(row_labels[begin:end], expected)
                    seen.append(piece)
    tokens = np.concatenate(seen)
    assert len(np.unique(tokens)) == len(tokens)  # no token twice: each document in one row of one rank
    if overflow == "split":
        assert len(tokens) == sum(len(d) for d in docs)
    else:
        np.testing.assert_array_equal(
            np.sort(tokens), np.concatenate([d[:SEQ] for d in docs])
        )  # every document, its first SEQ tokens


def test_resume_mid_epoch_is_exact_with_and_without_workers(corpus):
    path, _, _ = corpus
    full = _epoch(_open(path, shuffle=True, seed=3))
    for workers in (0, 2):
        loader = _open(path, shuffle=True, seed=3, num_workers=workers)
        it = iter(loader)
        head = [next(it) for _ in range(5)]
        state = loader.state_dict()
        del it
        resumed = _open(path, shuffle=True, seed=3, num_workers=workers)
        resumed.load_state_dict(state)
        rest = _epoch(resumed)
        assert len(head) + len(rest) == len(full)
        for got, want in zip(head + rest, full):
            for key in want:
                assert torch.equal(got[key], want[key])
        assert resumed.epoch == 1


def test_single_rows_and_their_position(corpus):
    path, _, _ = corpus
    batches = _epoch(_open(path, batch_size=4))
    loader = _open(path, batch_size=None)
    rows = []
    for row in loader:
        rows.append(row)
        if len(rows) == 7:
            state = loader.state_dict()
            break
    again = _open(path, batch_size=None)
    again.load_state_dict(state)
    rows += list(again)
    assert rows[0]["input_ids"].shape == (SEQ,)
    assert torch.equal(torch.stack([r["input_ids"] for r in rows]), torch.cat([b["input_ids"] for b in batches]))


def test_position_counts_what_this_rank_has_left_and_rolls_over_at_the_epochs_end(corpus):
    path, _, _ = corpus
    loader = _open(path, batch_size=4)
    whole = len(_epoch(_open(path, batch_size=4)))
    assert loader.position() == (0, whole) and len(loader) == whole
    it = iter(loader)
    for _ in range(3):
        next(it)
    assert loader.position() == (0, whole - 3)
    list(it)
    assert loader.position() == (1, whole) and loader.epoch == 1
    rows = _open(path, batch_size=None)  # single rows: what is left is counted in rows
    next(iter(rows))
    assert rows.position() == (0, rows.packed_rows().num_rows - 1)
    rows.set_epoch(2)
    assert rows.position() == (2, rows.packed_rows().num_rows)
    with pytest.raises(ConfigurationError, match="epoch"):
        rows.set_epoch(-1)


def test_another_world_size_resumes_only_before_the_last_window(corpus):
    path, _, _ = corpus
    loader = _open(path, world_size=2, pack_window=100)
    it = iter(loader)
    next(it)
    early = loader.state_dict()
    other = _open(path, world_size=3, pack_window=100)
    other.load_state_dict(early)  # rows before the last window do not depend on the world size
    late = dict(early, rows_consumed=loader.packed_rows().num_rows - 2)
    with pytest.raises(ConfigurationError, match="world_size=2"):
        other.load_state_dict(late)
    with pytest.raises(ConfigurationError, match="seq_len"):
        _open(path, seq_len=SEQ * 2).load_state_dict(early)


def test_attention_mask_marks_real_tokens_on_request(corpus):
    path, _, _ = corpus
    batch = next(iter(_open(path, attention_mask=True)))
    np.testing.assert_array_equal(batch["attention_mask"].numpy(), (batch["input_ids"] >= 10).numpy().astype(int))


def test_flatten_joins_a_batch_into_one_row(corpus):
    path, _, _ = corpus
    batch = next(iter(_open(path)))
    flat = next(iter(_open(path, flatten=True)))
    for key in batch:
        assert torch.equal(flat[key], batch[key].reshape(1, -1))
    with pytest.raises(ConfigurationError, match="batch_size"):
        _open(path, flatten=True, batch_size=None)


def test_best_fit_decreasing_packs_no_worse_than_trl_bfd():
    trl_data = pytest.importorskip("trl.data_utils")
    import pyarrow as pa

    rng = np.random.default_rng(1)
    lengths = np.clip(np.exp(rng.normal(np.log(300), 1.0, 1000)), 20, 4096).astype(int)
    ours = best_fit_decreasing(lengths, 4096)
    assert sorted(i for b in ours for i in b) == list(range(len(lengths)))
    assert all(lengths[b].sum() <= 4096 for b in ours)
    table = pa.table({"input_ids": [list(range(n)) for n in lengths.tolist()]})
    trl_rows = trl_data._pack_bfd(table, 4096).num_rows
    assert len(ours) <= trl_rows


def test_rows_are_made_a_multiple_of_the_world_size():
    lengths = np.array([30, 30, 10, 10, 10, 5, 64])
    for world in (1, 2, 3, 4, 7):
        rows = pack_epoch(np.arange(7), lengths, seq_len=64, overflow="truncate", window=4, world_size=world, rng=None)
        assert rows.num_rows % world == 0
        assert sorted(rows.doc.tolist()) == list(range(7))


# The model-level check: a packed row's loss is its documents' loss, each run alone.


def _llama(vocab_size: int):
    from tests.fakes.tiny_models import tiny_llama

    return tiny_llama(vocab_size, max_positions=SEQ, attn_implementation="sdpa").train()


def test_packed_loss_equals_the_documents_run_one_at_a_time(corpus):
    path, docs, masks = corpus
    model = _llama(int(docs[-1][-1]) + 1)
    batch = next(iter(_open(path, shuffle=True, seed=1)))
    packed = model(**batch, use_cache=False).loss
    total, count = torch.zeros(()), 0
    token_doc = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)])
    for row_ids, row_pos in zip(batch["input_ids"], batch["position_ids"]):
        starts = torch.nonzero(row_pos == 0).flatten().tolist()
        for begin, end in zip(starts, starts[1:] + [SEQ]):
            if row_ids[begin] < 10:
                continue  # padding
            doc = int(token_doc[int(row_ids[begin]) - 10])
            ids = torch.from_numpy(docs[doc][: end - begin].astype(np.int64))[None]
            labels = torch.where(torch.from_numpy(masks[doc][: end - begin]) == 1, ids, -100)
            n = int((labels[0, 1:] != -100).sum())
            if n:
                total += model(input_ids=ids, labels=labels).loss * n
                count += n
    torch.testing.assert_close(packed, total / count, rtol=1e-5, atol=1e-6)
    flat = {key: value.reshape(1, -1) for key, value in batch.items()}  # what flatten=True yields
    torch.testing.assert_close(model(**flat, use_cache=False).loss, packed, rtol=1e-5, atol=1e-6)
    # Llama's config has use_cache=True: a cache is then built even in training, and transformers
    # reads position_ids restarts as separate documents only without one.
    leaky = model(**batch).loss
    assert not torch.allclose(leaky, packed, rtol=1e-5, atol=1e-6)


def test_a_trainer_reading_the_loader_keeps_packed_documents_apart(corpus, tmp_path):
    from transformers import Trainer, TrainingArguments

    from sparkgpu.hf import resumable

    path, docs, _ = corpus
    model = _llama(int(docs[-1][-1]) + 1)
    assert model.config.use_cache  # Llama's default, which lets packed documents see each other
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    trainer = resumable(Trainer(model=model, args=args, train_dataset=_open(path, shuffle=True, seed=1)))
    batch = next(iter(trainer.get_train_dataloader()))
    assert model.config.use_cache is False
    # What the Trainer computes is the packed loss of documents kept apart.
    torch.testing.assert_close(model(**batch).loss, model(**batch, use_cache=False).loss)
