"""The Delta ledger, window clipping and the journal of attempts in progress."""

import json
import os
import subprocess
import sys
import time

import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from sparkgpu.usage.journal import AttemptJournal
from sparkgpu.usage.ledger import UsageLedger, UsageRecord, clip_to_window, ledger_schema
from sparkgpu.usage.rates import RateCard

NOW = time.time()


def record(job_id="job-a", attempt=0, *, hours_ago=1.0, hours=1.0, gpus=8, gpu_type="H100", tags=None, user="ana"):
    end = NOW - hours_ago * 3600
    return UsageRecord.priced(
        job_id=job_id,
        job_name="train",
        attempt=attempt,
        user=user,
        tags=tags if tags is not None else {"team": "ml"},
        backend="local",
        gpu_type=gpu_type,
        gpus=gpus,
        simulated=False,
        status="succeeded",
        started_at=end - hours * 3600,
        ended_at=end,
        rates=RateCard({"H100": 6.0, "A10": 1.0}),
    )


def test_rows_round_trip_and_other_readers_see_the_same_table(tmp_path):
    ledger = UsageLedger(str(tmp_path / "ledger"))
    ledger.append([record("job-a", tags={"team": "ml", "project": "ctr"})])
    ledger.append([record("job-b", gpu_type="A10", gpus=1, tags={})])
    rows = ledger.read()
    assert rows.schema == ledger_schema()
    assert sorted(rows["job_id"].to_pylist()) == ["job-a", "job-b"]
    assert ledger.version() == 1  # one transaction per append
    # Any Delta reader can query it: pandas through deltalake, with tags as a map column.
    frame = DeltaTable(str(tmp_path / "ledger")).to_pandas().sort_values("job_id")
    assert frame["gpu_seconds"].tolist() == [8 * 3600.0, 3600.0]
    assert frame["cost_usd"].tolist() == [48.0, 1.0]
    assert dict(frame.iloc[0]["tags"]) == {"team": "ml", "project": "ctr"}
    assert pc.map_lookup(rows["tags"], "project", "first").to_pylist().count("ctr") == 1


def test_a_ledger_that_does_not_exist_yet_reads_as_empty(tmp_path):
    ledger = UsageLedger(str(tmp_path / "nothing-here"))
    rows = ledger.read(since=NOW - 86400)
    assert rows.num_rows == 0 and rows.schema == ledger_schema()
    assert ledger.version() is None
    assert not (tmp_path / "nothing-here").exists()  # reading never creates the table


def test_read_returns_attempts_overlapping_the_window(tmp_path):
    ledger = UsageLedger(str(tmp_path / "ledger"))
    ledger.append([record("old", hours_ago=48), record("edge", hours_ago=23.5), record("new", hours_ago=1)])
    ids = sorted(ledger.read(since=NOW - 24 * 3600)["job_id"].to_pylist())
    assert ids == ["edge", "new"]
    assert sorted(ledger.read(until=NOW - 30 * 3600)["job_id"].to_pylist()) == ["old"]


# What the CLI does after a job: read the ledger for its GPU-hours line, print, exit.
_READ_THEN_EXIT = """
import sys
from sparkgpu.usage.ledger import UsageLedger
print(UsageLedger(sys.argv[1]).read(since=0.0).num_rows)
"""


def test_a_process_that_exits_right_after_reading_the_ledger_exits_cleanly(tmp_path):
    # A pyarrow scan through deltalake's Python file handler aborted about one such exit in
    # three ("terminate called without an active exception", rc -6), after printing success.
    ledger = UsageLedger(str(tmp_path / "ledger"))
    ledger.append([record("job-a"), record("job-b", attempt=1)])
    for _ in range(4):
        runs = [
            subprocess.Popen(
                [sys.executable, "-c", _READ_THEN_EXIT, ledger.uri],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(3)
        ]
        for run in runs:
            out, err = run.communicate(timeout=120)
            assert (run.returncode, out) == (0, "2\n"), err


def test_clipping_counts_only_the_share_inside_the_window(tmp_path):
    ledger = UsageLedger(str(tmp_path / "ledger"))
    # Ran from 25h ago to 23h ago: half of it lies inside "the last 24h".
    ledger.append([record("edge", hours_ago=23, hours=2)])
    rows = clip_to_window(ledger.read(since=NOW - 86400), NOW - 86400, NOW)
    assert rows["gpu_seconds"][0].as_py() == pytest.approx(8 * 3600)
    assert rows["cost_usd"][0].as_py() == pytest.approx(48.0, rel=1e-3)
    assert rows["duration_s"][0].as_py() == pytest.approx(3600, rel=1e-3)


def test_compaction_keeps_every_row(tmp_path):
    ledger = UsageLedger(str(tmp_path / "ledger"))
    for i in range(5):
        ledger.append([record(f"job-{i}")])
    files_before = len(DeltaTable(ledger.uri).file_uris())
    metrics = ledger.compact()
    assert files_before == 5 and len(DeltaTable(ledger.uri).file_uris()) == 1
    assert metrics["numFilesRemoved"] == 5
    assert sorted(ledger.read()["job_id"].to_pylist()) == [f"job-{i}" for i in range(5)]


def test_the_ledger_compacts_itself_as_rows_accumulate(tmp_path):
    ledger = UsageLedger(str(tmp_path / "ledger"), compact_every=5)
    for i in range(6):  # versions 0..5: the commit of version 5 triggers compaction
        ledger.append([record(f"job-{i}")])
    assert len(DeltaTable(ledger.uri).file_uris()) == 1
    ledger.append([record("job-6")])
    assert len(DeltaTable(ledger.uri).file_uris()) == 2
    assert ledger.read().num_rows == 7


# -- the journal of attempts in progress --------------------------------------------------------
def _args(job_id="lost-job", attempt=0, started_at=None):
    return dict(
        job_id=job_id,
        job_name="train",
        attempt=attempt,
        user="ana",
        tags={"team": "ml"},
        backend="local",
        gpu_type="H100",
        gpus=8,
        simulated=False,
        status="running",
        started_at=started_at if started_at is not None else NOW - 600,
        rate=6.0,
    )


def _write(ledger):
    from sparkgpu.usage.meter import write_journaled

    return lambda records: write_journaled(ledger, records)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_an_attempt_whose_client_died_is_billed_up_to_its_last_heartbeat(tmp_path):
    journal = AttemptJournal(tmp_path / "open")
    ledger = UsageLedger(str(tmp_path / "ledger"))
    path = journal.open("lost-job", 0, _args())
    entry = json.loads(path.read_text())
    entry["owner"]["pid"], entry["heartbeat"] = _dead_pid(), NOW - 300  # the client died 5 minutes in
    path.write_text(json.dumps(entry))

    recovered = journal.recover(_write(ledger))
    assert [r["status"] for r in recovered] == ["client_lost"]
    row = ledger.read().to_pylist()[0]
    assert row["status"] == "client_lost" and row["job_id"] == "lost-job"
    assert row["gpu_seconds"] == 8 * 300 and row["cost_usd"] == pytest.approx(4.0)
    assert list((tmp_path / "open").iterdir()) == []
    assert journal.recover(_write(ledger)) == []  # written once, never twice


def test_attempts_of_a_live_client_are_left_alone(tmp_path):
    journal = AttemptJournal(tmp_path / "open")
    ledger = UsageLedger(str(tmp_path / "ledger"))
    path = journal.open("running-job", 0, _args("running-job"))
    journal.beat(path)
    assert journal.recover(_write(ledger)) == []
    assert path.exists() and ledger.version() is None


def test_entries_are_given_back_when_the_ledger_cannot_be_written(tmp_path):
    journal = AttemptJournal(tmp_path / "open")
    path = journal.open("job", 0, _args("job"))
    journal.finish(path, {**_args("job"), "ended_at": NOW - 60, "status": "succeeded"})
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the ledger's folder should be")
    with pytest.raises(DeltaError):  # the store's own error goes through, the entry stays
        journal.recover(_write(UsageLedger(str(blocker / "ledger"))))
    assert path.exists()  # nothing lost; the next recovery writes it
    ledger = UsageLedger(str(tmp_path / "ledger"))
    assert [r["status"] for r in journal.recover(_write(ledger))] == ["succeeded"]
    assert ledger.read()["gpu_seconds"].to_pylist() == [8 * 540.0]


def test_a_claim_left_by_a_dead_recoverer_is_released(tmp_path):
    journal = AttemptJournal(tmp_path / "open")
    path = journal.open("job", 0, _args("job"))
    journal.finish(path, {**_args("job"), "ended_at": NOW - 60, "status": "failed"})
    os.rename(path, path.with_name(f"{path.name}.claimed-{_dead_pid()}"))
    ledger = UsageLedger(str(tmp_path / "ledger"))
    assert [r["status"] for r in journal.recover(_write(ledger))] == ["failed"]
    assert ledger.read().num_rows == 1
