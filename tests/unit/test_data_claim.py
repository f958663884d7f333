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

from sparkgpu._util.process import machine_id
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


class WaiterClock:
    """A waiter's clock that moves only when the waiter pauses, then runs what falls due.

    Installed as :attr:`FolderClaim.clock` and :attr:`FolderClaim.sleep`, it makes the test,
    not the machine's load, decide when a waiter sees a release, a renewal or a lease run out.
    """

    def __init__(self):
        self.now = 1000.0
        self.pauses: list[float] = []
        self._due: list[tuple[float, float, object]] = []  # (when, period or 0, action)

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds
        for entry in sorted(self._due, key=lambda e: e[0]):
            when, period, action = entry
            if when <= self.now:
                self._due.remove(entry)
                if period:
                    self._due.append((when + period, period, action))
                action()

    def at(self, after: float, action) -> None:
        """Runs ``action`` once the waiter's pauses took it ``after`` seconds from now."""
        self._due.append((self.now + after, 0.0, action))

    def every(self, period: float, action) -> None:
        """Runs ``action`` each time the waiter's pauses took it another ``period`` seconds."""
        self._due.append((self.now + period, period, action))


@pytest.fixture
def clock(monkeypatch) -> WaiterClock:
    fake = WaiterClock()
    monkeypatch.setattr(FolderClaim, "clock", fake.monotonic)
    monkeypatch.setattr(FolderClaim, "sleep", fake.sleep)
    return fake


def renewed(path, times: int = 1) -> ClaimRecord:
    """The claim at ``path`` once its holder's renewer thread rewrote it ``times`` more times.

    Waits for the renewals themselves (a 30 s bound only guards against a hang). A renewal
    being written while this looks may have been built before the caller's last change: ask
    for 2 to be sure the claim carries that change.
    """
    first = ClaimRecord.parse(path.read_bytes())
    assert first is not None
    guard = time.monotonic() + 30
    while time.monotonic() < guard:
        record = ClaimRecord.parse(path.read_bytes())
        if record is not None and record.beats >= first.beats + times:
            return record
        time.sleep(0.01)
    pytest.fail(f"the holder did not renew {path.name} {times} time(s) in 30 s")


def test_a_second_claim_waits_for_the_first_and_takes_the_folder_once_it_is_released(tmp_path, clock):
    store = Store(str(tmp_path / "out"))
    first = FolderClaim(store, "run-a")
    assert first.acquire(0, never) is None
    assert claims_in(store.url) == [f"{CLAIM_PREFIX}0000000001"]

    second = FolderClaim(store, "run-b")
    waited = []
    clock.at(0.3, first.release)  # 0.3 s into the wait: less than a lease, so no takeover
    assert second.acquire(10, lambda w: waited.append(w)) is None
    assert waited == [True]
    # Taken at the first look after the release, not before it.
    assert 0.3 <= second.waited_s <= 0.3 + FolderClaim.poll_s + 1e-9
    assert second.generation == 1  # released, not taken over: numbering starts again
    second.check_held()
    second.release()
    assert claims_in(store.url) == []


def test_a_claim_held_by_a_live_conversion_fails_after_the_wait_naming_it_and_the_fix(tmp_path, capsys, clock):
    store = Store(str(tmp_path / "out"))
    holder = FolderClaim(store, "holder-run-id")
    holder.acquire(0, never)
    path = tmp_path / "out" / f"{CLAIM_PREFIX}0000000001"
    holder.note_progress(1500, 4000, "rows")
    try:
        assert renewed(path, 2).progress["done"] == 1500
        # The holder renews every third of a lease of the waiter's time, as it promises.
        beats = []
        clock.every(FolderClaim.lease_s / 3, lambda: beats.append(renewed(path).beats))
        began = clock.now
        with pytest.raises(DataError) as caught:
            FolderClaim(store, "run-b").acquire(1.0, never)
        waited = clock.now - began
        holder.check_held()  # not taken over
    finally:
        holder.release()
    # Renewals kept the claim live through more than two leases of waiting, and the waiter
    # gave up when its wait ran out.
    assert waited == pytest.approx(1.0) and waited > 2 * FolderClaim.lease_s
    assert len(beats) == 7 and beats == sorted(set(beats))
    message = str(caught.value)
    assert "still being converted by run holder-run-i" in message
    assert f"pid {os.getpid()}" in message and "1,500 of 4,000 rows done" in message
    assert "wait=" in message and "data_options" in message and "another folder" in message
    assert "is being converted by run holder-run-i" in capsys.readouterr().err


def test_wait_zero_fails_at_once(tmp_path, clock):
    store = Store(str(tmp_path / "out"))
    holder = FolderClaim(store, "run-a")
    holder.acquire(0, never)
    with pytest.raises(DataError, match="after waiting 0 s"):
        FolderClaim(store, "run-b").acquire(0, never)
    assert clock.pauses == []
    holder.release()


def test_a_claim_no_longer_renewed_is_taken_over_after_its_lease_and_its_holder_cannot_commit(tmp_path, capsys, clock):
    store = Store(str(tmp_path / "out"))
    frozen = FolderClaim(store, "frozen-run")
    frozen.acquire(0, never)
    frozen._stop.set()  # a process paused, or cut off from the store: no more renewals
    frozen._renewer.join()

    began = clock.now
    taker = FolderClaim(store, "taker-run")
    assert taker.acquire(10, never) is None
    took = clock.now - began
    # At the first look after a whole lease unchanged, not before.
    assert FolderClaim.lease_s <= took <= FolderClaim.lease_s + FolderClaim.poll_s + 1e-9
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
    holder._renewer.join(30)  # its next renewal finds generation 2 and stops renewing
    assert not holder._renewer.is_alive()
    with pytest.raises(DataError, match="taken over by run run-b"):
        holder.raise_if_lost()
    holder.release()


def test_the_claim_of_a_process_gone_from_this_machine_is_taken_over_at_once(tmp_path, monkeypatch, clock):
    monkeypatch.setattr(FolderClaim, "lease_s", 30.0)
    if machine_id() is None:
        pytest.skip("needs /proc to tell this machine's processes")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone.stdout)
    store = Store(str(tmp_path / "out"))
    dead = ClaimRecord("dead-run", 1, "here", machine_id(), pid, None, time.time(), 3, 30.0, {})
    store.write_bytes(f"{CLAIM_PREFIX}0000000001", dead.to_bytes())

    taker = FolderClaim(store, "taker")
    assert taker.acquire(60, never) is None
    assert clock.pauses == []  # at the first look, not after the 30 s lease
    assert taker.generation == 2
    taker.release()


def test_a_live_process_of_another_machine_is_not_judged_by_its_pid(tmp_path, clock):
    """A pid from another host means nothing here: only the lease decides."""
    store = Store(str(tmp_path / "out"))
    elsewhere = ClaimRecord("remote-run", 1, "h2", "h2/boot/pid:[1]", 999_999_999, None, time.time(), 0, 0.4, {})
    store.write_bytes(f"{CLAIM_PREFIX}0000000001", elsewhere.to_bytes())
    began = clock.now
    taker = FolderClaim(store, "taker")
    taker.acquire(10, never)
    assert 0.4 <= clock.now - began <= 0.4 + FolderClaim.poll_s + 1e-9  # after its 0.4 s lease
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
    later = renewed(path, 2)
    holder.release()
    assert first is not None and later is not None
    assert later.beats > first.beats and later.progress == {"done": 3, "total": 8, "unit": "Spark tasks"}
    assert first.pid == os.getpid() and first.lease_s == FolderClaim.lease_s
    assert "3 of 8 Spark tasks done" in later.describe()


def test_finished_may_return_a_dataset_instead_of_converting(tmp_path):
    store = Store(str(tmp_path / "out"))
    assert FolderClaim(store, "run-a").acquire(0, lambda waited: {"waited": waited}) == {"waited": False}
    assert claims_in(store.url) == []  # the claim taken to look was released


def test_of_threads_racing_for_one_folder_exactly_one_holds_it_at_a_time(tmp_path, monkeypatch):
    # Every holder releases: a lease long enough that a thread starved by a busy machine is
    # never taken over, which would be a second holder by design, not a race.
    monkeypatch.setattr(FolderClaim, "lease_s", 30.0)
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
