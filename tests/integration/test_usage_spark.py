"""The ledger as a Spark DataFrame through a real Spark Connect session."""

import time

import pytest

from sparkgpu.usage.ledger import UsageLedger, UsageRecord
from sparkgpu.usage.rates import RateCard
from sparkgpu.usage.report import usage_dataframe

pytestmark = [pytest.mark.integration, pytest.mark.spark]


def test_usage_dataframe_rows_and_groups(spark, tmp_path):
    ledger = UsageLedger(str(tmp_path / "ledger"))
    now = time.time()
    for job_id, team, gpus in (("a", "ml", 8), ("b", "ml", 2), ("c", "cv", 1)):
        ledger.append(
            [
                UsageRecord.priced(
                    job_id=job_id,
                    job_name=job_id,
                    attempt=0,
                    user="ana",
                    tags={"team": team},
                    backend="local",
                    gpu_type="H100",
                    gpus=gpus,
                    simulated=False,
                    status="succeeded",
                    started_at=now - 7200,
                    ended_at=now - 3600,
                    rates=RateCard({"H100": 5.0}),
                )
            ]
        )

    rows = usage_dataframe(spark, since="1d", ledger=ledger)
    assert rows.count() == 3
    # Tags stay a map, so Spark SQL can attribute cost by any tag.
    by_team = {
        r["team"]: r["gpu_hours"]
        for r in rows.selectExpr("tags['team'] AS team", "gpu_seconds / 3600 AS gpu_hours")
        .groupBy("team")
        .sum("gpu_hours")
        .withColumnRenamed("sum(gpu_hours)", "gpu_hours")
        .collect()
    }
    assert by_team == {"ml": pytest.approx(10.0), "cv": pytest.approx(1.0)}
    assert dict(rows.schema["started_at"].jsonValue())["type"] == "timestamp"

    grouped = {
        r["team"]: (r["gpu_hours"], r["cost_usd"])
        for r in usage_dataframe(spark, since="1d", by="team", ledger=ledger).collect()
    }
    assert grouped == {"ml": (pytest.approx(10.0), pytest.approx(50.0)), "cv": (pytest.approx(1.0), pytest.approx(5.0))}
