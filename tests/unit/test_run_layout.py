"""One run-dir layout: the generated entrypoint, RunDir and the staging mirror agree on every name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sparkgpu.config import reset_settings
from sparkgpu.errors import ConfigurationError
from sparkgpu.rundir.key_handover import KEY_DIR_ENV, hand_to_ranks
from sparkgpu.rundir.serialization import serialize_payload
from sparkgpu.rundir.states import RankExit
from sparkgpu.launch.client.resume import find_run_dir
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout

KEY = b"k" * 32

# Stands in for the shipped environment's rehydration: it records the report where the
# entrypoint says, as the real module does, then ends the rank before any training.
_HYDRATE_STUB = b"""
import json, os, sys, types

def default_cache_dir():
    return os.path.join(os.path.expanduser("~"), ".cache", "sparkgpu")

def hydrate(env, cache):
    return types.SimpleNamespace(report={"seconds": 1.5, "env": env})

def activate(overlay):
    pass

def record_report(report, report_path, log_path):
    os.makedirs(os.path.dirname(report_path), exist_ok=True)
    with open(report_path, "w") as f:
        json.dump(report, f)
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "a") as f:
        f.write("sparkgpu: environment ready\\n")
    sys.exit(0)
"""


def _noop():
    return None


def test_the_entrypoint_records_the_environment_report_where_the_client_reads_it(tmp_path):
    rd = RunDir(tmp_path / "job-layout")
    rd.create(
        {"job_id": "job-layout", "env": {"name": "e1"}},
        serialize_payload(_noop, (), {}, []),
        KEY,
        [],
        extra_files={RunLayout.HYDRATE: _HYDRATE_STUB},
    )
    env = {**os.environ, KEY_DIR_ENV: str(hand_to_ranks(KEY, 1)), "SPARKGPU_ATTEMPT": "2", "RANK": "5"}
    done = subprocess.run([sys.executable, str(rd.air)], env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert rd.read_env_reports(2) == {5: {"seconds": 1.5, "env": {"name": "e1"}}}
    assert rd.log_tail(2, 5) == "sparkgpu: environment ready"


def test_a_run_dir_reads_only_the_files_the_layout_names(tmp_path):
    rd = RunDir(tmp_path / "job-1", key=KEY)
    rd.prepare_attempt(0)
    for node in (0, 1):
        rd.write_control(
            rd.file(RunLayout.node_exits(0, node)),
            json.dumps({"failures": {str(node): {"exitcode": node + 1}}}).encode(),
        )
    rd.file(RunLayout.env_report(0, 3)).write_text('{"seconds": 2}')
    # Temporaries of killed writers and files of other kinds sit beside them.
    (rd.file(RunLayout.attempt(0)) / ".node-2.json.5f3a.tmp").write_text("{")
    (rd.file(RunLayout.attempt(0)) / "env-rank-9.json.77.tmp").write_text("{")
    rd.file(RunLayout.report(0)).write_text("{}")
    assert rd.read_node_exits(0) == {0: RankExit(1), 1: RankExit(2)}
    assert rd.read_env_reports(0) == {3: {"seconds": 2}}
    assert rd.read_env_reports(7) == {} and rd.read_node_exits(7) == {}  # an attempt that never ran


def test_the_files_a_node_needs_and_the_files_the_client_controls():
    spec = {"signed_files": ["_hydrate.py", "code.tar"]}
    assert RunLayout.payload_files(spec) == [
        "_air.py",
        "spec.json",
        "payload.pkl",
        "payload.sig",
        "_hydrate.py",
        "code.tar",
    ]
    control = RunLayout.control_files(4)
    assert control == (
        "attempts/4/STOP",
        "attempts/4/spark/CANCEL",
        "attempts/4/spark/client.heartbeat",
        "attempts/4/spark/DUMP",
    )
    assert RunLayout.is_node_end_marker(RunLayout.node_marker(4, 1, "ended"))
    assert not RunLayout.is_node_end_marker(RunLayout.node_marker(4, 1, "started"))
    assert RunLayout.is_node_exits(RunLayout.node_exits(4, 12)) and not RunLayout.is_node_exits(control[0])


def test_spark_node_markers_are_read_by_node_and_kind(tmp_path):
    rd = RunDir(tmp_path / "job-1", key=KEY)
    rd.file(RunLayout.spark(2)).mkdir(parents=True)
    for node in (0, 1, 3):
        assert rd.create_control(rd.file(RunLayout.node_marker(2, node, "started")), b"{}")
        rd.write_control(rd.file(RunLayout.spark(2)) / "state", b"{}")  # node 0's state: no node's marker
    rd.write_control(rd.file(RunLayout.node_marker(2, 1, "ended")), b"{}")
    # not sealed: a writer of the run dir without the key
    rd.file(RunLayout.node_marker(2, 3, "ended")).write_text("{}")
    (rd.file(RunLayout.spark(2)) / ".node-0.ended.1a2b.tmp").write_text("{")  # a writer killed mid-write
    (rd.file(RunLayout.spark(2)) / "node-x.started").write_text("{}")  # not a node's marker
    assert list(rd.node_markers(2, "started")) == [0, 1, 3]
    assert list(rd.node_markers(2, "ended")) == [1, 3]
    assert rd.nodes_without_end(2) == [0, 3]  # node 3's forged end hides it from no one
    assert rd.nodes_without_end(5) == []  # an attempt that never reached Spark


def test_a_job_is_found_by_its_id_or_a_unique_prefix(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKGPU_STAGING_ROOT", str(tmp_path))
    reset_settings()  # the autouse home fixture resets them again after the test
    for job_id in ("train-20261124-aa11", "train-20261124-ab22", "eval-1"):
        (tmp_path / job_id).mkdir()
        (tmp_path / job_id / RunLayout.SPEC).write_text("{}")
    assert find_run_dir("eval-1").job_id == "eval-1"
    assert find_run_dir("train-20261124-ab").job_id == "train-20261124-ab22"
    with pytest.raises(ConfigurationError, match="matches 2 jobs"):
        find_run_dir("train-")
    with pytest.raises(ConfigurationError, match="no job 'nope'"):
        find_run_dir("nope")


def test_a_ranks_fatal_error_dump_keeps_its_last_words_and_the_crashing_threads_stack_in_the_log_tail(tmp_path):
    # What Python's fatal-error handler writes at a segfault in a rank that runs service threads.
    rd = RunDir(tmp_path / "job-1", key=KEY)
    rd.prepare_attempt(0)
    others = [
        line
        for n in range(3)
        for line in (
            f"Thread 0x00007f78e1214{n}c0 (most recent call first):",
            '  File "threading.py", line 331 in wait',
            "",
        )
    ]
    log = [f"step {i}" for i in range(30)] + ["about to read address 0", "Fatal Python error: Segmentation fault", ""]
    log += others + ["Current thread 0x00007f799f651b80 (most recent call first):"]
    log += ['  File "ctypes/__init__.py", line 519 in string_at', '  File "train.py", line 142 in crash', ""]
    log += ["Extension modules: numpy.core._multiarray_umath, torch._C (total: 2)"]
    rd.file(RunLayout.rank_log(0, 1)).parent.mkdir(parents=True, exist_ok=True)
    rd.file(RunLayout.rank_log(0, 1)).write_text("\n".join(log) + "\n")
    tail = rd.log_tail(0, 1).splitlines()
    assert (
        len(tail) <= 20 and tail[tail.index("Fatal Python error: Segmentation fault") - 1] == "about to read address 0"
    )
    assert '  File "train.py", line 142 in crash' in tail and not any("threading.py" in line for line in tail)
    assert tail[-1].startswith("Extension modules") and "step 29" in tail
    # Without a fatal dump, the tail is the last lines.
    rd.file(RunLayout.rank_log(0, 2)).write_text("\n".join(f"line {i}" for i in range(50)) + "\n")
    assert rd.log_tail(0, 2).splitlines() == [f"line {i}" for i in range(30, 50)]
