"""The staging store's mirror: a client run dir and a node's scratch run dir, two different
local folders that share nothing but a real ``file://`` store between them."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from sparkgpu import runtime
from sparkgpu.errors import PayloadSignatureError
from sparkgpu.launch.serialization import serialize_payload
from sparkgpu.launch.run_dir import RunDir
from sparkgpu.launch.staging import (
    ClientMirror,
    NodeMirror,
    StagingStore,
)
from sparkgpu.spec import JobSpec, Resources

KEY = b"k" * 32


def double(x):
    return 2 * x


@pytest.fixture
def sides(tmp_path):
    """``(client mirror, node mirror, store root)`` for node 0 of attempt 0 of a staged job."""
    job = JobSpec(job_id="job-1", name="double", resources=Resources(2, "cpu"), backend="spark")
    client_rd = RunDir(tmp_path / "client" / "runs" / "job-1")
    client_rd.create(
        job.to_dict(),
        serialize_payload(double, (21,), {}, []),
        KEY,
        [],
        extra_files={"_hydrate.py": b"# shipped beside the payload\n"},
    )
    client_rd.prepare_attempt(0)
    (client_rd.attempt_dir(0) / "spark").mkdir()
    url = (tmp_path / "store").as_uri()
    client = ClientMirror(client_rd, StagingStore(url, "job-1"))
    node_rd = RunDir(tmp_path / "executor" / "scratch" / "job-1")
    node = NodeMirror(StagingStore(url, "job-1"), node_rd, attempt=0, node=0, log_interval=0.0)
    return client, node, tmp_path / "store" / "job-1"


def test_the_payload_goes_up_once_and_comes_down_verified_into_the_nodes_own_dir(sides):
    client, node, store = sides
    spool = client.run_dir.path / "tracking"
    spool.mkdir()
    (spool / "run.json").write_text('{"run_id": "r1"}')
    client.upload_payload()
    node.download_payload()

    assert node.run_dir.path != client.run_dir.path
    files = node.run_dir.verify(KEY)  # the node runs only what the client signed
    assert set(files) == {"_air.py", "spec.json", "payload.pkl", "_hydrate.py"}
    assert json.loads((node.run_dir.path / "tracking" / "run.json").read_text()) == {"run_id": "r1"}

    # The store is not trusted: a payload changed there is refused on the node.
    (store / "payload.pkl").write_bytes(b"planted")
    node.download_payload()
    with pytest.raises(PayloadSignatureError):
        node.run_dir.verify(KEY)


def test_a_planted_file_name_never_leaves_the_nodes_run_dir(sides, tmp_path):
    client, node, store = sides
    client.upload_payload()
    spec = json.loads((store / "spec.json").read_text())
    (store / "spec.json").write_text(json.dumps({**spec, "signed_files": ["../../../outside.py"]}))

    with pytest.raises(ValueError, match="would leave the run dir"):
        node.download_payload()
    assert not list(tmp_path.rglob("outside.py"))


def test_a_growing_log_reaches_the_client_by_its_new_tail_only(sides):
    client, node, _ = sides
    log = node.run_dir.log_file(0, 1)
    log.parent.mkdir(parents=True)
    log.write_bytes(b"step 1\nstep")
    node.push()
    client.sync(0)
    local = client.run_dir.log_file(0, 1)
    assert local.read_bytes() == b"step 1\nstep"

    ranges = []
    read_bytes = client.store.read_bytes
    client.store.read_bytes = lambda rel, start, end: ranges.append((rel, start, end)) or read_bytes(rel, start, end)
    with open(log, "ab") as f:
        f.write(b" 2\nstep 3\n")
    node.push(final=True)  # an object store cannot append: the node puts the whole log again
    assert client.sync(0) == 1
    assert local.read_bytes() == b"step 1\nstep 2\nstep 3\n"
    assert ranges == [("attempts/0/logs/rank-1.log", 11, 21)]  # the client reads the new bytes only
    assert client.sync(0) == 0 and len(ranges) == 1  # nothing new: nothing read


def test_a_growing_log_is_put_again_at_most_every_log_interval_until_the_final_push(sides):
    client, node, store = sides
    node.log_interval = 3600.0
    log = node.run_dir.log_file(0, 0)
    log.parent.mkdir(parents=True)
    log.write_text("one\n")
    node.push()
    log.write_text("one\ntwo\n")
    node.push()
    assert (store / "attempts/0/logs/rank-0.log").read_text() == "one\n"  # throttled
    node.finish()
    assert (store / "attempts/0/logs/rank-0.log").read_text() == "one\ntwo\n"


def test_the_final_push_sends_results_and_errors_before_the_nodes_end_markers(sides):
    client, node, store = sides
    rd = node.run_dir
    rd.key = KEY
    rd.prepare_attempt(0)
    spark = rd.attempt_dir(0) / "spark"
    spark.mkdir()
    (spark / "node-0.started").write_text('{"node": 0}')
    node.push()
    assert (store / "attempts/0/spark/node-0.started").exists()  # the client bills from it: sent at once

    rd.write_result(0, 0, {"rank": 0})
    try:
        raise ValueError("shard 7 is corrupt")
    except ValueError as exc:
        rd.write_error(0, 1, exc)
    rd.log_file(0, 1).write_text("Traceback ...\n")
    rd.node_file(0, 0).write_text('{"node_rank": 0, "status": 1, "failures": {}}')
    (spark / "node-0.ended").write_text('{"state": "failed"}')
    uploads = []
    upload = node.store.upload
    node.store.upload = lambda path, rel: uploads.append(rel) or upload(path, rel)
    node.finish()

    assert uploads[-2:] == ["attempts/0/node-0.json", "attempts/0/spark/node-0.ended"]
    assert set(uploads[:-2]) == {
        "attempts/0/results/rank-0.pkl",
        "attempts/0/results/rank-1.error.pkl",
        "attempts/0/logs/rank-1.log",
    }
    client.sync(0)
    client_rd = client.run_dir
    client_rd.key = KEY
    assert client_rd.read_result(0, 0) == {"rank": 0}  # signed by the rank, checked on the client
    failure, exc = client_rd.read_error(0, 1)
    assert isinstance(exc, ValueError) and "shard 7 is corrupt" in failure.traceback
    assert json.loads((client_rd.attempt_dir(0) / "spark" / "node-0.ended").read_text()) == {"state": "failed"}


def test_the_end_marker_waits_for_the_final_push(sides):
    client, node, store = sides
    spark = node.run_dir.attempt_dir(0) / "spark"
    spark.mkdir(parents=True)
    (spark / "node-0.ended").write_text('{"state": "succeeded"}')
    node.push()
    assert not (store / "attempts/0/spark/node-0.ended").exists()
    node.finish()
    assert (store / "attempts/0/spark/node-0.ended").exists()


def test_control_files_reach_the_node_and_are_never_pushed_back(sides):
    client, node, store = sides
    cancel = client.run_dir.spark_cancel_file(0)
    heartbeat = client.run_dir.client_heartbeat_file(0)
    stop = client.run_dir.attempt_dir(0) / runtime.STOP_FILE
    heartbeat.write_text("1\n")
    client.sync(0)
    node.pull_control()
    assert node.run_dir.client_heartbeat_file(0).read_text() == "1\n"
    assert not node.run_dir.spark_cancel_file(0).exists()

    heartbeat.write_text("2\n")  # same size: the node must notice by content, not by size
    stop.write_text("the runtime cap is near\n")
    cancel.write_text("cancelled by the client\n")
    # Another node's exit file, as that node pushed it: a failed peer stops this node's ranks.
    (store / "attempts/0").mkdir(parents=True, exist_ok=True)
    (store / "attempts/0/node-1.json").write_text('{"node_rank": 1, "status": 1}')
    client.sync(0)
    node.pull_control()
    assert node.run_dir.client_heartbeat_file(0).read_text() == "2\n"
    assert node.run_dir.spark_cancel_file(0).read_text() == "cancelled by the client\n"
    assert (node.run_dir.attempt_dir(0) / runtime.STOP_FILE).read_text() == "the runtime cap is near\n"
    assert json.loads(node.run_dir.node_file(0, 1).read_text())["status"] == 1

    uploads = []
    upload = node.store.upload
    node.store.upload = lambda path, rel: uploads.append(rel) or upload(path, rel)
    node.finish()
    assert uploads == []


def test_pulled_files_appear_complete_or_not_at_all(sides, monkeypatch):
    client, node, store = sides
    rd = node.run_dir
    rd.key = KEY
    rd.prepare_attempt(0)
    rd.write_result(0, 0, list(range(100_000)))  # a result of a few hundred kB
    node.push()

    seen = []
    copyfile = shutil.copyfile
    final = client.run_dir.result_file(0, 0)

    def watching_copyfile(src, dst, **kwargs):
        if os.path.dirname(dst) == str(final.parent):
            seen.append((dst != str(final), final.exists()))
        return copyfile(src, dst, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", watching_copyfile)
    client.sync(0)
    assert seen == [(True, False)]  # fetched under another name; the result appeared by rename
    client.run_dir.key = KEY
    assert client.run_dir.read_result(0, 0) == list(range(100_000))
    assert not [p for p in client.run_dir.path.rglob(".*") if p.is_file()]  # no temp file left


def test_uploads_to_a_file_store_appear_complete_or_not_at_all(sides, monkeypatch):
    client, node, store = sides
    log = node.run_dir.log_file(0, 0)
    log.parent.mkdir(parents=True)
    log.write_bytes(b"x" * 1_000_000)
    seen = []
    copyfile = shutil.copyfile

    def watching_copyfile(src, dst, **kwargs):
        seen.append((os.path.basename(dst).startswith("."), (store / "attempts/0/logs/rank-0.log").exists()))
        return copyfile(src, dst, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", watching_copyfile)
    node.push()
    assert seen == [(True, False)]
    assert (store / "attempts/0/logs/rank-0.log").stat().st_size == 1_000_000
    assert not [p for p in store.rglob(".*") if p.is_file()]


def test_the_ranks_find_the_spool_in_their_nodes_copy_of_the_run_dir(tmp_path):
    """The tracking variables name the spool relative to the run dir, which each node's agent
    sets to its own copy: the same environment serves the client's run dir and a scratch copy."""
    from sparkgpu.tracking.spool import JOB_SPOOL_URI, SpoolDir, spool_path_from_env

    env = {"SPARKGPU_TRACKING_SPOOL": "tracking", "MLFLOW_TRACKING_URI": JOB_SPOOL_URI}
    for run_dir in (tmp_path / "runs" / "job-1", tmp_path / "executor" / "job-1"):
        on_node = {**env, "SPARKGPU_RUN_DIR": str(run_dir)}
        assert spool_path_from_env(on_node) == str(run_dir / "tracking")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPARKGPU_RUN_DIR", str(tmp_path / "executor" / "job-1"))
        mp.setenv("SPARKGPU_TRACKING_SPOOL", "tracking")
        assert SpoolDir.from_uri(JOB_SPOOL_URI).path == tmp_path / "executor" / "job-1" / "tracking"
        mp.delenv("SPARKGPU_RUN_DIR")
        with pytest.raises(ValueError, match="SPARKGPU_RUN_DIR"):
            SpoolDir.from_uri(JOB_SPOOL_URI)
    assert spool_path_from_env({"SPARKGPU_TRACKING_SPOOL": "/abs/tracking"}) == "/abs/tracking"
    assert spool_path_from_env({}) is None
