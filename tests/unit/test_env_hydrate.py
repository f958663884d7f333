"""Rehydration on a worker: the cache, the merged view, skips, checks, and refusals."""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import os
import sys
import tarfile
from pathlib import Path

import pytest

from sparkgpu.env import (
    HydrationError,
    WorkerEnvironmentMismatchError,
    activate,
    hydrate_environment,
    snapshot_environment,
    stage_snapshot,
)
from tests.unit.test_env_support import write_dist

WORKER = {"python": sys.version.split()[0], "platform": "linux-x86_64", "torch": None, "torch_cuda": None}


@pytest.fixture
def staged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job_helpers.py").write_text("HELP = 'me'\n")
    site = tmp_path / "site-packages"
    write_dist(
        site,
        "alpha",
        "1.0",
        {
            "alpha/__init__.py": "X = 1\n",
            "alpha/tool.sh": "#!/bin/sh\n",
            "alpha-extra.pth": "alpha_extra_dir\n",
            "alpha_extra_dir/extra_mod.py": "",
        },
    )
    os.chmod(site / "alpha" / "tool.sh", 0o755)
    write_dist(site, "nvidia-cublas", "12.1", {"nvidia/cublas/lib.so": b"\0\1", "nvidia/__init__.py": ""})
    write_dist(site, "nvidia-nccl", "2.2", {"nvidia/nccl/lib.so": b"\2\3", "nvidia/__init__.py": ""})
    return stage_snapshot(snapshot_environment(paths=[str(site)]), str(tmp_path / "store"))


def hashes(staged) -> dict[str, str]:
    return {e["name"]: e["hash"] for e in staged.manifest["entries"]}


def test_hydrate_builds_a_site_view_and_code_root(staged, tmp_path):
    overlay = hydrate_environment(staged.manifest, tmp_path / "cache", installed={}, worker=WORKER)
    code_root, view = overlay.paths
    assert overlay.view == view and Path(view).parent.name == "views"
    assert Path(code_root, "job_helpers.py").read_text() == "HELP = 'me'\n"
    assert next(importlib.metadata.distributions(name="alpha", path=[view])).version == "1.0"
    assert os.access(os.path.join(view, "alpha", "tool.sh"), os.X_OK)
    # nvidia/ is filled by two distributions: merged into one real folder of links
    assert not os.path.islink(os.path.join(view, "nvidia"))
    assert sorted(os.listdir(os.path.join(view, "nvidia"))) == ["__init__.py", "cublas", "nccl"]
    for name, digest in hashes(staged).items():
        assert (tmp_path / "cache" / "env" / digest).is_dir(), name
    assert sorted(overlay.report.extracted) == ["alpha", "code", "nvidia-cublas", "nvidia-nccl"]
    assert overlay.report.fetched_bytes == sum(e["tar_bytes"] for e in staged.manifest["entries"])


def test_second_hydration_uses_the_cache(staged, tmp_path):
    first = hydrate_environment(staged.manifest, tmp_path / "cache", installed={}, worker=WORKER)
    again = hydrate_environment(
        staged.manifest, tmp_path / "cache", installed={}, worker=WORKER, store_url=str(tmp_path / "gone")
    )  # nothing is fetched
    assert again.paths == first.paths and again.report.extracted == [] and again.report.fetched_bytes == 0
    assert sorted(again.report.cached) == ["alpha", "code", "nvidia-cublas", "nvidia-nccl"]


def test_what_the_worker_has_at_the_same_version_is_skipped(staged, tmp_path):
    overlay = hydrate_environment(
        staged.manifest,
        tmp_path / "cache",
        worker=WORKER,
        installed={"alpha": "0.9", "nvidia-cublas": "12.1", "code": "0"},
    )
    assert overlay.report.skipped == {"nvidia-cublas": "the worker has nvidia-cublas==12.1"}
    assert sorted(overlay.report.extracted) == ["alpha", "code", "nvidia-nccl"]  # another version: shipped
    assert os.path.exists(os.path.join(overlay.view, "alpha", "__init__.py"))
    assert not os.path.exists(os.path.join(overlay.view, "nvidia", "cublas"))


def test_workers_gpu_stack_is_never_shadowed(staged, tmp_path):
    overlay = hydrate_environment(staged.manifest, tmp_path / "cache", worker=WORKER, installed={"nvidia-nccl": "2.1"})
    assert overlay.report.skipped == {"nvidia-nccl": "the worker's own GPU stack is used (nvidia-nccl==2.1)"}
    assert os.path.exists(os.path.join(overlay.view, "nvidia", "cublas"))
    assert not os.path.exists(os.path.join(overlay.view, "nvidia", "nccl"))


def test_version_mismatch_is_reported_before_anything_is_fetched(staged, tmp_path):
    manifest = json.loads(json.dumps(staged.manifest))
    manifest["client"].update(python="3.10.14", torch="2.13.0", torch_cuda="12.6")
    worker = dict(WORKER, torch="2.14.1", torch_cuda="13.0")
    with pytest.raises(WorkerEnvironmentMismatchError) as err:
        hydrate_environment(manifest, tmp_path / "cache", installed={}, worker=worker)
    message = str(err.value)
    assert "Python 3.10.14" in message and f"Python {WORKER['python']}" in message
    assert "torch 2.13.0 (CUDA 12.6)" in message and "torch 2.14.1 (CUDA 13.0)" in message
    assert not (tmp_path / "cache").exists()


def test_real_torch_of_this_interpreter_is_compared(staged, tmp_path):
    """With nothing injected, the worker's own torch (here: the test environment's) is read."""
    torch_version = importlib.metadata.version("torch")
    manifest = json.loads(json.dumps(staged.manifest))
    manifest["client"]["torch"] = "1.13.1"
    with pytest.raises(WorkerEnvironmentMismatchError, match=f"torch 1.13.1.*torch {torch_version}"):
        hydrate_environment(manifest, tmp_path / "cache")


def test_platform_mismatch_names_the_native_distributions(staged, tmp_path):
    manifest = json.loads(json.dumps(staged.manifest))
    manifest["client"]["platform"] = "macosx-14.0-arm64"
    for entry in manifest["entries"]:
        entry["pure"] = entry["name"] != "nvidia-nccl"
    with pytest.raises(WorkerEnvironmentMismatchError, match="compiled for the client: nvidia-nccl"):
        hydrate_environment(manifest, tmp_path / "cache", installed={}, worker=WORKER)


def test_tampered_blob_is_refused_and_never_cached(staged, tmp_path):
    entry = next(e for e in staged.manifest["entries"] if e["name"] == "alpha")
    blob = tmp_path / "store" / entry["object"]
    data = bytearray(blob.read_bytes())
    data[data.index(b"X = 1")] = ord("Y")
    blob.write_bytes(bytes(data))
    with pytest.raises(HydrationError, match="alpha: the blob .* does not match its hash"):
        hydrate_environment(staged.manifest, tmp_path / "cache", installed={}, worker=WORKER)
    env = tmp_path / "cache" / "env"
    assert not (env / entry["hash"]).exists() and not any(
        p.name.startswith(entry["hash"]) for p in (env / ".tmp").iterdir()
    )


def test_missing_blob_says_to_stage_again(staged, tmp_path):
    entry = next(e for e in staged.manifest["entries"] if e["name"] == "alpha")
    (tmp_path / "store" / entry["object"]).unlink()
    with pytest.raises(
        HydrationError, match="alpha .* is missing from the environment store .* stage the environment again"
    ):
        hydrate_environment(staged.manifest, tmp_path / "cache", installed={}, worker=WORKER)


def evil_manifest(tmp_path, name: str) -> dict:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    digest = hashlib.sha256(buf.getvalue()).hexdigest()
    (tmp_path / "store" / "blobs").mkdir(parents=True, exist_ok=True)
    (tmp_path / "store" / "blobs" / f"{digest}.tar").write_bytes(buf.getvalue())
    return {
        "format": 1,
        "store": str(tmp_path / "store"),
        "client": {},
        "entries": [
            {
                "name": "evil",
                "version": "1",
                "kind": "site",
                "hash": digest,
                "object": f"blobs/{digest}.tar",
                "pure": True,
            }
        ],
    }


@pytest.mark.parametrize("member", ["site/../../escaped.py", "/abs/escaped.py", "elsewhere/escaped.py"])
def test_blob_members_outside_the_overlay_are_refused(tmp_path, member):
    with pytest.raises(HydrationError, match="refusing blob member"):
        hydrate_environment(evil_manifest(tmp_path, member), tmp_path / "cache", installed={}, worker=WORKER)
    assert not list(tmp_path.rglob("escaped.py"))


def test_unknown_manifest_format_says_what_to_do(tmp_path):
    with pytest.raises(HydrationError, match="use the same sparkgpu version on the client and the workers"):
        hydrate_environment({"format": 99}, tmp_path / "cache")


def test_leftovers_of_a_rank_that_died_mid_extraction_are_cleaned(staged, tmp_path):
    digest = hashes(staged)["alpha"]
    stale = tmp_path / "cache" / "env" / ".tmp" / f"{digest}.424242"
    stale.mkdir(parents=True)
    (stale / "half-written").write_text("x")
    hydrate_environment(staged.manifest, tmp_path / "cache", installed={}, worker=WORKER)
    assert not stale.exists() and (tmp_path / "cache" / "env" / digest / "site" / "alpha").is_dir()


def test_activate_puts_the_overlay_first_and_exports_it(staged, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    overlay = hydrate_environment(staged.manifest, tmp_path / "cache", installed={}, worker=WORKER)
    environ = {"PYTHONPATH": "/somewhere/else"}
    assert activate(overlay, environ) == overlay.paths
    assert sys.path[: len(overlay.paths)] == overlay.paths
    assert os.path.join(overlay.view, "alpha_extra_dir") in sys.path  # the shipped .pth file took effect
    assert environ["PYTHONPATH"] == os.pathsep.join(overlay.paths + ["/somewhere/else"])
    activate(overlay, environ)  # idempotent
    assert environ["PYTHONPATH"].split(os.pathsep).count(overlay.view) == 1


def test_the_report_is_saved_whole_and_summarised_in_the_rank_log(staged, tmp_path):
    from sparkgpu.env.hydrate import record_report

    report = hydrate_environment(staged.manifest, tmp_path / "cache", installed={"alpha": "1.0"}, worker=WORKER).report
    attempt = tmp_path / "run" / "attempts" / "0"
    log = attempt / "logs" / "rank-1.log"
    log.parent.mkdir(parents=True)
    log.write_text("earlier line\n")
    record_report(report, str(attempt / "env-rank-1.json"), str(log))
    saved = json.loads((attempt / "env-rank-1.json").read_text())
    assert (
        saved == report.to_dict() and saved["fetched_bytes"] > 0 and set(saved["steps"]) == {"check", "extract", "view"}
    )
    assert sorted(os.listdir(attempt)) == ["env-rank-1.json", "logs"]  # no temporary file left
    earlier, summary = log.read_text().splitlines()
    assert earlier == "earlier line" and summary.startswith("sparkgpu: environment rehydrated in ")
    assert "3 extracted, 0 cached, 1 skipped" in summary and "KB" in summary and "extract " in summary
