"""Rows of text, prompt/completion pairs or chat messages -> token ids and a loss mask, a batch at a time.

Runs where the rows are written: in each Spark task (``mapInArrow``) or in a writer thread of
this process. One batch is encoded in three steps:

1. **text**: ``text`` as is; ``prompt + completion``; or ``messages`` rendered with the chat
   template (``transformers``' own renderer, Jinja), which also returns the character spans the
   template marks with ``{% generation %}``;
2. **tokens**: the whole batch in one call of the ``tokenizers`` library (Rust, releasing the
   GIL), with each token's character offsets;
3. **mask**: a token is a target when its characters overlap a target span (the completion, the
   assistant's turns; for plain text, every token), found for the whole batch with one
   ``searchsorted``. This is the rule of HF's ``return_assistant_tokens_mask``, without its
   loop per token in Python.

Templates without generation markers use a fallback: the span of assistant turn ``i`` runs from
the end of the conversation's first ``i`` messages rendered with ``add_generation_prompt=True``
to the end of its first ``i + 1`` messages, provided both renders are prefixes of the whole
conversation's (else the row is refused, naming the fix).

Chats are checked before a batch is rendered: an empty conversation, a message that is not a
mapping with ``role`` and ``content``, a role outside :data:`ROLES`, or content that is null or
not a string (null is allowed on a message that carries ``tool_calls``) is refused with a
:class:`~sparkgpu.errors.DataError` naming the row, so no batch holding one is written. Rows with
tokens but no target (a chat without an assistant turn) are counted as ``no_loss``, or refused
with ``on_no_loss="error"``. Messages are one line, so that Spark's report of an executor's
error carries them whole to the client.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from sparkgpu.data.text.tokenizer import TokenizerSpec
from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["TextEncoder", "FORMATS", "ROLES", "NO_LOSS", "OUTPUT_SCHEMA", "LengthStats", "check_no_loss"]

FORMATS = ("text", "prompt_completion", "messages")
#: Roles a chat message may have (those of HF's and OpenAI's chat formats).
ROLES = ("system", "developer", "user", "assistant", "tool")
#: What ``on_no_loss`` may say about rows without a target token: count them, or refuse them.
NO_LOSS = ("count", "error")
# How much of a row an error message quotes.
_PREVIEW = 160
OUTPUT_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8()))])
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Length histogram: bucket b holds lengths in [2^(b/4), 2^((b+1)/4)), about 19% wide.
_BUCKETS_PER_OCTAVE = 4


class LengthStats:
    """Documents, tokens, target tokens and a log-spaced histogram of lengths; merges across tasks."""

    def __init__(self):
        self.documents = self.tokens = self.loss_tokens = self.empty = self.no_loss = 0
        self.min: int | None = None
        self.max = 0
        self.histogram: dict[int, int] = {}

    def add_batch(self, lengths: np.ndarray, loss: np.ndarray) -> None:
        if not len(lengths):
            return
        self.documents += len(lengths)
        self.tokens += int(lengths.sum())
        self.loss_tokens += int(loss.sum())
        self.empty += int((lengths == 0).sum())
        self.no_loss += int(((loss == 0) & (lengths > 0)).sum())
        self.min = int(lengths.min()) if self.min is None else min(self.min, int(lengths.min()))
        self.max = max(self.max, int(lengths.max()))
        buckets = np.floor(np.log2(np.maximum(lengths, 1)) * _BUCKETS_PER_OCTAVE).astype(np.int64)
        for bucket, count in zip(*np.unique(buckets, return_counts=True)):
            self.histogram[int(bucket)] = self.histogram.get(int(bucket), 0) + int(count)

    def add(self, other: dict) -> None:
        """Adds what another copy counted (its :meth:`to_json`)."""
        self.documents += other["documents"]
        self.tokens += other["tokens"]
        self.loss_tokens += other["loss_tokens"]
        self.empty += other["empty"]
        self.no_loss += other["no_loss"]
        if other["min"] is not None:
            self.min = other["min"] if self.min is None else min(self.min, other["min"])
        self.max = max(self.max, other["max"])
        for bucket, count in other["histogram"].items():
            self.histogram[int(bucket)] = self.histogram.get(int(bucket), 0) + count

    def to_json(self) -> dict:
        return {
            "documents": self.documents,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "empty": self.empty,
            "no_loss": self.no_loss,
            "min": self.min,
            "max": self.max,
            "histogram": {str(k): v for k, v in sorted(self.histogram.items())},
        }

    def summary(self) -> dict:
        """What the dataset's index records: counts, mean, approximate quantiles and the histogram.

        Quantiles are the upper edge of the histogram bucket they fall in (within about 19%).
        """
        out = self.to_json()
        out["mean"] = self.tokens / self.documents if self.documents else 0.0
        buckets = sorted(self.histogram)
        counts = np.cumsum([self.histogram[b] for b in buckets]) if buckets else np.zeros(0)
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            if not len(counts):
                out[name] = 0
                continue
            bucket = buckets[int(np.searchsorted(counts, q * counts[-1]))]
            out[name] = min(self.max, int(np.ceil(2 ** ((bucket + 1) / _BUCKETS_PER_OCTAVE))))
        out["histogram_buckets_per_octave"] = _BUCKETS_PER_OCTAVE
        return out


def check_no_loss(on_no_loss: Any) -> None:
    """Raises :class:`ConfigurationError` unless ``on_no_loss`` is one of :data:`NO_LOSS`."""
    if not isinstance(on_no_loss, str) or on_no_loss not in NO_LOSS:
        raise ConfigurationError(
            f"on_no_loss={on_no_loss!r} must be one of {NO_LOSS}: 'count' keeps rows without a target token "
            "and counts them (stats['no_loss']), 'error' refuses them"
        )


class TextEncoder:
    """A picklable batch transform: rows of one text format in, ``input_ids`` and ``loss_mask`` out.

    Args:
        tokenizer: What encodes (shipped as strings, loaded on first use in each process).
        format: ``"text"``, ``"prompt_completion"`` or ``"messages"``.
        columns: Format field -> source column (``{"text": "body"}``).
        add_eos: Append the end-of-sequence token to text and completions that lack it (a chat
            template ends turns itself).
        on_no_loss: Rows with tokens but no target token: ``"count"`` (written, counted as
            ``no_loss``) or ``"error"`` (refused with a ``DataError``).

    Raises:
        ConfigurationError: An unknown format or ``on_no_loss``, or a tokenizer that lacks what the
            format needs.
    """

    def __init__(
        self,
        tokenizer: TokenizerSpec,
        format: str,
        columns: dict[str, str],
        add_eos: bool,
        on_no_loss: str = "count",
    ):
        check_no_loss(on_no_loss)
        if format not in FORMATS:
            raise ConfigurationError(f"format={format!r} must be one of {FORMATS}")
        if add_eos and format != "messages" and tokenizer.eos_token_id is None:
            raise ConfigurationError(
                "add_eos=True needs the tokenizer's end-of-sequence token: pass eos_token='...' (a "
                "tokenizers.Tokenizer does not know it), or add_eos=False"
            )
        if format == "messages" and tokenizer.chat_template is None:
            raise ConfigurationError("messages need a chat template: the tokenizer has none; pass chat_template='...'")
        self.tokenizer, self.format, self.columns, self.add_eos = tokenizer, format, dict(columns), add_eos
        self.on_no_loss = on_no_loss
        self.input_columns = list(dict.fromkeys(self.columns.values()))
        self.schema = OUTPUT_SCHEMA
        self.generation_markers = format == "messages" and bool(_GENERATION.search(tokenizer.chat_template or ""))
        self._stats = LengthStats()
        self._lock = threading.Lock()
        self._backend: Any = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_backend"], state["_lock"], state["_stats"] = None, None, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock, self._stats = threading.Lock(), LengthStats()

    # Statistics, gathered from every copy (Spark tasks) or threads (this process).

    def summary(self) -> dict:
        """What this copy encoded, as JSON (merged on the client with :meth:`add`)."""
        with self._lock:
            return self._stats.to_json()

    def add(self, summary: dict) -> None:
        with self._lock:
            self._stats.add(summary)

    @property
    def stats(self) -> LengthStats:
        return self._stats

    # Encoding.

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """Encodes one batch of rows.

        Raises:
            DataError: A null text, a malformed chat (see the module docstring), a row without a
                target token under ``on_no_loss="error"``, or a template the fallback cannot find
                assistant turns in.
        """
        if self._backend is None:
            self._backend = self.tokenizer.load()
        texts, spans = self._texts(batch)
        special = self.format != "messages"  # a chat template writes its own special tokens
        # Without target spans no offsets are needed: the library's faster call skips them.
        encode = self._backend.encode_batch if spans is not None else self._encode_fast
        encodings = encode(texts, add_special_tokens=special)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        ids = np.fromiter(
            itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int32, count=int(lengths.sum())
        )
        if spans is None:
            mask = np.ones(len(ids), dtype=np.uint8)
        else:
            offsets = np.fromiter(
                itertools.chain.from_iterable(itertools.chain.from_iterable(e.offsets for e in encodings)),
                dtype=np.int64,
                count=2 * len(ids),
            ).reshape(-1, 2)
            mask = _overlapping(offsets, lengths, spans, [len(t) for t in texts])
        if self.add_eos and self.format != "messages":
            ids, mask, lengths = self._with_eos(ids, mask, lengths)
        ends = np.cumsum(lengths)
        loss = np.add.reduceat(mask.astype(np.int64), ends - lengths) if len(mask) else np.zeros(len(lengths), np.int64)
        loss = np.where(lengths > 0, loss, 0)
        if self.on_no_loss == "error":
            self._refuse_no_loss(texts, lengths, loss)
        with self._lock:
            self._stats.add_batch(lengths, loss)
        offsets32 = np.concatenate([[0], ends]).astype(np.int32)
        return pa.RecordBatch.from_arrays(
            [
                pa.ListArray.from_arrays(pa.array(offsets32), pa.array(ids, type=pa.int32())),
                pa.ListArray.from_arrays(pa.array(offsets32), pa.array(mask, type=pa.uint8())),
            ],
            schema=OUTPUT_SCHEMA,
        )

    def _refuse_no_loss(self, texts: list[str], lengths: np.ndarray, loss: np.ndarray) -> None:
        bad = np.flatnonzero((loss == 0) & (lengths > 0))
        if not len(bad):
            return
        row = int(bad[0])
        what = "no assistant turn" if self.format == "messages" else "nothing to predict"
        raise DataError(
            f"row {row} of a batch of {len(texts)} ({texts[row]!r:.{_PREVIEW}}) has {what}: none of its tokens is a "
            f"target ({len(bad)} such rows in the batch); drop those rows, or pass on_no_loss='count' to keep "
            "and count them"
        )

    def _encode_fast(self, texts: list[str], add_special_tokens: bool):
        fast = getattr(self._backend, "encode_batch_fast", None)  # tokenizers >= 0.21
        encode = fast if fast is not None else self._backend.encode_batch
        return encode(texts, add_special_tokens=add_special_tokens)

    def _column(self, batch: pa.RecordBatch, field: str) -> list:
        name = self.columns[field]
        values = batch.column(batch.schema.get_field_index(name)).to_pylist()
        if any(v is None for v in values):
            raise DataError(f"column {name!r} holds nulls; drop or fill those rows before tokenizing")
        return values

    def _texts(self, batch: pa.RecordBatch) -> tuple[list[str], list[list[tuple[int, int]]] | None]:
        """The text to encode per row, and its target character spans (``None``: every token)."""
        if self.format == "text":
            return self._column(batch, "text"), None
        if self.format == "prompt_completion":
            prompts, completions = self._column(batch, "prompt"), self._column(batch, "completion")
            texts = [p + c for p, c in zip(prompts, completions)]
            return texts, [[(len(p), len(t))] for p, t in zip(prompts, texts)]
        return self._render(self._messages(batch))

    def _messages(self, batch: pa.RecordBatch) -> list[list[dict]]:
        """The messages column as HF wants it: lists of dicts, without the fields a row leaves null.

        A list of structs is taken apart field by field (a string list per field is several
        times faster to convert than dicts of a struct array); other types go through Python.
        """
        name = self.columns["messages"]
        array = batch.column(batch.schema.get_field_index(name))
        if array.null_count:
            raise DataError(f"column {name!r} holds nulls; drop or fill those rows before tokenizing")
        kind = array.type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_struct(kind.value_type):
            chats = array.to_pylist()
        else:
            offsets = array.offsets.to_numpy()
            structs = array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
            names = [structs.type.field(i).name for i in range(structs.type.num_fields)]
            fields = [structs.field(i).to_pylist() for i in range(len(names))]
            messages = [dict(zip(names, values)) for values in zip(*fields)]
            bounds = (offsets - offsets[0]).tolist()
            chats = [messages[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        for row, chat in enumerate(chats):
            _check_chat(chat, row, len(chats), name)
        # HF templates test for a field's presence (``'tool_calls' in m``), not for null.
        return [[{k: v for k, v in m.items() if v is not None} for m in chat] for chat in chats]

    def _render(self, chats: list[list[dict]]) -> tuple[list[str], list[list[tuple[int, int]]]]:
        try:
            from transformers.utils.chat_template_utils import render_jinja_template as render
        except ImportError:
            raise ConfigurationError(
                "chat messages are rendered with transformers' chat template engine, needed where they are "
                "encoded (the Spark executors too): pip install 'transformers>=5' jinja2"
            ) from None
        template, special = self.tokenizer.chat_template, self.tokenizer.special_tokens
        assert template is not None  # checked when the encoder was made
        render_jinja_template: Any = render  # annotated as returning str; it returns (texts, spans)
        if self.generation_markers:
            rendered, spans = render_jinja_template(
                conversations=chats, chat_template=template, return_assistant_tokens_mask=True, **special
            )
            return rendered, [list(s) for s in spans]
        rendered, _ = render_jinja_template(conversations=chats, chat_template=template, **special)
        return rendered, [_prefix_spans(chat, text, template, special) for chat, text in zip(chats, rendered)]

    def _with_eos(self, ids, mask, lengths):
        eos = self.tokenizer.eos_token_id
        ends = np.cumsum(lengths)
        has = (lengths > 0) & (ids[np.maximum(ends - 1, 0)] == eos) if len(ids) else np.zeros(len(lengths), bool)
        at = ends[~has]
        ids = np.insert(ids, at, eos)
        mask = np.insert(mask, at, 1)
        return ids, mask, lengths + ~has


def _check_chat(chat: Any, row: int, rows: int, column: str) -> None:
    """Raises a :class:`DataError` naming row ``row`` of a batch of ``rows`` when ``chat`` is not a
    conversation a chat template can render as meant."""
    where = f"row {row} of a batch of {rows} in column {column!r} ({chat!r:.{_PREVIEW}})"
    fix = "fix or drop that row before tokenizing"
    if not isinstance(chat, list):
        raise DataError(f"{where} is a {type(chat).__name__}, not a list of {{'role', 'content'}} messages; {fix}")
    if not chat:
        raise DataError(f"{where} is an empty conversation; drop rows without messages before tokenizing")
    for number, message in enumerate(chat):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise DataError(
                f"{where}: message {number} is {message!r:.{_PREVIEW}}, not a mapping with 'role' and 'content'; {fix}"
            )
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or role not in ROLES:
            raise DataError(f"{where}: message {number} has role {role!r}, not one of {ROLES}; {fix}")
        if content is None and message.get("tool_calls") is None:
            raise DataError(
                f"{where}: message {number} ({role}) has null content, which the template would render as an "
                f"empty turn; fill it (an empty string for a turn meant to be empty) or {fix}"
            )
        if content is not None and not isinstance(content, str):
            raise DataError(
                f"{where}: message {number} ({role}) has content of type {type(content).__name__}; content must "
                f"be a string: {fix}"
            )


def _prefix_spans(chat: list[dict], text: str, template: str, special: dict) -> list[tuple[int, int]]:
    from transformers.utils.chat_template_utils import render_jinja_template as render

    render_jinja_template: Any = render

    spans = []
    for i, message in enumerate(chat):
        if message.get("role") != "assistant":
            continue
        (before,), _ = render_jinja_template(
            conversations=[chat[:i]], chat_template=template, add_generation_prompt=True, **special
        )
        (through,), _ = render_jinja_template(conversations=[chat[: i + 1]], chat_template=template, **special)
        if not (text.startswith(before) and text.startswith(through) and len(through) >= len(before)):
            raise DataError(
                "the chat template renders an earlier part of a conversation differently from the whole "
                "conversation, so the assistant's tokens cannot be told apart; mark the assistant's "
                "turns in the template with {% generation %} ... {% endgeneration %}"
            )
        spans.append((len(before), len(through)))
    return spans


def _overlapping(offsets: np.ndarray, lengths: np.ndarray, spans: list, text_lengths: list[int]) -> np.ndarray:
    """1 for each token whose characters overlap one of its row's spans (all rows in one pass)."""
    base = np.concatenate([[0], np.cumsum(text_lengths)[:-1]]).astype(np.int64)
    per_row = np.array([len(s) for s in spans], dtype=np.int64)
    flat = np.array([pair for row in spans for pair in row], dtype=np.int64).reshape(-1, 2)
    if not len(flat):
        return np.zeros(len(offsets), dtype=np.uint8)
    flat = flat + np.repeat(base, per_row)[:, None]
    token_row = np.repeat(np.arange(len(lengths)), lengths)
    starts = offsets[:, 0] + base[token_row]
    ends = offsets[:, 1] + base[token_row]
    # The first span ending after the token's start; the token overlaps it when it ends after its start.
    at = np.searchsorted(flat[:, 1], starts, side="right")
    inside = at < len(flat)
    hit = np.zeros(len(offsets), dtype=bool)
    hit[inside] = ends[inside] > flat[at[inside], 0]
    # A span never reaches into the next row: rows' characters are laid end to end.
    return hit.astype(np.uint8)
