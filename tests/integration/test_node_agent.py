"""The node agent and the rank bootstrap on real processes: rendezvous limits, environment reports."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pytest

from sparkgpu import distributed, runtime
from sparkgpu.config import settings
from sparkgpu.launch.node.agent import build_command
from sparkgpu.launch.backends.local.backend import free_port
from sparkgpu.rundir.keyring import new_key
from sparkgpu.rundir.serialization import client_sys_path, serialize_payload
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout

pytestmark = pytest.mark.integration


@distributed(gpus=1, gpu_type="cpu")
def one():
    return 1


def test_a_missing_node_fails_the_rendezvous_after_the_jobs_init_timeout():
    prepared = one.prepare((), {})
    job = dataclasses.replace(prepared.job, policy=dataclasses.replace(prepared.job.policy, init_timeout=3))
    rd = RunDir(settings().staging_root / job.job_id)
    key = new_key()
    rd.create(job.to_dict(), serialize_payload(one.fn, (), {}, []), key, client_sys_path())
    rd.prepare_attempt(0)
    # Node 0 of two; node 1 never comes. torch's default would wait 600 s for it.
    command = build_command(
        sys.executable,
        str(rd.path),
        attempt=0,
        nnodes=2,
        node_rank=0,
        nproc=1,
        master_addr="127.0.0.1",
        master_port=free_port(),
        shutdown_grace=1,
    )
    started = time.monotonic()
    done = subprocess.run(command, input=key.hex() + "\n", capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and time.monotonic() - started < 90
    assert "node 0 of 2 gave up meeting the others" in done.stderr and "init_timeout of 3s" in done.stderr
    node_exit = RunDir(rd.path, key=key).read_control_json(rd.file(RunLayout.node_exits(0, 0)))
    files = sorted(str(p.relative_to(rd.path)) for p in rd.file(RunLayout.attempt(0)).rglob("*"))
    assert node_exit is not None, (
        f"no genuine node exit file; the attempt holds {files}; the agent said:\n{done.stderr}"
    )
    assert node_exit["status"] == 1  # the other nodes stop too


@distributed(gpus=2, gpu_type="cpu", ship_environment=True, log_ranks="all")
def shipped_rank():
    return runtime.get_global_rank()


def test_each_rank_reports_what_rehydrating_its_environment_cost(workers_share_this_image, capsys):
    assert shipped_rank.distributed() == [0, 1]
    rd = RunDir(settings().staging_root / shipped_rank.last_job_id)
    reports = rd.read_env_reports(0)
    assert sorted(reports) == [0, 1]
    for report in reports.values():
        assert set(report["steps"]) == {"check", "extract", "view"} and report["seconds"] > 0
        assert report["extracted"] or report["cached"]  # the caller's code travels at least
    # The ranks share the node's cache: what one extracted, the other found there. Forked from the
    # agent (which rehydrates before it forks them), the node's first rank reports the agent's work.
    assert sum(r["fetched_bytes"] for r in reports.values()) > 0
    for rank in (0, 1):
        assert "sparkgpu: environment rehydrated in" in rd.file(RunLayout.rank_log(0, rank)).read_text()
    out = capsys.readouterr().out
    assert "[rank0] sparkgpu: environment rehydrated in" in out and " extracted, " in out
