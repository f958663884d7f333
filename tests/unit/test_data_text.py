"""sparkgpu.data.tokenize without Spark: token ids and loss masks as HF computes them, statistics, reuse."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest

from sparkgpu import data
from sparkgpu.errors import ConfigurationError, DataError
from tests.text_tokenizer import CHATML_PLAIN, WORDS, build_tokenizer
from tests.mosaic import streaming_dataset


def _chats(count: int, seed: int = 0) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    chats = []
    for _ in range(count):
        turns = [{"role": "system", "content": "you answer"}] if rng.random() < 0.3 else []
        for _ in range(int(rng.integers(1, 4))):
            turns.append({"role": "user", "content": " ".join(rng.choice(WORDS, int(rng.integers(1, 10))))})
            turns.append({"role": "assistant", "content": " ".join(rng.choice(WORDS, int(rng.integers(1, 20))))})
        chats.append(turns)
    return chats


def _read(url: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every document's ids and mask, read with Mosaic's reader (the output is standard MDS)."""
    dataset = streaming_dataset(local=url, batch_size=1, shuffle=False)
    return [(s["input_ids"], s["loss_mask"]) for s in dataset]


def test_chat_masks_are_hf_assistant_token_masks(tmp_path):
    tok = build_tokenizer()
    chats = _chats(50)
    result = data.tokenize(pa.table({"messages": chats}), str(tmp_path / "out"), tokenizer=tok, max_workers=2)
    hf = tok.apply_chat_template(chats, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    rows = _read(result.url)
    assert len(rows) == len(chats)
    for (ids, mask), hf_ids, hf_mask in zip(rows, hf["input_ids"], hf["assistant_masks"]):
        assert ids.dtype == np.int32 and mask.dtype == np.uint8
        np.testing.assert_array_equal(ids, hf_ids)
        np.testing.assert_array_equal(mask, hf_mask)
    assert result.text["loss_mask"] == "generation markers"
    stats = result.stats
    assert stats["documents"] == len(chats)
    assert stats["tokens"] == sum(len(i) for i, _ in rows)
    assert stats["loss_tokens"] == sum(int(m.sum()) for _, m in rows)
    assert stats["min"] == min(len(i) for i, _ in rows) and stats["max"] == max(len(i) for i, _ in rows)
    assert stats["no_loss"] == 0 and stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]


def test_templates_without_generation_markers_mask_each_assistant_turn(tmp_path):
    tok = build_tokenizer(CHATML_PLAIN)
    chats = _chats(30, seed=1)
    result = data.tokenize(pa.table({"messages": chats}), str(tmp_path / "out"), tokenizer=tok)
    assert result.text["loss_mask"] == "prefix renders"
    for (ids, mask), chat in zip(_read(result.url), chats):
        targets = tok.convert_ids_to_tokens(ids[mask == 1].tolist())
        expected = []
        for message in chat:
            if message["role"] == "assistant":
                expected += message["content"].split() + ["<|im_end|>", "\n"]
        assert targets == expected


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    # Renders the last message differently from the same message followed by others.
    template = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }} {% endfor %}"
    tok = build_tokenizer(template)
    chats = [[{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}]]
    with pytest.raises(DataError, match="generation"):
        data.tokenize(pa.table({"messages": chats}), str(tmp_path / "out"), tokenizer=tok)


def test_prompt_completion_masks_the_completion_and_its_eos(tmp_path):
    tok = build_tokenizer()
    table = pa.table({"prompt": ["what is the cat", "who"], "completion": [" a small dog", " you</s>"]})
    result = data.tokenize(table, str(tmp_path / "out"), tokenizer=tok)
    (ids1, mask1), (ids2, mask2) = _read(result.url)
    assert tok.convert_ids_to_tokens(ids1.tolist()) == ["<s>", "what", "is", "the", "cat", "a", "small", "dog", "</s>"]
    assert mask1.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert tok.convert_ids_to_tokens(ids2.tolist()) == ["<s>", "who", "you", "</s>"]  # EOS not doubled
    assert mask2.tolist() == [0, 0, 1, 1]


def test_text_is_all_target_with_eos_and_columns_can_be_renamed(tmp_path):
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(build_tokenizer().backend_tokenizer.to_str())
    table = pa.table({"body": ["the cat runs", "a dog"], "other": [1, 2]})
    result = data.tokenize(table, str(tmp_path / "out"), tokenizer=backend, columns={"text": "body"}, eos_token="</s>")
    (ids1, mask1), (ids2, mask2) = _read(result.url)
    assert ids1.tolist() == [2] + backend.encode("the cat runs", add_special_tokens=False).ids + [3]
    assert mask1.tolist() == [1] * len(ids1) and mask2.tolist() == [1] * len(ids2)
    with pytest.raises(ConfigurationError, match="eos_token"):
        data.tokenize(table, str(tmp_path / "o2"), tokenizer=backend, columns={"text": "body"})
    with pytest.raises(ConfigurationError, match="none of messages"):
        data.tokenize(table, str(tmp_path / "o3"), tokenizer=backend, eos_token="</s>")


def test_same_data_and_tokenizer_are_reused_another_tokenizer_is_not(tmp_path):
    tok = build_tokenizer()
    table = pa.table({"messages": _chats(20)})
    out = str(tmp_path / "out")
    first = data.tokenize(table, out, tokenizer=tok)
    index_time = os.stat(os.path.join(out, "index.json")).st_mtime_ns
    again = data.tokenize(table, out, tokenizer=tok)
    assert again.reused and not first.reused and again.fingerprint == first.fingerprint
    assert again.stats == first.stats
    assert os.stat(os.path.join(out, "index.json")).st_mtime_ns == index_time
    other = build_tokenizer(CHATML_PLAIN)
    with pytest.raises(ConfigurationError, match="overwrite"):
        data.tokenize(table, out, tokenizer=other)
    replaced = data.tokenize(table, out, tokenizer=other, overwrite=True)
    assert not replaced.reused and replaced.fingerprint != first.fingerprint


def test_a_delta_table_is_tokenized_from_its_path(tmp_path):
    from deltalake import write_deltalake

    tok = build_tokenizer()
    table = pa.table({"prompt": ["the cat", "a dog", "who"], "completion": [" runs", " eats", " you"]})
    write_deltalake(str(tmp_path / "delta"), table)
    result = data.tokenize(str(tmp_path / "delta"), str(tmp_path / "out"), tokenizer=tok)
    assert result.source["type"] == "delta" and result.samples == 3
    targets = sorted(tok.convert_ids_to_tokens(ids[mask == 1].tolist()) for ids, mask in _read(result.url))
    assert targets == [["eats", "</s>"], ["runs", "</s>"], ["you", "</s>"]]


def test_a_tokenizer_folder_gives_the_same_dataset_as_the_tokenizer(tmp_path):
    tok = build_tokenizer()
    tok.save_pretrained(str(tmp_path / "tok"))
    table = pa.table({"messages": _chats(10, seed=2)})
    from_object = data.tokenize(table, str(tmp_path / "a"), tokenizer=tok)
    from_folder = data.tokenize(table, str(tmp_path / "b"), tokenizer=str(tmp_path / "tok"))
    assert from_folder.text["tokenizer"]["eos_token_id"] == 3
    for (ids, mask), (ids2, mask2) in zip(_read(from_object.url), _read(from_folder.url)):
        assert ids.tolist() == ids2.tolist() and mask.tolist() == mask2.tolist()


GOOD = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}]
STRUCT = pa.struct([("role", pa.string()), ("content", pa.string())])


@pytest.mark.parametrize(
    "column, row, message",
    [
        (
            pa.array([GOOD, [{"role": "user", "content": None}, GOOD[1]]]),
            1,
            r"message 0 \(user\) has null content.*fill it",
        ),
        (pa.array([GOOD, [GOOD[0], {"role": "bot", "content": "yes"}]]), 1, r"message 1 has role 'bot', not one of"),
        (pa.array([GOOD, []], type=pa.list_(STRUCT)), 1, r"is an empty conversation; drop rows without messages"),
        (
            pa.array([[{"role": "user", "content": [{"type": "text", "text": "hello"}]}]]),
            0,
            r"message 0 \(user\) has content of type list; content must be a string",
        ),
        (pa.array([["hello", "yes"]]), 0, r"message 0 is 'hello', not a mapping with 'role' and 'content'"),
        (
            pa.array([[{"role": "user", "text": "hello"}]]),
            0,
            r"message 0 is \{'role': 'user', 'text': 'hello'\}, not a mapping with 'role' and 'content'",
        ),
        (pa.array(['[{"role": "user", "content": "hello"}]']), 0, r"is a str, not a list of"),
    ],
    ids=["null-content", "unknown-role", "empty", "non-string-content", "not-a-mapping", "no-content", "json-text"],
)
def test_malformed_chats_are_refused_naming_the_row_and_nothing_is_committed(tmp_path, column, row, message):
    out = str(tmp_path / "out")
    with pytest.raises(DataError, match=message) as raised:
        # One writer reads the table as one batch, so the row's place in it is its place in the table.
        data.tokenize(
            pa.table({"messages": column}), out, tokenizer=build_tokenizer(), format="messages", max_workers=1
        )
    assert f"row {row} of a batch of {len(column)} in column 'messages'" in str(raised.value)
    assert "\n" not in str(raised.value)  # Spark's report of an executor's error keeps one line
    assert data.read_conversion(out) is None


def test_a_tool_call_without_content_is_a_turn_not_an_error(tmp_path):
    call = {"role": "assistant", "content": None, "tool_calls": [{"name": "search", "arguments": "cat"}]}
    chats = [GOOD, [GOOD[0], call, {"role": "tool", "content": "a cat"}, GOOD[1]]]
    result = data.tokenize(pa.table({"messages": chats}), str(tmp_path / "out"), tokenizer=build_tokenizer())
    assert result.samples == 2


def test_rows_without_an_assistant_turn_are_counted_or_refused(tmp_path):
    tok = build_tokenizer()
    table = pa.table({"messages": [GOOD, [{"role": "system", "content": "you answer"}, GOOD[0]], GOOD]})
    counted = data.tokenize(table, str(tmp_path / "counted"), tokenizer=tok)  # the default: written and counted
    assert counted.samples == 3 and counted.stats["no_loss"] == 1
    assert [int(mask.sum()) > 0 for _, mask in _read(counted.url)] == [True, False, True]
    with pytest.raises(DataError, match=r"row 1 of a batch of 3 \(.*\) has no assistant turn.*on_no_loss='count'"):
        data.tokenize(table, str(tmp_path / "refused"), tokenizer=tok, on_no_loss="error", max_workers=1)
    assert data.read_conversion(str(tmp_path / "refused")) is None
    # The same data already written with "count" is not handed back as if it had none.
    with pytest.raises(DataError, match="1 rows without a target token"):
        data.tokenize(table, counted.url, tokenizer=tok, on_no_loss="error")
    assert data.tokenize(table[::2], str(tmp_path / "clean"), tokenizer=tok, on_no_loss="error").samples == 2


def test_an_unknown_on_no_loss_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ConfigurationError, match=r"on_no_loss='skip' must be one of \('count', 'error'\)"):
        data.tokenize(
            pa.table({"messages": [GOOD]}), str(tmp_path / "out"), tokenizer=build_tokenizer(), on_no_loss="skip"
        )
    assert not (tmp_path / "out").exists()
