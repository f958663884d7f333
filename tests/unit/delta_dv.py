"""Deletion vectors on a Delta table made with deltalake (which cannot write them itself).

Writes a real deletion-vector file in the Delta protocol's format (a version byte, then per
vector its size, the magic number, a 64-bit portable Roaring bitmap, and a CRC-32) and
commits a new table version that re-adds the file with that vector, as Spark/Databricks do
when rows are deleted from a table with ``delta.enableDeletionVectors``.

Two layouts of the protocol's descriptor (``storageType``):

- ``"u"``, what Databricks writes: the file lives inside the table folder, at
  ``<prefix>/deletion_vector_<uuid>.bin``, and ``pathOrInlineDv`` is ``<prefix>`` followed by
  the UUID's 16 bytes in Z85 (20 characters). The vectors travel with the table when it is
  copied elsewhere (to S3).
- ``"p"``: ``pathOrInlineDv`` is the file's absolute URI, wherever it is.
"""

from __future__ import annotations

import json
import os
import struct
import time
import uuid
import zlib

from pyroaring import BitMap

_MAGIC = 1681511377
_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"


def z85(raw: bytes) -> str:
    """Z85 (ZeroMQ's base85), the encoding of a ``"u"`` descriptor's UUID; ``len(raw) % 4 == 0``."""
    out = []
    for (word,) in struct.iter_unpack(">I", raw):
        chars = []
        for _ in range(5):
            word, digit = divmod(word, 85)
            chars.append(_Z85[digit])
        out.extend(reversed(chars))
    return "".join(out)


def _bitmap_bytes(rows: list[int]) -> bytes:
    # RoaringTreemap, portable: number of 32-bit buckets, then (high 32 bits, 32-bit bitmap).
    high = {}
    for row in rows:
        high.setdefault(row >> 32, []).append(row & 0xFFFFFFFF)
    body = struct.pack("<q", len(high))
    for key in sorted(high):
        body += struct.pack("<I", key) + BitMap(high[key]).serialize()
    return struct.pack("<i", _MAGIC) + body


def delete_rows(table_path: str, file_name: str, rows: list[int], storage_type: str = "u", prefix: str = "ab") -> int:
    """Marks ``rows`` (positions in ``file_name``) deleted by a deletion vector; returns the new version.

    Args:
        table_path: The table's folder.
        file_name: The data file, as the log names it.
        rows: Row positions in that file.
        storage_type: ``"u"`` (a path relative to the table) or ``"p"`` (an absolute URI).
        prefix: With ``"u"``, the random folder prefix (may be empty: the file is then at the table's root).
    """
    log = os.path.join(table_path, "_delta_log")
    versions = sorted(int(n.split(".")[0]) for n in os.listdir(log) if n.endswith(".json"))
    add = None
    for version in versions:
        with open(os.path.join(log, f"{version:020d}.json")) as handle:
            for line in handle:
                action = json.loads(line)
                if "add" in action and action["add"]["path"] == file_name:
                    add = action["add"]
    assert add is not None, f"{file_name} is not in the table"
    data = _bitmap_bytes(sorted(rows))
    dv_id = uuid.uuid4()
    if storage_type == "u":
        dv_path = os.path.join(table_path, prefix, f"deletion_vector_{dv_id}.bin")
        where = prefix + z85(dv_id.bytes)
    elif storage_type == "p":
        dv_path = os.path.join(table_path, f"deletion_vector_{dv_id}.bin")
        where = "file://" + os.path.abspath(dv_path)
    else:
        raise ValueError(f"storage_type {storage_type!r}: 'u' or 'p'")
    os.makedirs(os.path.dirname(dv_path), exist_ok=True)
    with open(dv_path, "wb") as handle:
        handle.write(b"\x01" + struct.pack(">i", len(data)) + data + struct.pack(">I", zlib.crc32(data)))
    descriptor = {
        "storageType": storage_type,
        "pathOrInlineDv": where,
        "offset": 1,
        "sizeInBytes": len(data),
        "cardinality": len(rows),
    }
    now = int(time.time() * 1000)
    removed = {
        "path": file_name,
        "deletionTimestamp": now,
        "dataChange": True,
        "extendedFileMetadata": True,
        "partitionValues": add["partitionValues"],
        "size": add["size"],
    }
    if add.get("deletionVector"):
        removed["deletionVector"] = add["deletionVector"]
    re_added = dict(add, deletionVector=descriptor, modificationTime=now)
    new = versions[-1] + 1
    with open(os.path.join(log, f"{new:020d}.json"), "x") as handle:
        handle.write(json.dumps({"commitInfo": {"timestamp": now, "operation": "DELETE"}}) + "\n")
        handle.write(json.dumps({"remove": removed}) + "\n")
        handle.write(json.dumps({"add": re_added}) + "\n")
    return new
