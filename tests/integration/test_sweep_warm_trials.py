"""A local sweep's trials fork their ranks from the warm pool: torch is imported once for the
whole sweep, not once per trial's rank."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.integration

optuna = pytest.importorskip("optuna")


def _parent_of_this_rank(lr: float = 0.1):
    from sparkgpu import runtime

    runtime.report(0, lr)
    parent = os.getppid()
    with open(f"/proc/{parent}/cmdline") as f:
        return {"value": lr, "parent": parent, "parent_cmdline": f.read().replace("\0", " ")}


def test_every_local_trial_forks_its_ranks_from_one_warm_pool():
    import sparkgpu
    from sparkgpu import attach
    from sparkgpu.config import settings

    result = sparkgpu.sweep(
        _parent_of_this_rank,
        space={"lr": optuna.distributions.FloatDistribution(0.01, 1.0)},
        direction="minimize",
        n_trials=3,
        max_concurrent=1,
        gpus=2,
        gpu_type="cpu",
    )
    assert [t.state.name for t in result.study.trials] == ["COMPLETE"] * 3
    jobs = [t.user_attrs["sparkgpu.job_id"] for t in result.study.trials]
    specs = [json.loads((settings().staging_root / job / "spec.json").read_text()) for job in jobs]
    assert [spec["backend"] for spec in specs] == ["warm_pool"] * 3
    ranks = [rank for job in jobs for rank in attach(job).result(timeout=60)]
    assert len({rank["parent"] for rank in ranks}) == 1, ranks  # one zygote forked all six ranks
    assert "sparkgpu.launch.backends.local.zygote" in ranks[0]["parent_cmdline"]
