"""The claim a conversion takes on its output folder: one holder, waiters, leases, takeovers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pytest

from sparkgpu._process import machine_id
from sparkgpu.data.convert.claim import CLAIM_PREFIX, ClaimRecord, FolderClaim, is_claim
from sparkgpu.errors import DataError
from sparkgpu.store import Store


@pytest.fixture(autouse=True)
def short_lease(monkeypatch):
    monkeypatch.setattr(FolderClaim, "lease_s", 0.4)
    monkeypatch.setattr(FolderClaim, "poll_s", 0.02)


def claims_in(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if is_claim(n)) if os.path.isdir(folder) else []


def never(_waited):
    return None


def test_a_second_claim_waits_for_the_first_and_takes_the_folder_once_it_is_released(tmp_path):
    store = Store(str(tmp_path / "out"))
    first = FolderClaim(store, "run-a")
    assert first.acquire(0, never) is None
    assert claims_in(store.url) == [f"{CLAIM_PREFIX}0000000001"]

    second = FolderClaim(store, "run-b")
    waited = []
    threading.Timer(0.3, first.release).start()
    assert second.acquire(10, lambda w: waited.append(w)) is None
    assert waited == [True]
    assert 0.25 < second.waited_s < 2
    assert second.generation == 1  # released, not taken over: numbering starts again
    second.check_held()
    second.release()
    assert claims_in(store.url) == []


def test_a_claim_held_by_a_live_conversion_fails_after_the_wait_naming_it_and_the_fix(tmp_path, capsys):
    store = Store(str(tmp_path / "out"))
    holder = FolderClaim(store, "holder-run-id")
    holder.acquire(0, never)
    holder.note_progress(1500, 4000, "rows")
    try:
        time.sleep(FolderClaim.lease_s / 3 + 0.1)  # one renewal: the progress is in the file
        began = time.monotonic()
        with pytest.raises(DataError) as caught:
            FolderClaim(store, "run-b").acquire(1.0, never)
        waited = time.monotonic() - began
    finally:
        holder.release()
    # Renewals kept the claim live through more than two leases of waiting.
    assert 1.0 <= waited < 2.0
    message = str(caught.value)
    assert "still being converted by run holder-run-i" in message
    assert f"pid {os.getpid()}" in message and "1,500 of 4,000 rows done" in message
    assert "wait=" in message and "data_options" in message and "another folder" in message
    assert "is being converted by run holder-run-i" in capsys.readouterr().err


def test_wait_zero_fails_at_once(tmp_path):
    store = Store(str(tmp_path / "out"))
    holder = FolderClaim(store, "run-a")
    holder.acquire(0, never)
    began = time.monotonic()
    with pytest.raises(DataError, match="after waiting 0 s"):
        FolderClaim(store, "run-b").acquire(0, never)
    assert time.monotonic() - began < 0.3
    holder.release()


def test_a_claim_no_longer_renewed_is_taken_over_after_its_lease_and_its_holder_cannot_commit(tmp_path, capsys):
    store = Store(str(tmp_path / "out"))
    frozen = FolderClaim(store, "frozen-run")
    frozen.acquire(0, never)
    frozen._stop.set()  # a process paused, or cut off from the store: no more renewals
    frozen._renewer.join()

    began = time.monotonic()
    taker = FolderClaim(store, "taker-run")
    assert taker.acquire(10, never) is None
    took = time.monotonic() - began
    assert FolderClaim.lease_s <= took < FolderClaim.lease_s + 0.5
    assert taker.generation == 2
    assert "took over" in capsys.readouterr().err

    with pytest.raises(DataError, match="taken over by run taker-run.*Run the conversion again"):
        frozen.check_held()
    frozen.release()  # removes its own generation only
    assert claims_in(store.url) == [f"{CLAIM_PREFIX}0000000002"]
    taker.release()
    assert claims_in(store.url) == []


def test_a_holder_whose_renewal_finds_the_claim_taken_over_stops_its_writers(tmp_path):
    store = Store(str(tmp_path / "out"))
    holder = FolderClaim(store, "run-a")
    holder.acquire(0, never)
    record = ClaimRecord("run-b", 2, "elsewhere", None, 1, None, time.time(), 0, 60.0, {})
    (tmp_path / "out" / f"{CLAIM_PREFIX}0000000002").write_bytes(record.to_bytes())
    time.sleep(FolderClaim.lease_s / 3 + 0.15)
    with pytest.raises(DataError, match="taken over by run run-b"):
        holder.raise_if_lost()
    holder.release()


def test_the_claim_of_a_process_gone_from_this_machine_is_taken_over_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(FolderClaim, "lease_s", 30.0)
    if machine_id() is None:
        pytest.skip("needs /proc to tell this machine's processes")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone.stdout)
    store = Store(str(tmp_path / "out"))
    dead = ClaimRecord("dead-run", 1, "here", machine_id(), pid, None, time.time(), 3, 30.0, {})
    store.write_bytes(f"{CLAIM_PREFIX}0000000001", dead.to_bytes())

    began = time.monotonic()
    taker = FolderClaim(store, "taker")
    assert taker.acquire(60, never) is None
    assert time.monotonic() - began < 1.0  # not the 30 s lease
    assert taker.generation == 2
    taker.release()


def test_a_live_process_of_another_machine_is_not_judged_by_its_pid(tmp_path, monkeypatch):
    """A pid from another host means nothing here: only the lease decides."""
    store = Store(str(tmp_path / "out"))
    elsewhere = ClaimRecord("remote-run", 1, "h2", "h2/boot/pid:[1]", 999_999_999, None, time.time(), 0, 0.4, {})
    store.write_bytes(f"{CLAIM_PREFIX}0000000001", elsewhere.to_bytes())
    began = time.monotonic()
    taker = FolderClaim(store, "taker")
    taker.acquire(10, never)
    assert time.monotonic() - began >= 0.4
    taker.release()


def test_an_unreadable_claim_counts_as_live_until_it_stays_unchanged_for_a_lease(tmp_path):
    store = Store(str(tmp_path / "out"))
    store.write_bytes(f"{CLAIM_PREFIX}0000000003", b"{not json")
    with pytest.raises(DataError, match="unreadable claim"):
        FolderClaim(store, "run-b").acquire(0, never)
    taker = FolderClaim(store, "run-c")
    taker.acquire(10, never)
    assert taker.generation == 4
    taker.release()
    assert claims_in(store.url) == []


def test_renewals_change_the_claim_and_carry_the_progress(tmp_path):
    store = Store(str(tmp_path / "out"))
    holder = FolderClaim(store, "run-a")
    holder.acquire(0, never)
    path = tmp_path / "out" / f"{CLAIM_PREFIX}0000000001"
    first = ClaimRecord.parse(path.read_bytes())
    holder.note_progress(3, 8, "Spark tasks")
    time.sleep(FolderClaim.lease_s / 3 + 0.15)
    later = ClaimRecord.parse(path.read_bytes())
    holder.release()
    assert first is not None and later is not None
    assert later.beats > first.beats and later.progress == {"done": 3, "total": 8, "unit": "Spark tasks"}
    assert first.pid == os.getpid() and first.lease_s == FolderClaim.lease_s
    assert "3 of 8 Spark tasks done" in later.describe()


def test_finished_may_return_a_dataset_instead_of_converting(tmp_path):
    store = Store(str(tmp_path / "out"))
    assert FolderClaim(store, "run-a").acquire(0, lambda waited: {"waited": waited}) == {"waited": False}
    assert claims_in(store.url) == []  # the claim taken to look was released


def test_of_threads_racing_for_one_folder_exactly_one_holds_it_at_a_time(tmp_path):
    store = Store(str(tmp_path / "out"))
    holding, overlaps, order = [], [], []
    lock = threading.Lock()

    def convert(name):
        claim = FolderClaim(store, name)
        claim.acquire(20, never)
        with lock:
            holding.append(name)
            overlaps.append(len(holding))
        time.sleep(0.05)
        with lock:
            holding.remove(name)
            order.append(name)
        claim.release()

    threads = [threading.Thread(target=convert, args=(f"run-{i}",)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(order) == [f"run-{i}" for i in range(6)]
    assert max(overlaps) == 1
    assert claims_in(store.url) == []


def test_claims_work_on_other_fsspec_filesystems(tmp_path):
    store = Store(f"memory://claims-{tmp_path.name}/out")
    holder = FolderClaim(store, "run-a")
    holder.acquire(0, never)
    with pytest.raises(DataError, match="still being converted by run run-a"):
        FolderClaim(store, "run-b").acquire(0, never)
    holder.release()
    assert not [n for n in store.listdir() if is_claim(n)]


def test_a_conversion_claims_its_folder_before_the_source_writes_anything(tmp_path, monkeypatch):
    """Spark conversions start their job in write(): the client holds the claim by then."""
    from sparkgpu.data.convert import conversion
    from sparkgpu.data.convert.files import resolve_file_source

    table = pa.table({"id": list(range(10))})
    inner = resolve_file_source(table)
    seen = {}

    class WatchedSource:
        schema = inner.schema
        description = inner.description

        def fingerprint(self):
            return inner.fingerprint()

        def write(self, volume, options, **kwargs):
            seen["claims"] = [n for n in volume.listdir() if is_claim(n)]
            seen["record"] = json.loads(volume.read_bytes(seen["claims"][0]))
            return inner.write(volume, options, **kwargs)

    source = WatchedSource()
    monkeypatch.setattr(conversion, "_resolve", lambda *args: source)
    result = conversion.to_mds(table, str(tmp_path / "out"), progress=False)
    assert seen["claims"] == [f"{CLAIM_PREFIX}0000000001"] and seen["record"]["pid"] == os.getpid()
    assert result.samples == 10 and claims_in(tmp_path / "out") == []


def test_to_mds_refuses_a_complete_dataset_it_did_not_wait_for(tmp_path):
    from sparkgpu import data
    from sparkgpu.errors import ConfigurationError

    table = pa.table({"id": list(range(10))})
    data.to_mds(table, str(tmp_path / "out"), progress=False)
    with pytest.raises(ConfigurationError, match="overwrite=True"):
        data.to_mds(table, str(tmp_path / "out"), progress=False)
    assert claims_in(tmp_path / "out") == []


@pytest.mark.parametrize("wait", [-1, "soon", True])
def test_wait_must_be_a_duration(tmp_path, wait):
    from sparkgpu import data
    from sparkgpu.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="wait="):
        data.to_mds(pa.table({"id": [1]}), str(tmp_path / "out"), progress=False, wait=wait)
