"""Usage reports: grouping, windows, days, the rich table and the chart."""

import datetime as dt
import io

import pytest
from rich.console import Console

from sparkgpu.errors import ConfigurationError
from sparkgpu.usage.ledger import UsageLedger, UsageRecord
from sparkgpu.usage.rates import RateCard
from sparkgpu.usage.report import parse_since, plot_usage, render_usage_table, usage_table

MIDNIGHT = dt.datetime.now(dt.timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
CARD = RateCard({"H100": 6.0, "A10": 1.0})


def add(ledger, job_id, start, hours, *, gpus=1, gpu_type="A10", user="ana", tags=None, attempt=0):
    ledger.append(
        [
            UsageRecord.priced(
                job_id=job_id,
                job_name=job_id,
                attempt=attempt,
                user=user,
                tags=tags or {},
                backend="local",
                gpu_type=gpu_type,
                gpus=gpus,
                simulated=False,
                status="succeeded",
                started_at=start,
                ended_at=start + hours * 3600,
                rates=CARD,
            )
        ]
    )


@pytest.fixture
def ledger(tmp_path):
    ledger = UsageLedger(str(tmp_path / "ledger"))
    add(ledger, "ml-1", MIDNIGHT - 5 * 86400, 2, gpus=8, gpu_type="H100", tags={"team": "ml"})
    add(ledger, "ml-1", MIDNIGHT - 4 * 86400, 1, gpus=8, gpu_type="H100", tags={"team": "ml"}, attempt=1)
    add(ledger, "cv-1", MIDNIGHT - 3 * 86400, 4, user="bo", tags={"team": "cv"})
    add(ledger, "adhoc", MIDNIGHT - 2 * 86400, 1, user="bo")
    add(ledger, "night", MIDNIGHT - 3600, 2, gpus=2, tags={"team": "cv"})  # runs across midnight
    add(ledger, "ancient", MIDNIGHT - 90 * 86400, 100, gpus=8, gpu_type="H100", tags={"team": "ml"})
    return ledger


def test_usage_by_team_over_30_days(ledger):
    rows = {r["team"]: r for r in usage_table(ledger, since="30d", by="team").to_pylist()}
    assert set(rows) == {"ml", "cv", "(untagged)"}
    assert rows["ml"]["gpu_hours"] == pytest.approx(24.0) and rows["ml"]["cost_usd"] == pytest.approx(144.0)
    assert rows["ml"]["jobs"] == 1 and rows["ml"]["attempts"] == 2 and rows["ml"]["gpus_max"] == 8
    assert rows["cv"]["gpu_hours"] == pytest.approx(8.0) and rows["cv"]["jobs"] == 2
    assert rows["(untagged)"]["gpu_hours"] == pytest.approx(1.0)
    first = usage_table(ledger, since="30d", by="team").to_pylist()[0]
    assert first["team"] == "ml"  # largest first


def test_several_keys_and_all_time(ledger):
    table = usage_table(ledger, since=None, by="user,gpu_type").to_pylist()
    by_key = {(r["user"], r["gpu_type"]): r["gpu_hours"] for r in table}
    assert by_key == pytest.approx({("ana", "H100"): 824.0, ("bo", "A10"): 5.0, ("ana", "A10"): 4.0})


def test_days_split_an_attempt_that_runs_past_midnight(ledger):
    rows = usage_table(ledger, since="30d", by="day").to_pylist()
    today = dt.datetime.fromtimestamp(MIDNIGHT, dt.timezone.utc).date()
    per_day = {r["day"]: r["gpu_hours"] for r in rows}
    assert per_day[str(today)] == pytest.approx(2.0)
    assert per_day[str(today - dt.timedelta(days=1))] == pytest.approx(2.0)
    assert sum(per_day.values()) == pytest.approx(33.0)  # the same total as any other grouping
    assert [r["day"] for r in rows] == sorted(r["day"] for r in rows)


def test_a_window_edge_clips_attempts(ledger):
    since = dt.datetime.fromtimestamp(MIDNIGHT, dt.timezone.utc).isoformat()
    rows = usage_table(ledger, since=since, by="team").to_pylist()
    assert [(r["team"], r["gpu_hours"]) for r in rows] == [("cv", pytest.approx(2.0))]


def test_the_rich_table_has_a_total_line(ledger):
    buffer = io.StringIO()
    render_usage_table(usage_table(ledger, since="30d", by="team"), console=Console(file=buffer, width=120))
    text = buffer.getvalue()
    assert "GPU-hours" in text and "$153.00" in text and "33.00" in text and "total" in text


def test_an_empty_window_says_so(tmp_path):
    buffer = io.StringIO()
    table = usage_table(UsageLedger(str(tmp_path / "none")), since="1d", by="team,day")
    assert table.num_rows == 0 and str(table.schema.field("team").type) == "string"
    render_usage_table(table, console=Console(file=buffer))
    assert "no usage recorded" in buffer.getvalue()


def test_the_chart_is_a_png(ledger, tmp_path):
    path = plot_usage(tmp_path / "usage.png", ledger, since="30d", by="team")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.parametrize("value", ["yesterday", "-3d", "2026-13-45"])
def test_bad_windows_are_refused(value):
    with pytest.raises(ConfigurationError, match="neither a duration"):
        parse_since(value)


def test_windows_from_durations_and_dates():
    assert parse_since("2d", now=1_000_000.0) == 1_000_000.0 - 2 * 86400
    assert parse_since("2026-01-31") == dt.datetime(2026, 1, 31, tzinfo=dt.timezone.utc).timestamp()
    assert parse_since(None) is None
