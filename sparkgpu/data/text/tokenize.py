"""``sparkgpu.data.tokenize``: text, prompt/completion or chat rows -> MDS of token ids and a loss mask.

```python
from sparkgpu import data
res = data.tokenize(spark.table("chats"), "s3://b/sft/v1", tokenizer=tok)   # encoded on the executors
res.stats["tokens"], res.stats["p99"]                                        # lengths, recorded in the index
sft = data.sft_dataset(remote=res.url, seq_len=4096, batch_size=8, shuffle=True)
```

The source is read, encoded (:mod:`sparkgpu.data.text.encode`) and written by the conversion
machinery of :mod:`sparkgpu.data.convert`: a Spark DataFrame in its executors' tasks
(``mapInArrow``, always: encoding is the costly part, so it runs where the cores are), a
Delta table, Parquet files or an Arrow table in writer threads of this process. The output is
fingerprinted from the source's data fingerprint, the tokenizer (vocabulary, rules, chat
template, special tokens) and the settings: a folder already holding the same is returned as
is, and concurrent calls into one folder write it once.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
from typing import Any

from sparkgpu.data.convert.claim import DEFAULT_WAIT_S
from sparkgpu.data.convert.conversion import ConversionResult, write_source
from sparkgpu.data.mds.writer import DEFAULT_SIZE_LIMIT
from sparkgpu.data.text.encode import OUTPUT_SCHEMA, TextEncoder, check_no_loss
from sparkgpu.data.text.tokenizer import TokenizerSpec
from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["tokenize", "TokenizedResult"]

# Bumped when the same rows and tokenizer would encode differently, so older outputs are redone.
_ENCODING_VERSION = 1
_FIELDS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"), "text": ("text",)}


@dataclasses.dataclass(frozen=True)
class TokenizedResult(ConversionResult):
    """A :class:`~sparkgpu.data.convert.conversion.ConversionResult` of token ids, with their statistics."""

    @property
    def stats(self) -> dict:
        """Documents, tokens, target tokens (``loss_tokens``), documents without targets
        (``no_loss``), min / mean / p50 / p90 / p99 / max length and a histogram of lengths."""
        return dict(self.source.get("text", {}).get("stats", {}))

    @property
    def text(self) -> dict:
        """Format, columns, tokenizer (digest, EOS and pad ids) and how the loss mask was found."""
        return {k: v for k, v in self.source.get("text", {}).items() if k != "stats"}


def tokenize(
    source,
    out,
    *,
    tokenizer,
    format: str | None = None,
    columns: dict[str, str] | None = None,
    chat_template: str | None = None,
    eos_token: str | None = None,
    add_eos: bool = True,
    on_no_loss: str = "count",
    version: int | None = None,
    timestamp=None,
    compression: str | None = None,
    size_limit: int | str | None = DEFAULT_SIZE_LIMIT,
    overwrite: bool = False,
    max_workers: int | None = None,
    storage_options: dict | None = None,
    progress: bool | None = None,
    wait: float | str | datetime.timedelta = DEFAULT_WAIT_S,
) -> TokenizedResult:
    """Encodes rows of text into an MDS dataset of ``input_ids`` and ``loss_mask`` (one document per row).

    The loss mask is 1 on the tokens a model learns to predict: every token of ``text``; the
    completion (and its EOS) of ``prompt``/``completion``; the assistant's turns of
    ``messages``, as the chat template's ``{% generation %}`` markers say, or, for templates
    without them, from renders of each conversation's first turns (see
    :mod:`sparkgpu.data.text.encode`).

    Args:
        source: A Spark DataFrame (encoded on its executors), a Delta table or Parquet path, a
            ``deltalake.DeltaTable``, a pyarrow Table or a pandas DataFrame.
        out: Output folder (local path or fsspec URL; with Spark, reachable from the executors).
        tokenizer: A ``transformers.PreTrainedTokenizerFast``, a ``tokenizers.Tokenizer`` or a
            local folder holding one (``tokenizer.json``); shipped to the executors with the task.
        format: ``"messages"`` (a list of ``{"role", "content"}`` structs per row),
            ``"prompt_completion"`` or ``"text"``; by default the first whose columns the
            source has, in that order.
        columns: Field -> source column, for other column names: ``{"text": "body"}``.
        chat_template: Jinja template to use instead of the tokenizer's.
        eos_token: Text of the end-of-sequence token, for a ``tokenizers.Tokenizer``.
        add_eos: Append EOS to text and completions that do not end with it.
        on_no_loss: Rows with tokens but no target token (a chat without an assistant turn):
            ``"count"`` writes them and counts them in ``stats["no_loss"]``; ``"error"`` refuses
            them with a ``DataError`` naming the row (a dataset already written is refused too
            when its statistics count such rows).
        version: Delta table version to read (default: latest).
        timestamp: Read the Delta table as of this time instead.
        compression: As for :func:`~sparkgpu.data.convert.conversion.to_mds`.
        size_limit: As for ``to_mds``.
        overwrite: Replace a dataset of other data or another tokenizer in ``out`` (one of the
            same is returned as is, without it).
        max_workers: Parallel writers for sources read in this process.
        storage_options: fsspec options for remote paths.
        progress: Show a progress bar; default: when stderr is a terminal or notebook.
        wait: Longest wait for another conversion into ``out``, as for ``to_mds``.

    Returns:
        The dataset written, or found already written (``reused=True``), with ``stats``.

    Raises:
        ConfigurationError: Unknown format, columns or ``on_no_loss``, a tokenizer that cannot
            be used, or ``out`` holding another dataset without ``overwrite``.
        DataError: Null text; a malformed chat (an empty conversation, a message that is not a
            mapping with ``role`` and ``content``, a role not in
            :data:`~sparkgpu.data.text.encode.ROLES`, null or non-string content), naming the
            row; a row without a target under ``on_no_loss="error"``; a template whose assistant
            turns cannot be found; or another conversion into ``out`` still running after ``wait``.
    """
    from sparkgpu.data.convert.spark import SparkSource
    from sparkgpu.data.tables.resolve import resolve_source

    check_no_loss(on_no_loss)

    spec = TokenizerSpec.of(tokenizer, chat_template=chat_template, eos_token=eos_token)
    resolved = resolve_source(source, version=version, timestamp=timestamp, storage_options=storage_options)
    inner: Any
    if resolved.kind.is_spark:
        frame = resolved.data
        format, mapping = _fields(format, columns, list(frame.columns))
        encoder = TextEncoder(spec, format, mapping, add_eos, on_no_loss)
        inner = SparkSource(frame.select(*[_quoted(c) for c in encoder.input_columns]))
    else:
        from sparkgpu.data.convert.files import file_source

        inner = file_source(resolved)
        format, mapping = _fields(format, columns, list(inner.schema.names))
        encoder = TextEncoder(spec, format, mapping, add_eos, on_no_loss)
    result = write_source(
        _TokenizedSource(inner, encoder),
        out,
        compression=compression,
        size_limit=size_limit,
        overwrite=overwrite,
        max_workers=max_workers,
        storage_options=storage_options,
        progress=progress,
        wait=wait,
    )
    tokenized = TokenizedResult(**{f.name: getattr(result, f.name) for f in dataclasses.fields(result)})
    # on_no_loss does not change what is written, so a dataset written with "count" is reused as
    # is; its statistics say whether it holds rows "error" refuses.
    no_loss = tokenized.stats.get("no_loss", 0)
    if on_no_loss == "error" and no_loss:
        raise DataError(
            f"{tokenized.url} already holds this data tokenized, with {no_loss} rows without a target token; "
            "drop those rows from the source and tokenize again with overwrite=True, or pass on_no_loss='count'"
        )
    return tokenized


class _TokenizedSource:
    """A source whose rows are encoded on their way to the writers."""

    def __init__(self, inner, encoder: TextEncoder):
        self.inner, self.encoder = inner, encoder
        self.schema = OUTPUT_SCHEMA

    @property
    def description(self) -> dict:
        encoder = self.encoder
        mask = {
            "text": "every token",
            "prompt_completion": "completion",
            "messages": "generation markers" if encoder.generation_markers else "prefix renders",
        }[encoder.format]
        return {
            **self.inner.description,
            "text": {
                "format": encoder.format,
                "columns": encoder.columns,
                "add_eos": encoder.add_eos,
                "loss_mask": mask,
                "tokenizer": encoder.tokenizer.describe(),
                "stats": encoder.stats.summary(),
            },
        }

    def fingerprint(self) -> str:
        encoder = self.encoder
        parts = {
            "source": self.inner.fingerprint(),
            "tokenizer": encoder.tokenizer.digest,
            "format": encoder.format,
            "columns": encoder.columns,
            "add_eos": encoder.add_eos,
            "encoding": _ENCODING_VERSION,
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()

    def write(self, volume, options, *, max_workers=None, progress=None) -> list[dict]:
        return self.inner.write(volume, options, max_workers=max_workers, progress=progress, transform=self.encoder)


def _fields(format: str | None, columns: dict[str, str] | None, available: list[str]) -> tuple[str, dict[str, str]]:
    """The format and its field -> column mapping, checked against the source's columns."""
    columns = dict(columns or {})
    if format is None:
        for candidate, fields in _FIELDS.items():
            if all(columns.get(f, f) in available for f in fields):
                format = candidate
                break
        else:
            raise ConfigurationError(
                f"the source has columns {available}, none of messages, prompt + completion or text; pass "
                "format= and columns= (e.g. format='text', columns={'text': 'body'})"
            )
    if format not in _FIELDS:
        raise ConfigurationError(f"format={format!r} must be one of {list(_FIELDS)}")
    unknown = set(columns) - set(_FIELDS[format])
    if unknown:
        raise ConfigurationError(f"columns= names {sorted(unknown)}, which format {format!r} does not have")
    mapping = {f: columns.get(f, f) for f in _FIELDS[format]}
    missing = [c for c in mapping.values() if c not in available]
    if missing:
        raise ConfigurationError(
            f"format {format!r} reads columns {missing}, which the source lacks (it has {available}); "
            "map them with columns={'field': 'column'}"
        )
    return format, mapping


def _quoted(name: str):
    from pyspark.sql import functions as F

    return F.col("`" + name.replace("`", "``") + "`")
