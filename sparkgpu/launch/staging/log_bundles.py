"""Growing files (logs, tracking records) shipped through a store as appended bundles, each byte once.

Object stores cannot append, and putting a growing log again whole costs its whole size on
every put: a week of one line per step is gigabytes per put. A node instead ships, every
interval, one *bundle* holding what grew in each of its files since the last one:

    <stream>/<seq, 16 digits>     a JSON header line {"files": [[name, offset, length], ...]}, then the bytes

``seq`` counts from 0 without gaps, so a reader appends bundle after bundle in order and
never reads a byte twice; a bundle not listed yet holds the later ones back until it is. One
bundle per node and interval, whatever the number of its ranks, keeps the store's request
count per node flat. A bundle is one whole-object put: a reader sees it whole or not at all.
Names inside a bundle come from the (untrusted) store: the reader's ``place`` checks them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from sparkgpu.store import Store

__all__ = ["LogShipper", "LogReader", "bundle_name", "parse_bundle_name"]

#: The most bytes of file content one bundle holds (a 1 GB backlog goes up in this many pieces,
#: one per round, so the node's other files are never held behind it).
MAX_BUNDLE = 8 << 20
_SUFFIX = ".parts"


def bundle_name(stream: str, seq: int) -> str:
    return f"{stream}{_SUFFIX}/{seq:016d}"


def parse_bundle_name(name: str) -> tuple[str, int] | None:
    """``(stream, seq)`` of a bundle's name, else ``None``."""
    folder, _, seq = name.rpartition("/")
    if not folder.endswith(_SUFFIX) or len(seq) != 16 or not seq.isdigit():
        return None
    return folder[: -len(_SUFFIX)], int(seq)


class LogShipper:
    """The writing side: ships what grew in a set of local files as the next bundle of one stream.

    Args:
        store: Where bundles go.
        stream: The stream's name on the store (one per node and attempt).
    """

    def __init__(self, store: Store, stream: str):
        self.store, self.stream = store, stream
        self.shipped: dict[str, int] = {}  # file name -> bytes shipped
        self.seq = 0
        self.bytes_sent = 0

    def pending(self, files: dict[str, Path]) -> bool:
        """Whether any of ``files`` grew past what was shipped."""
        return any(_size(path) > self.shipped.get(rel, 0) for rel, path in files.items())

    def ship(self, files: dict[str, Path], limit: int = MAX_BUNDLE) -> bool:
        """Puts one bundle of what grew in ``files`` (name -> local path), at most ``limit`` bytes
        of content; ``True`` if one went up."""
        header: list[tuple[str, int, int]] = []
        pieces: list[bytes] = []
        budget = limit
        for rel, path in sorted(files.items()):
            have = self.shipped.get(rel, 0)
            if budget <= 0 or _size(path) <= have:
                continue
            with open(path, "rb") as f:
                f.seek(have)
                data = f.read(budget)
            if data:
                header.append((rel, have, len(data)))
                pieces.append(data)
                budget -= len(data)
        if not pieces:
            return False
        body = json.dumps({"files": header}, separators=(",", ":")).encode() + b"\n" + b"".join(pieces)
        self.store.write_bytes(bundle_name(self.stream, self.seq), body)
        self.seq += 1
        self.bytes_sent += len(body)
        for rel, offset, length in header:
            self.shipped[rel] = offset + length
        return True

    def ship_all(self, files: dict[str, Path]) -> None:
        """Ships bundles until nothing is left (a node's last push)."""
        while self.ship(files):
            pass


class LogReader:
    """The reading side: appends new bundles of each stream to local files, in order, each byte once.

    Args:
        place: The local path of a file name found in a bundle; raises ``ValueError`` for a
            name that must not be written (one that would leave the run dir).
        report: Called with a bundle's problem (a refused name, a malformed header).
    """

    def __init__(self, place: Callable[[str], Path], report: Callable[[BaseException], None]):
        self.place, self.report = place, report
        self.next_seq: dict[str, int] = {}
        self.offsets: dict[str, int] = {}  # file name -> bytes appended locally

    def fetch(self, store: Store, streams: dict[str, dict[int, int]]) -> int:
        """Reads the listed bundles (stream -> seq -> size, as listed) that follow what was read,
        up to each stream's first gap; how many bundles were applied.

        Each is one ranged read of its listed size: no lookup of its size in a listing cache
        that may predate it.
        """
        applied = 0
        for stream, seqs in streams.items():
            seq = self.next_seq.get(stream, 0)
            while seq in seqs:
                self._apply(store.read_bytes(bundle_name(stream, seq), 0, seqs[seq]))
                seq += 1
                applied += 1
            self.next_seq[stream] = seq
        return applied

    def follow(self, store: Store, stream: str) -> int:
        """Reads the bundles of one stream that follow what was read, by name, without a listing
        (one request when nothing is new); how many were applied."""
        seq, applied = self.next_seq.get(stream, 0), 0
        while True:
            try:
                body = store.read_bytes(bundle_name(stream, seq))
            except FileNotFoundError:
                break
            self._apply(body)
            seq, applied = seq + 1, applied + 1
        self.next_seq[stream] = seq
        return applied

    def _apply(self, body: bytes) -> None:
        head, _, data = body.partition(b"\n")
        try:
            files = [(str(rel), int(offset), int(length)) for rel, offset, length in json.loads(head)["files"]]
        except (ValueError, KeyError, TypeError) as exc:
            self.report(ValueError(f"a log bundle with a malformed header: {exc}"))
            return
        position = 0
        for rel, offset, length in files:
            piece = data[position : position + length]
            position += length
            try:
                local = self.place(rel)
            except ValueError as exc:
                self.report(exc)
                continue
            have = self.offsets.get(rel, 0)
            if offset > have or offset + len(piece) <= have:
                continue  # a hole (never shipped so) or bytes this reader has: nothing to append
            local.parent.mkdir(parents=True, exist_ok=True)
            with open(local, "ab") as f:
                f.write(piece[have - offset :])
            self.offsets[rel] = offset + len(piece)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
