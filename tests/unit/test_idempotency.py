"""Idempotency keys: of many submissions racing with one key, exactly one job holds it."""

from __future__ import annotations

import threading

import pytest

from sparkgpu.config import settings
from sparkgpu.errors import ConfigurationError
from sparkgpu.launch.client.idempotency import claim_key, claimed_job


def _run_dir(job_id: str) -> None:
    (settings().staging_root / job_id).mkdir(parents=True)


def test_of_many_racing_claims_exactly_one_wins_and_every_claimer_learns_which():
    ids = [f"job-{i}" for i in range(16)]
    for job_id in ids:
        _run_dir(job_id)
    start, answers = threading.Barrier(len(ids)), {}

    def claim(job_id: str) -> None:
        start.wait()
        answers[job_id] = claim_key("nightly", job_id)

    threads = [threading.Thread(target=claim, args=(job_id,)) for job_id in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == len(ids)
    (winner,) = set(answers.values())
    assert answers[winner] == winner and claimed_job("nightly") == winner


def test_a_claim_whose_job_is_gone_no_longer_holds_and_keys_are_private():
    _run_dir("first")
    assert claim_key("k", "first") == "first"
    assert claimed_job("other key") is None
    (settings().staging_root / "first").rmdir()  # pruned, or removed by hand
    assert claimed_job("k") is None
    _run_dir("second")
    assert claim_key("k", "second") == "second"
    folder = settings().home / "idempotency"
    assert folder.stat().st_mode & 0o077 == 0
    assert all(p.stat().st_mode & 0o077 == 0 for p in folder.iterdir())
    assert not any("k" == p.name for p in folder.iterdir())  # stored hashed, not as given


@pytest.mark.parametrize("key", ["", "   ", 7, None])
def test_a_key_that_is_no_string_is_refused_naming_the_option(key):
    with pytest.raises(ConfigurationError, match="idempotency_key"):
        claimed_job(key)
