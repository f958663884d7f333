"""Every remote path of the project on a real S3-protocol server (moto) on loopback.

The clients reach it as they reach AWS: through the standard ``AWS_*`` environment variables
(``AWS_ENDPOINT_URL`` for the endpoint), set by the ``s3_bucket`` fixture.
"""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pytest
import torch

from sparkgpu import data
from sparkgpu._util.files import is_temporary
from sparkgpu.env.store import BlobStore
from sparkgpu.errors import DataError
from sparkgpu.train import Checkpointer

pytestmark = pytest.mark.integration


def _table(rows: int) -> pa.Table:
    rng = np.random.default_rng(3)
    return pa.table(
        {
            "id": np.arange(rows, dtype=np.int64),
            "x": rng.standard_normal(rows).astype(np.float32),
            "blob": [bytes(rng.integers(0, 255, 300, dtype=np.uint8)) for _ in range(rows)],
        }
    )


def test_to_mds_writes_to_s3_and_the_loader_reads_it_back_through_the_cache(s3_bucket, tmp_path):
    table = _table(3000)
    url = f"{s3_bucket}/feats/v1"
    data.to_mds(table, url, compression="zstd", hashes=["xxh64"], size_limit=200_000)

    fs, root = fsspec.core.url_to_fs(url)
    names = [path[len(root) + 1 :] for path in fs.find(root)]
    assert "index.json" in names and any(name.endswith(".mds.zstd") for name in names), names
    assert not [name for name in names if "partial" in name or "/." in f"/{name}"], "no leftover of the writing"

    ds = data.dataset(remote=url, local=tmp_path / "cache", batch_size=128, shuffle=True, seed=5, download_threads=4)
    ids, xs = [], []
    for batch in ds:
        ids.append(batch["id"].numpy())
        xs.append(batch["x"].numpy())
    order = np.concatenate(ids)
    assert sorted(order.tolist()) == list(range(3000))
    np.testing.assert_array_equal(np.concatenate(xs), table["x"].to_numpy()[order])
    assert any((tmp_path / "cache").rglob("*.mds")), "shards land in the local cache"


def test_a_volume_reads_large_files_as_ranges_from_s3(s3_bucket, tmp_path):
    from sparkgpu.data.storage.volume import RangePool, Volume

    payload = np.random.default_rng(1).integers(0, 255, (5 << 20) + 777, dtype=np.uint8).tobytes()
    with fsspec.open(f"{s3_bucket}/vol/shard.bin", "wb") as f:
        f.write(payload)
    volume = Volume(f"{s3_bucket}/vol")
    assert volume._direct is not None, "s3:// reads through obstore"
    with RangePool(4) as pool:
        volume.download("shard.bin", str(tmp_path / "copy"), size=len(payload), pool=pool)
    assert (tmp_path / "copy").read_bytes() == payload
    assert volume.ranges_supported is True
    assert volume.read_bytes("shard.bin", 10, 20) == payload[10:20]
    with pytest.raises(DataError, match="missing from volume"):
        volume.read_bytes("nope.bin")


def test_the_environment_store_on_s3_shows_blobs_complete_or_not_at_all(s3_bucket):
    import hashlib

    store = BlobStore(f"{s3_bucket}/_envstore")
    body = b"tar bytes " * 1000

    def write(f):
        f.write(body)
        return hashlib.sha256(body).hexdigest(), len(body)

    name, digest, tar_bytes, stored = store.put_blob(write, None)
    assert store.list_blobs() == {digest: (name, stored)} and stored == len(body)
    assert store.read_bytes(name) == body

    def failing(f):
        f.write(b"half a blob")
        raise RuntimeError("upload cut off")

    with pytest.raises(RuntimeError):
        store.put_blob(failing, None)
    assert set(store.list_blobs()) == {digest}
    assert not [p for p in store.fs.find(store.root) if is_temporary(p)], "no leftover of the failed upload"

    store.write_bytes("manifests/m.json", b"{}")
    assert store.exists("manifests/m.json") and store.read_bytes("manifests/m.json") == b"{}"


def test_the_store_on_s3_publishes_whole_objects_only(s3_bucket, tmp_path):
    from sparkgpu.store import Store

    store = Store(f"{s3_bucket}/store")
    store.write_bytes("a/index.json", b"{}")
    with pytest.raises(RuntimeError):
        with store.writer("a/blob.tar") as f:
            f.write(b"half a blob")
            raise RuntimeError("upload cut off")
    assert list(store.list()) == ["a/index.json"]
    assert not [p for p in store.fs.find(store.root) if "blob" in p], "neither the half object nor a temporary"

    source = tmp_path / "x.bin"
    source.write_bytes(os.urandom(1 << 20))
    store.upload(source, "up/x.bin")
    store.download("up/x.bin", tmp_path / "y.bin")
    assert (tmp_path / "y.bin").read_bytes() == source.read_bytes()
    assert store.read_bytes("up/x.bin", 10, 20) == source.read_bytes()[10:20]
    store.rename("a/index.json", "b/index.json")
    store.remove("up")
    assert list(store.list()) == ["b/index.json"] and store.listdir() == ["b"]


def test_checkpoints_save_and_restore_on_s3(s3_bucket):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    directory = f"{s3_bucket}/ckpt"
    saver = Checkpointer(directory=directory, keep_last=1)
    saver.save(3, model=model, optimizer=opt, extras={"note": "three"})
    saver.save(7, model=model, optimizer=opt)
    saver.close()

    fs, root = fsspec.core.url_to_fs(directory)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root)) == ["step-0000000007"], "keep_last prunes on S3"

    fresh = torch.nn.Linear(4, 2)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    restorer = Checkpointer(directory=directory)
    assert restorer.restore(model=fresh, optimizer=fresh_opt) == 8  # the step after the saved one
    restorer.close()
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    assert torch.equal(
        fresh_opt.state_dict()["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"]
    )


def _double(x):
    return 2 * x


def test_the_staging_mirror_carries_payload_logs_and_controls_through_s3(s3_bucket, tmp_path):
    from sparkgpu.errors import PayloadSignatureError
    from sparkgpu.rundir.layout import RunLayout
    from sparkgpu.rundir.serialization import serialize_payload
    from sparkgpu.rundir.directory import RunDir
    from sparkgpu.launch.staging.mirror import ClientMirror, NodeMirror, StagingStore
    from sparkgpu.spec import JobSpec, Resources

    key = b"k" * 32
    job = JobSpec(job_id="job-s3", name="double", resources=Resources(2, "cpu"), backend="spark")
    client_rd = RunDir(tmp_path / "client" / "job-s3")
    client_rd.create(job.to_dict(), serialize_payload(_double, (21,), {}, []), key, [])
    client_rd.prepare_attempt(0)
    url = f"{s3_bucket}/staging"
    client = ClientMirror(client_rd, StagingStore(url, "job-s3"))
    node = NodeMirror(
        StagingStore(url, "job-s3"), RunDir(tmp_path / "node" / "job-s3"), attempt=0, node=0, log_interval=0.0
    )

    client.upload_payload()
    node.download_payload()
    assert set(node.run_dir.verify(key)) >= {"spec.json", "payload.pkl"}

    log = node.run_dir.file(RunLayout.rank_log(0, 1))
    log.parent.mkdir(parents=True)
    log.write_bytes(b"step 1\n")
    node.push()
    client.sync(0)
    with open(log, "ab") as f:
        f.write(b"step 2\n")
    node.push(final=True)
    client.sync(0)
    assert client_rd.file(RunLayout.rank_log(0, 1)).read_bytes() == b"step 1\nstep 2\n"

    client_rd.file(RunLayout.stop(0)).write_text("the runtime cap is near\n")
    client.sync(0)
    node.pull_control()
    assert node.run_dir.file(RunLayout.stop(0)).read_text() == "the runtime cap is near\n"

    fs, root = fsspec.core.url_to_fs(f"{url}/job-s3/payload.pkl")
    fs.pipe_file(root, b"planted")  # the store is not trusted
    node.download_payload()
    with pytest.raises(PayloadSignatureError):
        node.run_dir.verify(key)


STEPS, KILL_AT = 8, 5


def _train_with_checkpoints_on_s3(directory, kill_at):
    """Identical batches on both ranks: the DDP run equals one process, bitwise."""
    import os
    import signal

    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparkgpu import runtime

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    model = DDP(net) if runtime.get_world_size() > 1 else net
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = Checkpointer(directory=directory, every_steps=2, keep_last=2)
    step = start = ckpt.restore(model=model, optimizer=opt)
    while step < STEPS:
        x = torch.arange(4 * 3, dtype=torch.float32).reshape(3, 4) / (step + 1)
        loss = (model(x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if runtime.attempt() == 0 and runtime.get_global_rank() == 1 and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.maybe_save(step, model=model, optimizer=opt)
        step += 1
    ckpt.close()
    return start, {name: t.clone() for name, t in net.state_dict().items()}


def test_a_job_killed_by_sigkill_resumes_from_its_s3_checkpoint_with_no_secret_in_its_run_dir(
    s3_bucket, s3_server, monkeypatch, tmp_path
):
    from sparkgpu import distributed
    from sparkgpu.config import settings

    sentinel = "sentinel-aws-secret-4b1e9d"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", sentinel)  # the server takes any secret; ranks inherit it
    _, expected = _train_with_checkpoints_on_s3(f"{s3_bucket}/plain", kill_at=None)

    job = distributed(gpus=2, gpu_type="cpu", max_restarts=1)(_train_with_checkpoints_on_s3)
    results = job.distributed(f"{s3_bucket}/killed", KILL_AT)
    (start,) = {start for start, _ in results}
    assert 0 < start <= KILL_AT, "both ranks resume from a checkpoint saved before the kill"
    for _, weights in results:
        for name, value in expected.items():
            assert torch.equal(weights[name], value), name

    run_dir = settings().staging_root / job.last_job_id
    state = (run_dir / "state.json").read_text()
    assert '"failed"' in state and '"succeeded"' in state
    homes = [run_dir, Path(os.environ["SPARKGPU_HOME"]), tmp_path]
    leaked = [
        str(path)
        for home in homes
        for path in home.rglob("*")
        if path.is_file() and sentinel.encode() in path.read_bytes()
    ]
    assert not leaked, f"the AWS secret was written to {leaked}"
