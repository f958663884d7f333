"""``spark.gpu.usage(...)``: the usage report as a DataFrame of a real Spark Connect session."""

from __future__ import annotations

import time

import pytest

from sparkgpu import ConfigurationError
from sparkgpu.config import settings
from sparkgpu.usage.ledger import UsageLedger, UsageRecord
from sparkgpu.usage.rates import RateCard

pytestmark = [pytest.mark.integration, pytest.mark.spark]

HOUR = 3600.0


@pytest.fixture
def gpu_spark(spark):
    from sparkgpu.api.spark_gpu import attach

    attach()
    return spark


def record(job_id, team, gpus, hours_ago, gpu_type="H100", hours=1.0):
    now = time.time()
    return UsageRecord.priced(
        job_id=job_id,
        job_name=job_id,
        attempt=0,
        user="ana",
        tags={"team": team} if team else {},
        backend="local",
        gpu_type=gpu_type,
        gpus=gpus,
        simulated=False,
        status="succeeded",
        started_at=now - hours_ago * HOUR,
        ended_at=now - (hours_ago - hours) * HOUR,
        rates=RateCard({"H100": 5.0, "A10": 1.0}),
    )


def test_usage_groups_the_default_ledger_by_team_over_the_last_30_days(gpu_spark):
    # The ledger every job writes to by default (SPARKGPU_USAGE_LEDGER, here the test's own home).
    UsageLedger(settings().usage_ledger_uri).append(
        [
            record("a", "ml", 8, 2),
            record("b", "ml", 2, 5),
            record("c", "cv", 1, 3, gpu_type="A10"),
            record("d", None, 4, 2),
            record("old", "ml", 8, 40 * 24),  # outside the default 30-day window
        ]
    )

    frame = gpu_spark.gpu.usage()
    assert type(frame).__name__ == "DataFrame" and type(frame).__module__.startswith("pyspark.sql")
    rows = {r["team"]: r.asDict() for r in frame.collect()}
    assert set(rows) == {"ml", "cv", "(untagged)"}
    assert rows["ml"]["gpu_hours"] == pytest.approx(10.0) and rows["ml"]["cost_usd"] == pytest.approx(50.0)
    assert rows["ml"]["jobs"] == 2 and rows["ml"]["gpus_max"] == 8
    assert rows["cv"]["cost_usd"] == pytest.approx(1.0)
    # A Spark DataFrame: it filters and joins like any other.
    assert frame.where("gpu_hours > 2").count() == 2

    everything = {r["team"]: r["gpu_hours"] for r in gpu_spark.gpu.usage(since=None).collect()}
    assert everything["ml"] == pytest.approx(18.0)


def test_usage_takes_the_report_arguments(gpu_spark, tmp_path):
    ledger = str(tmp_path / "ledger")
    UsageLedger(ledger).append([record("a", "ml", 8, 2), record("c", "cv", 1, 30, gpu_type="A10")])

    by_type = gpu_spark.gpu.usage(since="2d", until="1d", by="team,gpu_type", ledger=ledger).collect()
    assert [(r["team"], r["gpu_type"], r["gpu_hours"]) for r in by_type] == [("cv", "A10", pytest.approx(1.0))]

    attempts = gpu_spark.gpu.usage(since="1d", by=None, ledger=ledger)
    assert [(r["job_id"], r["tags"]["team"], r["gpus"]) for r in attempts.collect()] == [("a", "ml", 8)]


def test_usage_before_the_first_job_is_an_empty_frame(gpu_spark):
    frame = gpu_spark.gpu.usage(by="team")
    assert frame.count() == 0 and frame.columns[:2] == ["team", "jobs"]
    attempts = gpu_spark.gpu.usage(by=None)
    assert attempts.count() == 0 and dict(attempts.dtypes)["tags"] == "map<string,string>"


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"since": "last month"}, "since='last month' is neither a duration"),
        ({"by": "team,"}, "has an empty key"),
    ],
)
def test_bad_report_arguments_say_how_to_write_them(gpu_spark, arguments, message):
    with pytest.raises(ConfigurationError, match=message):
        gpu_spark.gpu.usage(**arguments)
