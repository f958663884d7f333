"""Two processes converting the same data into the same folder at once: one converts, the
other waits for it and reuses its dataset; a converter that dies is taken over.

Real OS processes (multiprocessing, spawn), released together by a barrier, on a local folder
and on the loopback S3 server. Each child slows its shard writes down (a bigger table, in
effect) and logs every shard it writes to a file, so the test can count the conversions. A
child may also hold its writes at a gate until another process's log says something (that it
waits), so the overlap the test is about happens on a loaded machine too.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import struct
import time
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkgpu.data.convert.output import INDEX_NAME

pytestmark = pytest.mark.integration

ROWS = 1200


def _convert_in_child(job: dict, barrier) -> None:
    """Runs ``data.ensure_mds`` or ``data.to_mds`` as the job says; writes its result as JSON."""
    import sys

    sys.stderr = open(job["log"], "w", buffering=1)  # what the conversion reports, for the test
    from sparkgpu import data
    from sparkgpu.data.convert import claim
    from sparkgpu.store import Store

    claim.FolderClaim.lease_s = job["lease_s"]
    claim.FolderClaim.poll_s = 0.2
    if job.get("machine"):  # as if this process ran on that host: pids are not compared
        claim.machine_id = lambda: job["machine"]
    write_pieces = Store.write_pieces
    gate = job.get("gate")
    written = []

    def slow_logged(self, rel, pieces):
        if gate and len(written) >= gate["after"]:
            _wait_for(lambda: gate["text"] in _text(gate["log"]), what=f"{gate['text']!r} in {gate['log']}")
        time.sleep(job["shard_delay_s"])
        write_pieces(self, rel, pieces)
        written.append(rel)
        with open(job["writes"], "a") as f:  # read by the test, even after a SIGKILL
            f.write(rel + "\n")

    Store.write_pieces = slow_logged
    if barrier is not None:
        barrier.wait(timeout=120)
    convert = data.ensure_mds if job["call"] == "ensure_mds" else data.to_mds
    result = convert(job["source"], job["target"], size_limit=4096, max_workers=2, progress=False, wait=job["wait"])
    with open(job["result"], "w") as f:
        json.dump({"url": result.url, "reused": result.reused, "waited": result.waited, "samples": result.samples}, f)


def _source(tmp_path) -> tuple[str, pa.Table]:
    ids = np.arange(ROWS, dtype=np.int64)
    table = pa.table({"id": ids, "x": ids * 0.5, "name": [f"row-{i}" for i in ids]})
    folder = tmp_path / "source"
    folder.mkdir()
    for part in range(3):
        pq.write_table(table.slice(part * 400, 400), folder / f"part-{part}.parquet", row_group_size=100)
    return str(folder), table


def _job(tmp_path, name: str, source: str, target: str, call: str = "ensure_mds", **settings) -> dict:
    job = {
        "call": call,
        "source": source,
        "target": target,
        # Long enough that no renewal misses it on a loaded machine (a renewal fsyncs, which
        # can take seconds behind other tests' writes); the tests of expiry set their own.
        "lease_s": 30.0,
        "shard_delay_s": 0.03,
        "wait": 120,
        "log": str(tmp_path / f"{name}.log"),
        "writes": str(tmp_path / f"{name}.writes"),
        "result": str(tmp_path / f"{name}.json"),
    }
    job.update(settings)
    return job


def _start(jobs: list[dict], together: bool = True) -> tuple[list, object]:
    """Starts a process per job; returns them and the barrier that releases them together,
    which the caller keeps until they are done (its semaphore goes with the last reference)."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(len(jobs)) if together else None
    processes = [context.Process(target=_convert_in_child, args=(job, barrier)) for job in jobs]
    for process in processes:
        process.start()
    return processes, barrier


def _finish(processes, timeout: float = 120, logs: Sequence[str] = ()) -> None:
    """Waits for the children; a failed one's log (its traceback) is in the failure message."""
    for process in processes:
        process.join(timeout)
    for process in processes:
        if process.is_alive():
            process.kill()
    told = "".join(f"\n--- {log}:\n{_text(log)[-3000:]}" for log in logs)
    assert [p.exitcode for p in processes] == [0] * len(processes), told


def _text(path) -> str:
    return open(path).read() if os.path.exists(path) else ""


def _lines(path) -> list[str]:
    return _text(path).split()


def _result(job) -> dict:
    with open(job["result"]) as f:
        return json.load(f)


def _wait_for(condition, timeout: float = 60, what: str = "", unless=None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert unless is None or unless.is_alive(), f"{unless.name} ended before {what}"
        time.sleep(0.02)


def _read(url: str, name: str) -> bytes:
    if url.startswith("s3://"):
        import s3fs

        return s3fs.S3FileSystem().cat_file(f"{url[len('s3://') :]}/{name}")
    with open(os.path.join(url, name), "rb") as f:
        return f.read()


def _files_of(url: str) -> set[str]:
    if url.startswith("s3://"):
        import s3fs

        fs = s3fs.S3FileSystem()
        fs.invalidate_cache()
        root = url[len("s3://") :]
        return {path[len(root) + 1 :] for path in fs.find(root)}
    return {os.path.relpath(os.path.join(r, f), url) for r, _, names in os.walk(url) for f in names}


_DECODE = {
    "int64": lambda b: struct.unpack("<q", b)[0],
    "float64": lambda b: struct.unpack("<d", b)[0],
    "str": bytes.decode,
}


def _rows_of(url: str, index: dict) -> list[dict]:
    """Every sample of the dataset, decoded from the MDS layout here rather than by the package:
    ``[n][n + 1 offsets][config][samples]``, a sample ``[sizes of its variable columns][columns]``."""
    rows = []
    for shard in index["shards"]:
        raw = _read(url, shard["raw_data"]["basename"])
        columns = list(zip(shard["column_names"], shard["column_encodings"], shard["column_sizes"]))
        variable = sum(size is None for _, _, size in columns)
        (count,) = struct.unpack_from("<I", raw)
        offsets = struct.unpack_from(f"<{count + 1}I", raw, 4)
        for begin, end in zip(offsets, offsets[1:]):
            sizes = iter(struct.unpack_from(f"<{variable}I", raw, begin))
            position, row = begin + 4 * variable, {}
            for name, encoding, size in columns:
                size = next(sizes) if size is None else size
                row[name] = _DECODE[encoding](raw[position : position + size])
                position += size
            assert position == end
            rows.append(row)
    return rows


def _assert_complete_and_equal(url: str, table: pa.Table) -> dict:
    """Reads the dataset back, checks it holds the table's rows in order and nothing else; returns its index."""
    index = json.loads(_read(url, INDEX_NAME))
    assert _rows_of(url, index) == table.to_pylist()
    listed = {shard["raw_data"]["basename"] for shard in index["shards"]}
    # Nothing but the dataset: no claim, no marker, no shard of a dead or waiting conversion.
    assert _files_of(url) == listed | {INDEX_NAME}
    return index


def _gate_on_each_other(jobs: list[dict]) -> None:
    """Whichever of the two converts writes its first shard only once the other says it waits."""
    first, second = jobs
    first["gate"] = {"after": 0, "log": second["log"], "text": "waiting for it"}
    second["gate"] = {"after": 0, "log": first["log"], "text": "waiting for it"}


@pytest.fixture(params=["local", "s3"])
def volume(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "volume")
    return request.getfixturevalue("s3_bucket") + "/volume"


def test_two_processes_ensuring_the_same_table_convert_it_once_and_both_get_it(tmp_path, volume):
    source, table = _source(tmp_path)
    jobs = [_job(tmp_path, name, source, volume) for name in ("a", "b")]
    _gate_on_each_other(jobs)
    processes, _barrier = _start(jobs)
    _finish(processes, logs=[job["log"] for job in jobs])

    results = [_result(job) for job in jobs]
    assert results[0]["url"] == results[1]["url"] and {r["samples"] for r in results} == {ROWS}
    converted, waited = sorted(results, key=lambda r: r["reused"])
    assert not converted["reused"] and waited["reused"]
    assert waited["waited"] > 0  # it found the other one converting, and waited for it
    index = _assert_complete_and_equal(converted["url"], table)
    # The conversion ran once: every shard was written by one process, once.
    writes = [w for job in jobs for w in _lines(job["writes"])]
    assert sorted(writes) == sorted(shard["raw_data"]["basename"] for shard in index["shards"])
    waiter = next(job for job, r in zip(jobs, results) if r["reused"])
    assert "is being converted by run" in _text(waiter["log"])
    assert not _lines(waiter["writes"])


def test_two_processes_writing_the_same_data_with_to_mds_into_one_folder_write_it_once(tmp_path):
    source, table = _source(tmp_path)
    out = str(tmp_path / "out")
    jobs = [_job(tmp_path, name, source, out, call="to_mds") for name in ("a", "b")]
    _gate_on_each_other(jobs)
    processes, _barrier = _start(jobs)
    _finish(processes, logs=[job["log"] for job in jobs])

    results = [_result(job) for job in jobs]
    assert sorted(r["reused"] for r in results) == [False, True]
    index = _assert_complete_and_equal(out, table)
    writes = [w for job in jobs for w in _lines(job["writes"])]
    assert len(writes) == len(index["shards"])


def _kill_mid_conversion(tmp_path, volume: str, holder_settings: dict, waiter_settings: dict):
    """Starts a slow holder, lets a waiter find it converting, SIGKILLs the holder; returns
    the waiter's job and the seconds from the kill to the waiter's end."""
    source, table = _source(tmp_path)
    waiter = _job(tmp_path, "waiter", source, volume, **waiter_settings)
    # Two shards written, then held until the waiter waits: killed mid-conversion.
    gate = {"after": 2, "log": waiter["log"], "text": "waiting for it"}
    holder = _job(tmp_path, "holder", source, volume, gate=gate, **holder_settings)
    (holder_process,), _ = _start([holder], together=False)
    try:
        _wait_for(lambda: len(_lines(holder["writes"])) >= 2, what="the holder's first shards", unless=holder_process)
        (waiter_process,), _ = _start([waiter], together=False)
        _wait_for(
            lambda: "waiting for it" in _text(waiter["log"]),
            what="the waiter to find the holder",
            unless=waiter_process,
        )
        os.kill(holder_process.pid, signal.SIGKILL)
        killed = time.monotonic()
        _finish([waiter_process], logs=[waiter["log"], holder["log"]])
        after_kill = time.monotonic() - killed
    finally:
        holder_process.kill()
        holder_process.join()
    assert holder_process.exitcode == -signal.SIGKILL
    result = _result(waiter)
    assert not result["reused"] and result["samples"] == ROWS
    _assert_complete_and_equal(result["url"], table)
    return waiter, after_kill


def test_a_converter_killed_on_another_machine_is_taken_over_once_its_lease_expires(tmp_path, s3_bucket):
    lease = 1.0
    waiter, after_kill = _kill_mid_conversion(
        tmp_path,
        f"{s3_bucket}/volume",
        {"lease_s": lease, "machine": "host-a"},
        {"lease_s": lease, "machine": "host-b"},
    )
    log = _text(waiter["log"])
    unrenewed = float(re.search(r"not renewed for ([\d.]+) s", log).group(1))
    # Taken over a lease after the holder's last renewal, not sooner; and that renewal came at most
    # a lease before the kill (the holder renews every third of a lease): while the holder lived,
    # its renewals kept the waiter waiting. The takeover itself may come late on a loaded machine,
    # so its lateness is bounded by the kill-to-end time the test measured, not by a constant.
    assert lease <= unrenewed < lease + after_kill
    assert "took over" in log and "pid" in log
    assert after_kill < 30


def test_a_converter_killed_on_this_machine_is_taken_over_without_waiting_for_its_lease(tmp_path):
    waiter, after_kill = _kill_mid_conversion(tmp_path, str(tmp_path / "volume"), {"lease_s": 60.0}, {})
    assert "is gone from this machine" in _text(waiter["log"])
    assert after_kill < 30  # the conversion itself included; the lease is 60 s


def test_a_waiter_gives_up_after_its_wait_and_says_how_to_wait_longer(tmp_path):
    source, _ = _source(tmp_path)
    volume = str(tmp_path / "volume")
    impatient = _job(tmp_path, "impatient", source, volume, wait=1)
    # Holding its claim, mid-conversion, until the test has looked (it is killed then): released
    # at the impatient one's DataError, it could finish before the test saw the other one exit.
    released = str(tmp_path / "released")
    holder = _job(tmp_path, "holder", source, volume, gate={"after": 1, "log": released, "text": "released"})
    (holder_process,), _ = _start([holder], together=False)
    _wait_for(lambda: len(_lines(holder["writes"])) >= 1, what="the holder's first shard", unless=holder_process)
    (process,), _ = _start([impatient], together=False)
    process.join(60)
    alive = holder_process.is_alive()
    holder_process.kill()
    holder_process.join()
    assert process.exitcode == 1 and alive
    log = _text(impatient["log"])
    assert "DataError" in log and "still being converted by run" in log and "wait=" in log
    assert not _lines(impatient["writes"])
