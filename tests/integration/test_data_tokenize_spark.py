"""sparkgpu.data.tokenize of a Spark DataFrame: encoded on the executors, the same as without Spark."""

from __future__ import annotations

import pyarrow as pa
import pytest

from sparkgpu import data
from tests.text_tokenizer import build_tokenizer
from tests.unit.test_data_text import _chats, _read

pytestmark = [pytest.mark.integration, pytest.mark.spark]


def test_chats_are_encoded_on_the_executors_as_in_this_process(spark, tmp_path):
    chats = _chats(120, seed=4)
    tok = build_tokenizer()
    df = spark.createDataFrame(
        [(i, chat) for i, chat in enumerate(chats)], "id long, messages array<struct<role string, content string>>"
    ).repartition(3)
    df = df.orderBy("id").coalesce(2)  # two tasks, rows in id order
    result = data.tokenize(df, str(tmp_path / "spark"), tokenizer=tok, progress=False)
    assert result.source["via"] == "mapInArrow" and result.samples == len(chats)
    local = data.tokenize(pa.table({"messages": chats}), str(tmp_path / "local"), tokenizer=tok)
    for (ids, mask), (want_ids, want_mask) in zip(_read(result.url), _read(local.url)):
        assert ids.tolist() == want_ids.tolist() and mask.tolist() == want_mask.tolist()
    assert result.stats == local.stats  # merged from the tasks' own counts
    again = data.tokenize(df, str(tmp_path / "spark"), tokenizer=tok, progress=False)
    assert again.reused and again.fingerprint == result.fingerprint


def test_a_malformed_chat_on_an_executor_reaches_the_client_naming_the_row(spark, tmp_path):
    from sparkgpu.errors import DataError

    good = [("user", "hello"), ("assistant", "yes")]
    rows = [(0, good), (1, [("user", None), ("assistant", "yes")]), (2, good)]
    df = spark.createDataFrame(rows, "id long, messages array<struct<role string, content string>>")
    df = df.orderBy("id").coalesce(1)  # one task, one batch, rows in id order
    out = str(tmp_path / "out")
    with pytest.raises(
        DataError, match=r"row 1 of a batch of 3 in column 'messages' .*null content.*fill it"
    ) as raised:
        data.tokenize(df, out, tokenizer=build_tokenizer(), progress=False)
    assert "raised on a Spark executor" in str(raised.value)
    assert data.read_conversion(out) is None
