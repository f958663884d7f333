"""The staging store's mirror: a client run dir and a node's scratch run dir, two different
local folders that share nothing but a real ``file://`` store between them."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from sparkgpu.errors import PayloadSignatureError
from sparkgpu.rundir.serialization import serialize_payload
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.launch.staging import log_bundles
from sparkgpu.launch.backends.spark.executor.channel import Heartbeat
from sparkgpu.launch.staging.log_bundles import LogReader, LogShipper, parse_bundle_name
from sparkgpu.launch.staging.mirror import (
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
    (client_rd.file(RunLayout.attempt(0)) / "spark").mkdir()
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


def bundles(store) -> list[dict]:
    """The node's log bundles on the store, in order: {file: bytes}."""
    found = []
    for path in sorted((store / "attempts/0/logs/node-0.parts").iterdir()):
        head, _, data = path.read_bytes().partition(b"\n")
        files, position = {}, 0
        for rel, _offset, length in json.loads(head)["files"]:
            files[rel] = data[position : position + length]
            position += length
        found.append(files)
    return found


def test_a_growing_log_reaches_the_client_by_its_new_bytes_only(sides):
    client, node, store = sides
    log = node.run_dir.file(RunLayout.rank_log(0, 1))
    log.parent.mkdir(parents=True)
    log.write_bytes(b"step 1\nstep")
    node.push()
    client.sync(0)
    local = client.run_dir.file(RunLayout.rank_log(0, 1))
    assert local.read_bytes() == b"step 1\nstep"

    reads = []
    read_bytes = client.store.read_bytes
    client.store.read_bytes = lambda rel, *a: reads.append(rel) or read_bytes(rel, *a)
    with open(log, "ab") as f:
        f.write(b" 2\nstep 3\n")
    node.push(final=True)  # only the new bytes go up, in a bundle of their own
    assert bundles(store) == [
        {"attempts/0/logs/rank-1.log": b"step 1\nstep"},
        {"attempts/0/logs/rank-1.log": b" 2\nstep 3\n"},
    ]
    assert client.sync(0) == 1
    assert local.read_bytes() == b"step 1\nstep 2\nstep 3\n"
    # The client reads the new bundle by its name, then finds no next one: no listing of the logs.
    assert reads == [f"attempts/0/logs/node-0.parts/{n:016d}" for n in (1, 2)]
    assert client.sync(0) == 0 and reads[2:] == [f"attempts/0/logs/node-0.parts/{2:016d}"]  # nothing new: one read


def test_one_bundle_carries_every_log_of_the_node_and_ships_at_most_every_log_interval(sides):
    client, node, store = sides
    node.log_interval = 3600.0
    for rank in (0, 1):
        node.run_dir.file(RunLayout.rank_log(0, rank)).parent.mkdir(parents=True, exist_ok=True)
        node.run_dir.file(RunLayout.rank_log(0, rank)).write_text(f"one {rank}\n")
    node.push()
    for rank in (0, 1):
        with open(node.run_dir.file(RunLayout.rank_log(0, rank)), "a") as f:
            f.write("two\n")
    node.push()
    assert bundles(store) == [{"attempts/0/logs/rank-0.log": b"one 0\n", "attempts/0/logs/rank-1.log": b"one 1\n"}]
    node.finish()
    assert len(bundles(store)) == 2
    client.sync(0)
    assert [client.run_dir.file(RunLayout.rank_log(0, r)).read_text() for r in (0, 1)] == [
        "one 0\ntwo\n",
        "one 1\ntwo\n",
    ]


def test_a_followed_log_ships_at_its_own_shorter_interval(sides):
    client, node, store = sides
    node.log_interval, node.followed_interval = 3600.0, 0.0
    node.followed = frozenset({"attempts/0/logs/rank-0.log"})
    log = node.run_dir.file(RunLayout.rank_log(0, 1))
    log.parent.mkdir(parents=True)
    log.write_text("one\n")
    node.push()
    log.write_text("one\ntwo\n")
    node.push()
    assert len(bundles(store)) == 1  # nobody follows rank 1: it waits its interval
    node.run_dir.file(RunLayout.rank_log(0, 0)).write_text("echoed\n")
    node.push()
    client.sync(0)
    # followed: shipped at once, with the rest
    assert client.run_dir.file(RunLayout.rank_log(0, 0)).read_text() == "echoed\n"
    assert client.run_dir.file(RunLayout.rank_log(0, 1)).read_text() == "one\ntwo\n"


def test_while_an_attempt_runs_the_client_reads_node_0_and_the_nodes_someone_follows(sides, tmp_path):
    client, _, store = sides
    other = NodeMirror(client.store, RunDir(tmp_path / "executor-1" / "job-1"), attempt=0, node=1, log_interval=0.0)
    log = other.run_dir.file(RunLayout.rank_log(0, 3))  # rank 3 lives on node 1 (2 ranks per node)
    log.parent.mkdir(parents=True)
    log.write_text("step 1\n")
    other.push()
    client._followed, client._nodes, client._ranks_per_node = (0,), 2, 2  # as start() sets them
    client.sync(0)
    # node 1 is not followed: its logs wait for the end
    assert not client.run_dir.file(RunLayout.rank_log(0, 3)).exists()

    follow = client.run_dir.file("attempts/0/spark/follow")  # `sparkgpu logs JOB --rank 3 --follow`
    follow.write_text(json.dumps({"ranks": [3], "until": time.time() + 30}))
    client.sync(0)
    assert client.run_dir.file(RunLayout.rank_log(0, 3)).read_text() == "step 1\n"

    follow.write_text(json.dumps({"ranks": [3], "until": time.time() - 1}))  # the follower stopped
    with open(log, "a") as f:
        f.write("step 2\n")
    other.push()
    client.sync(0)
    assert client.run_dir.file(RunLayout.rank_log(0, 3)).read_text() == "step 1\n"
    client.sync(0, everything=True)  # the attempt ended: every node's logs come down
    assert client.run_dir.file(RunLayout.rank_log(0, 3)).read_text() == "step 1\nstep 2\n"


def test_a_bundle_not_listed_yet_holds_back_the_ones_after_it(sides):
    client, node, store = sides
    log = node.run_dir.file(RunLayout.rank_log(0, 0))
    log.parent.mkdir(parents=True)
    for text in ("a\n", "b\n", "c\n"):
        with open(log, "a") as f:
            f.write(text)
        node.push(final=True)
    middle = store / "attempts/0/logs/node-0.parts" / f"{1:016d}"
    held = middle.read_bytes()
    middle.unlink()  # an object store that lists the third bundle before the second
    client.sync(0)
    assert client.run_dir.file(RunLayout.rank_log(0, 0)).read_text() == "a\n"
    middle.write_bytes(held)
    client.sync(0)
    assert client.run_dir.file(RunLayout.rank_log(0, 0)).read_text() == "a\nb\nc\n"


def test_a_planted_name_in_a_bundle_is_refused(sides, tmp_path):
    client, node, store = sides
    parts = store / "attempts/0/logs/node-0.parts"
    parts.mkdir(parents=True)
    (parts / f"{0:016d}").write_bytes(b'{"files":[["../../outside.log",0,3]]}\nbad')
    client.sync(0)
    assert not (client.run_dir.path.parent / "outside.log").exists()
    assert not list(tmp_path.rglob("outside.log"))


def test_log_bundles_on_the_s3_server_send_each_byte_once_and_read_back_in_order(s3_bucket, tmp_path):
    store = StagingStore(s3_bucket, "job-1")
    shipper = LogShipper(store, "attempts/0/logs/node-0")
    files = {f"attempts/0/logs/rank-{r}.log": tmp_path / f"rank-{r}.log" for r in range(3)}
    written = dict.fromkeys(files, b"")
    for step in range(5):
        for rel, path in files.items():
            line = f"{rel} step {step} loss 0.1234 {'.' * 50}\n".encode() * 30  # 30 s of a line a second
            with open(path, "ab") as f:
                f.write(line)
            written[rel] += line
        assert shipper.ship(files)
    assert not shipper.ship(files)  # nothing grew: nothing sent
    content = sum(len(v) for v in written.values())
    assert shipper.bytes_sent <= 1.1 * content  # headers included: within a tenth
    listed = store.list("attempts/0/logs")
    assert sum(size for size, _ in listed.values()) == shipper.bytes_sent
    streams: dict[str, dict[int, int]] = {}
    for rel, (size, _) in listed.items():
        stream, seq = parse_bundle_name(rel)
        streams.setdefault(stream, {})[seq] = size
    reader = LogReader(lambda rel: tmp_path / "client" / rel, lambda exc: pytest.fail(str(exc)))
    first = {"attempts/0/logs/node-0": {s: streams["attempts/0/logs/node-0"][s] for s in (0, 1)}}
    assert reader.fetch(store, first) == 2
    assert reader.fetch(store, streams) == 3  # the rest, in order, none read twice
    for rel, data in written.items():
        assert (tmp_path / "client" / rel).read_bytes() == data


def test_a_big_log_goes_up_in_bounded_bundles_one_a_round(sides, monkeypatch):
    client, node, store = sides
    monkeypatch.setattr(log_bundles, "MAX_BUNDLE", 1000)
    monkeypatch.setattr(LogShipper.ship, "__defaults__", (1000,))
    node.log_interval = 3600.0
    log = node.run_dir.file(RunLayout.rank_log(0, 0))
    log.parent.mkdir(parents=True)
    log.write_bytes(b"x" * 2500)
    node.push()
    assert len(bundles(store)) == 1  # one bundle a round: the node's other files are not held behind it
    node.push()
    node.push()
    assert [len(b["attempts/0/logs/rank-0.log"]) for b in bundles(store)] == [1000, 1000, 500]
    client.sync(0)
    assert client.run_dir.file(RunLayout.rank_log(0, 0)).read_bytes() == b"x" * 2500


def test_the_final_push_sends_results_and_errors_before_the_nodes_end_markers(sides):
    client, node, store = sides
    rd = node.run_dir
    rd.key = KEY
    rd.prepare_attempt(0)
    spark = rd.file(RunLayout.attempt(0)) / "spark"
    spark.mkdir()
    (spark / "node-0.started").write_text('{"node": 0}')
    node.push()
    assert (store / "attempts/0/spark/node-0.started").exists()  # the client bills from it: sent at once

    rd.write_result(0, 0, {"rank": 0})
    try:
        raise ValueError("shard 7 is corrupt")
    except ValueError as exc:
        rd.write_error(0, 1, exc)
    rd.file(RunLayout.rank_log(0, 1)).write_text("Traceback ...\n")
    rd.file(RunLayout.node_exits(0, 0)).write_text('{"node_rank": 0, "status": 1, "failures": {}}')
    (spark / "node-0.ended").write_text('{"state": "failed"}')
    uploads = []
    upload, write_bytes = node.store.upload, node.store.write_bytes
    node.store.upload = lambda path, rel: uploads.append(rel) or upload(path, rel)
    node.store.write_bytes = lambda rel, data: uploads.append(rel) or write_bytes(rel, data)
    node.finish()

    assert uploads[-2:] == ["attempts/0/node-0.json", "attempts/0/spark/node-0.ended"]
    assert set(uploads[:-2]) == {
        "attempts/0/results/rank-0.pkl",
        "attempts/0/results/rank-1.error.pkl",
        f"attempts/0/logs/node-0.parts/{0:016d}",
    }
    client.sync(0)  # while the attempt runs, only its spark/ folder and the followed logs come down
    assert not client.run_dir.file(RunLayout.result(0, 0)).exists()
    assert (client.run_dir.file(RunLayout.attempt(0)) / "spark" / "node-0.ended").exists()
    client.sync(0, everything=True)  # the attempt ended: everything
    client_rd = client.run_dir
    client_rd.key = KEY
    assert client_rd.read_result(0, 0) == {"rank": 0}  # signed by the rank, checked on the client
    failure, exc = client_rd.read_error(0, 1)
    assert isinstance(exc, ValueError) and "shard 7 is corrupt" in failure.traceback
    assert json.loads((client_rd.file(RunLayout.attempt(0)) / "spark" / "node-0.ended").read_text()) == {
        "state": "failed"
    }


def test_the_end_marker_waits_for_the_final_push(sides):
    client, node, store = sides
    spark = node.run_dir.file(RunLayout.attempt(0)) / "spark"
    spark.mkdir(parents=True)
    (spark / "node-0.ended").write_text('{"state": "succeeded"}')
    node.push()
    assert not (store / "attempts/0/spark/node-0.ended").exists()
    node.finish()
    assert (store / "attempts/0/spark/node-0.ended").exists()


def test_control_files_reach_node_0_as_one_object_and_are_never_pushed_back(sides, tmp_path):
    client, node, store = sides
    cancel = client.run_dir.file(RunLayout.spark_cancel(0))
    heartbeat = client.run_dir.file(RunLayout.client_heartbeat(0))
    stop = client.run_dir.file(RunLayout.stop(0))
    heartbeat.write_text("1\n")
    client.sync(0)
    node.pull_control()
    assert node.run_dir.file(RunLayout.client_heartbeat(0)).read_text() == "1\n"
    assert not node.run_dir.file(RunLayout.spark_cancel(0)).exists()

    puts = []
    write_bytes = client.store.write_bytes
    client.store.write_bytes = lambda rel, data: puts.append(rel) or write_bytes(rel, data)
    client.sync(0)
    assert puts == []  # nothing changed: nothing put
    heartbeat.write_text("2\n")  # same size: the node must notice by content, not by size
    stop.write_text("the runtime cap is near\n")
    cancel.write_text("cancelled by the client\n")
    client.sync(0)
    assert puts == ["attempts/0/spark/control"]  # three changed files, one object
    reads = []
    read_bytes = node.store.read_bytes
    node.store.read_bytes = lambda rel, *a: reads.append(rel) or read_bytes(rel, *a)
    node.pull_control()
    assert reads == ["attempts/0/spark/control"]  # one request per look
    assert node.run_dir.file(RunLayout.client_heartbeat(0)).read_text() == "2\n"
    assert node.run_dir.file(RunLayout.spark_cancel(0)).read_text() == "cancelled by the client\n"
    assert node.run_dir.file(RunLayout.stop(0)).read_text() == "the runtime cap is near\n"

    # Any other node hears of them from node 0, never from the store.
    other = NodeMirror(node.store, RunDir(tmp_path / "executor-2" / "job-1"), attempt=0, node=1)
    other.pull_control()
    assert reads == ["attempts/0/spark/control"] and not other.run_dir.path.exists()

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
    final = client.run_dir.file(RunLayout.result(0, 0))

    def watching_copyfile(src, dst, **kwargs):
        if os.path.dirname(dst) == str(final.parent):
            seen.append((dst != str(final), final.exists()))
        return copyfile(src, dst, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", watching_copyfile)
    client.sync(0, everything=True)
    assert seen == [(True, False)]  # fetched under another name; the result appeared by rename
    client.run_dir.key = KEY
    assert client.run_dir.read_result(0, 0) == list(range(100_000))
    assert not [p for p in client.run_dir.path.rglob(".*") if p.is_file()]  # no temp file left


def test_uploads_to_a_file_store_appear_complete_or_not_at_all(sides, monkeypatch):
    client, node, store = sides
    report = node.run_dir.file(RunLayout.attempt(0)) / "env-rank-0.json"
    report.parent.mkdir(parents=True)
    report.write_bytes(b"x" * 1_000_000)
    seen = []
    copyfile = shutil.copyfile

    def watching_copyfile(src, dst, **kwargs):
        seen.append((os.path.basename(dst).startswith("."), (store / "attempts/0/env-rank-0.json").exists()))
        return copyfile(src, dst, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", watching_copyfile)
    node.push()
    assert seen == [(True, False)]
    assert (store / "attempts/0/env-rank-0.json").stat().st_size == 1_000_000
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


def test_a_store_that_stalls_for_a_minute_makes_node_0_count_no_silence_of_the_client(sides, monkeypatch):
    client, node, _ = sides
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    client.run_dir.key = node.run_dir.key = KEY
    beat_file = client.run_dir.file(RunLayout.client_heartbeat(0))
    client.run_dir.write_control(beat_file, b"1\n")
    client.sync(0)
    node.pull_control()
    seen = node.run_dir.file(RunLayout.client_heartbeat(0))
    on_store_time = Heartbeat(node.run_dir, seen, timeout=10, clock=node.clock)
    on_wall_time = Heartbeat(node.run_dir, seen, timeout=10)

    def tick(seconds: int) -> None:
        for _ in range(seconds):
            now[0] += 1
            try:
                node.pull_control()
            except OSError:
                continue  # the mirror's loop reports it and tries again

    tick(1)
    assert not on_store_time.lost() and not on_wall_time.lost()
    read_bytes = node.store.read_bytes
    with monkeypatch.context() as stalled:
        stalled.setattr(node.store, "read_bytes", lambda *a, **k: (_ for _ in ()).throw(OSError("SlowDown")))
        tick(60)  # the store answers nothing for a minute; the client's beats cannot get through
        assert not on_store_time.lost()
        assert on_wall_time.lost()  # what a wall clock would have concluded: a false loss
    assert node.store.read_bytes == read_bytes
    client.run_dir.write_control(beat_file, b"2\n")  # the client's next beat, once the store is back
    client.sync(0)
    tick(1)
    assert not on_store_time.lost()
    tick(9)
    assert not on_store_time.lost()
    tick(3)  # now it is silent for longer than its timeout while the store answers: lost
    assert on_store_time.lost()


def test_a_store_that_fails_is_retried_with_backoff_said_once_and_its_return_said(monkeypatch):
    import io

    from sparkgpu.launch.staging import mirror as staging

    monkeypatch.setattr(staging, "MAX_BACKOFF", 0.8)
    out, calls, waits, now = io.StringIO(), [], [], [0.0]

    # The loop's waits advance this clock instead of taking time: the store fails for the
    # first 2 s and answers for the next 1.2 s, however busy the machine is.
    def waited(loop, wait):
        waits.append(wait)
        now[0] += wait
        return now[0] >= 3.2

    def step():
        calls.append((now[0], now[0] < 2.0))
        if now[0] < 2.0:
            raise OSError("SlowDown")

    monkeypatch.setattr(staging._Loop, "_stopped_after", waited)
    loop = staging._Loop(step, 0.05, "test-loop", staging._Reporter(out, "node 3", clock=lambda: now[0]))
    loop._thread.join(30)  # a hang guard: the loop stops itself at 3.2 s of its own clock
    assert not loop._thread.is_alive()
    loop.stop()
    failed = [t for t, fails in calls if fails]
    assert len(failed) == 5, f"{len(failed)} tries in 2 s"  # 40 without backoff
    assert waits[:6] == [0.05, 0.1, 0.2, 0.4, 0.8, 0.8]  # the wait doubled up to its bound
    answered = [t for t, fails in calls if not fails]
    assert [fails for _, fails in calls] == [True] * 5 + [False] * len(answered)
    assert len(answered) >= 10 and set(waits[6:]) == {0.05}  # once the store answers, back to every interval
    said = out.getvalue()
    assert said.count("could not sync with the staging store") == 1 and "OSError: SlowDown" in said
    # Failing from 0.05 s (the first try) to 2.35 s (the first answer after the 1.55 s try's 0.8 s wait).
    assert "node 3 reaches the staging store again, after 2s" in said
