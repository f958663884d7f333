"""SPARKGPU_KEEP_RUNS: which run dirs a new job prunes, and which it never touches."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest

from sparkgpu._util.process import ProcessRef
from sparkgpu.config import reset_settings, settings
from sparkgpu.errors import ConfigurationError
from sparkgpu.launch.client.retention import prune_runs

DAY = 86400.0
NOW = time.time()


def make_run(status: str | None, age_days: float, client: dict | None = None) -> str:
    created = NOW - age_days * DAY
    job_id = f"job-{status}-{age_days:g}d-{int(created * 1000) % 100000}"
    run_dir = settings().staging_root / job_id
    run_dir.mkdir(parents=True)
    (run_dir / "spec.json").write_text(json.dumps({"job_id": job_id}))
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "step-1.bin").write_bytes(b"x" * 1000)
    if status is not None:
        (run_dir / "state.json").write_text(json.dumps({"status": status, "created_at": created, "client": client}))
    keys = settings().home / "keys"
    keys.mkdir(parents=True, exist_ok=True)
    (keys / job_id).write_text("00")
    return job_id


def remaining() -> set[str]:
    return {p.parent.name for p in settings().staging_root.glob("*/spec.json")}


def this_client() -> dict:
    return ProcessRef.current().record()


def dead_client() -> dict:
    return {**ProcessRef.current().record(), "pid": 2**22 + 12345, "pid_started": "1"}


def test_finished_jobs_beyond_the_count_go_with_their_keys_newest_kept():
    jobs = [make_run("succeeded", age) for age in (0.1, 0.2, 0.3, 0.4)]
    config = dataclasses.replace(settings(), keep_runs=2, keep_runs_days=None)
    removed = prune_runs(config, now=NOW, wait=True)
    assert sorted(removed) == sorted(jobs[2:])
    assert remaining() == set(jobs[:2])
    assert not list(settings().staging_root.glob(".*")), "hidden half-removed run dirs were left"
    assert sorted(p.name for p in (settings().home / "keys").iterdir()) == sorted(jobs[:2])


def test_jobs_that_may_continue_are_never_pruned_by_count_and_a_live_client_keeps_its_job_forever():
    live = make_run("running", 400, client=this_client())
    lost_recent = make_run("running", 1, client=dead_client())
    lost_old = make_run("running", 40, client=dead_client())
    stopped_old = make_run("stopped", 40)
    failed_old = make_run("failed", 40)
    staged_recent = make_run(None, 0.5)
    newest = make_run("succeeded", 0.01)
    config = dataclasses.replace(settings(), keep_runs=1, keep_runs_days=30)
    removed = prune_runs(config, now=NOW, wait=True)
    assert sorted(removed) == sorted([lost_old, stopped_old, failed_old])
    assert remaining() == {live, lost_recent, staged_recent, newest}


def test_the_job_being_launched_is_kept_and_all_keeps_everything():
    jobs = [make_run("cancelled", age) for age in (50, 60)]
    keep_all = dataclasses.replace(settings(), keep_runs=None, keep_runs_days=None)
    assert prune_runs(keep_all, now=NOW, wait=True) == []
    config = dataclasses.replace(settings(), keep_runs=0, keep_runs_days=30)
    assert prune_runs(config, keep=jobs[0], now=NOW, wait=True) == [jobs[1]]
    assert remaining() == {jobs[0]}


def test_a_half_removed_run_dir_left_by_an_exiting_process_goes_with_the_next_prune():
    job = make_run("succeeded", 1)
    hidden = settings().staging_root / f".{job}.removing"
    (settings().staging_root / job).rename(hidden)
    prune_runs(now=NOW, wait=True)
    assert not hidden.exists()


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("100,30d", (100, 30.0)),
        ("all", (None, None)),
        ("5", (5, None)),
        ("7d", (None, 7.0)),
        (" 3 , 2d ", (3, 2.0)),
    ],
)
def test_keep_runs_setting(monkeypatch, raw, expected):
    monkeypatch.setenv("SPARKGPU_KEEP_RUNS", raw)
    reset_settings()
    assert (settings().keep_runs, settings().keep_runs_days) == expected


def test_a_bad_keep_runs_setting_names_the_forms_it_takes(monkeypatch):
    monkeypatch.setenv("SPARKGPU_KEEP_RUNS", "lots")
    reset_settings()
    with pytest.raises(ConfigurationError, match=r"100,30d"):
        settings()


def test_a_failed_job_with_checkpoints_is_kept_by_count_but_one_without_goes(capsys):
    resumable = make_run("failed", 1)  # `sparkgpu resume` continues it from step-1
    nothing_to_resume = make_run("cancelled", 2)
    (settings().staging_root / nothing_to_resume / "checkpoints" / "step-1.bin").unlink()
    newest = make_run("succeeded", 0.1)
    config = dataclasses.replace(settings(), keep_runs=1, keep_runs_days=30)
    assert prune_runs(config, now=NOW, wait=True) == [nothing_to_resume]
    assert remaining() == {resumable, newest}
    assert (
        f"removing 1 of your old run dirs under {settings().staging_root} (SPARKGPU_KEEP_RUNS): {nothing_to_resume}"
        in (capsys.readouterr().err)
    )


def test_a_shared_root_loses_no_other_users_job_and_counts_only_yours():
    mine = [make_run("succeeded", age) for age in (0.1, 0.2)]
    other_user = make_run("succeeded", 0.05)
    os.chown(settings().staging_root / other_user, 54321, 54321)  # another OS user's run dir
    same_user_other_keyring = make_run("succeeded", 0.06)  # a colleague under a shared account
    (settings().home / "keys" / same_user_other_keyring).unlink()
    ancient_other = make_run("succeeded", 400)
    os.chown(settings().staging_root / ancient_other, 54321, 54321)
    config = dataclasses.replace(settings(), keep_runs=1, keep_runs_days=30)
    assert prune_runs(config, now=NOW, wait=True) == [mine[1]]  # the others neither count nor go
    assert remaining() == {mine[0], other_user, same_user_other_keyring, ancient_other}


def test_the_store_copy_goes_from_the_prefix_the_job_was_staged_under(tmp_path):
    store = tmp_path / "store"
    staged, legacy = make_run("succeeded", 0.3), make_run("succeeded", 0.4)
    (settings().staging_root / staged / "staging-prefix").write_text(f"{store.as_uri()}/ana")
    for folder in (store / "ana" / staged, store / legacy, store / "bob" / legacy):
        folder.mkdir(parents=True)
        (folder / "payload.sig").write_bytes(b"s")
    config = dataclasses.replace(settings(), keep_runs=0, keep_runs_days=None, staging_url=store.as_uri())
    assert sorted(prune_runs(config, now=NOW, wait=True)) == sorted([staged, legacy])
    assert not (store / "ana" / staged).exists()  # the recorded prefix
    assert not (store / legacy).exists()  # staged before prefixes: at the root
    assert (store / "bob" / legacy).exists()  # another user's prefix is not searched
