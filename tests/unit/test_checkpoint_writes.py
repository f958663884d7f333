"""How a checkpoint's files are written: hashed beside the writes, fsynced once each before the
marker, every phase of a save timed."""

from __future__ import annotations

import json
import os

import blake3
import pytest
import torch
from torch import nn

from sparkgpu.rundir.keyring import hold_job_key
from sparkgpu.train import Checkpointer
from sparkgpu.train import _checkpoint_writes
from sparkgpu.train._checkpoint_writes import SaveStreams, SaveTimings
from sparkgpu.train.checkpoint_directory import MARKER_NAME

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

JOB = "train-20250101-120000-a1b2c3"


@pytest.fixture
def small_thresholds(monkeypatch):
    # Tensors of a test model are small: let them take the helper-thread paths of a large save.
    monkeypatch.setattr(_checkpoint_writes, "_OVERLAP_BYTES", 1 << 10)
    monkeypatch.setattr(_checkpoint_writes, "WRITEOUT_BYTES", 64 << 10)


@pytest.fixture
def in_a_job(monkeypatch):
    monkeypatch.setenv("SPARKGPU_JOB_ID", JOB)
    hold_job_key(bytes(range(32)))
    yield
    hold_job_key(None)


def training(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("async_save", [True, False])
def test_a_signed_save_lists_the_hashes_of_the_bytes_on_disk_and_restores(
    tmp_path, small_thresholds, in_a_job, async_save
):
    model, optimizer = training()
    ckpt = Checkpointer(tmp_path, async_save=async_save, handle_sigterm=False)
    ckpt.save(3, model=model, optimizer=optimizer, wait=True)
    ckpt.close()

    path = tmp_path / "step-0000000003"
    listed = json.loads((path / MARKER_NAME).read_text())["signed"]["files"]
    assert set(listed) == {".metadata", "__0_0.distcp"}
    for name, entry in listed.items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "digest": "blake3:" + blake3.blake3(data).hexdigest()}

    phases = ckpt.last_save_phases
    assert phases is not None
    assert phases["bytes"] == sum(entry["size"] for entry in listed.values())
    assert phases["files"] == 2  # the data file and .metadata, each fsynced once
    for name in ("build_s", "stage_s", "plan_s", "data_s", "lists_s", "metadata_s", "commit_s", "committed_s"):
        assert phases[name] >= 0, name
    assert phases["hash_s"] > 0 and phases["write_s"] > 0
    assert phases["committed_s"] >= phases["data_s"] + phases["commit_s"]

    fresh, fresh_optimizer = training(seed=1)
    restorer = Checkpointer(tmp_path, handle_sigterm=False)
    assert restorer.restore(model=fresh, optimizer=fresh_optimizer) == 4
    restorer.close()
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_every_file_and_folder_is_fsynced_before_the_marker_appears(tmp_path, small_thresholds, monkeypatch):
    events = []
    real_fsync = os.fsync

    def fsync(fd):
        name = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else str(fd)
        events.append(("fsync", os.path.basename(name)))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    for name in ("rename", "replace"):
        real = getattr(os, name)

        def moved(src, dst, real=real):
            events.append(("rename", os.path.basename(os.fspath(dst))))
            real(src, dst)

        monkeypatch.setattr(os, name, moved)
    model, optimizer = training()
    ckpt = Checkpointer(tmp_path, handle_sigterm=False)
    ckpt.save(0, model=model, optimizer=optimizer, wait=True)
    ckpt.close()

    marker = events.index(("rename", MARKER_NAME))
    before = events[:marker]
    assert ("fsync", "__0_0.distcp") in before
    assert ("fsync", ".metadata.tmp") in before or ("fsync", ".metadata") in before
    # The checkpoint's folder, then the root, after every file and before the marker.
    folders = [i for i, e in enumerate(before) if e in (("fsync", "step-0000000000"), ("fsync", tmp_path.name))]
    assert len(folders) >= 2 and folders[-1] > before.index(("fsync", "__0_0.distcp"))
    assert events.count(("fsync", "__0_0.distcp")) == 1  # once, not DCP's and ours


def test_a_stream_hashes_large_writes_beside_them_and_never_returns_before_its_hash(tmp_path, small_thresholds):
    timings = SaveTimings()
    seen = {}

    class Fs:
        def create_stream(self, path, mode):
            return open(path, mode)

    streams = SaveStreams(Fs(), timings, hashed=True, durable=True, on_written=lambda *a: seen.setdefault(a[0], a))
    buffer = bytearray(os.urandom(300_000))
    with streams.create_stream(tmp_path / "f", "wb") as stream:
        stream.write(b"head")
        stream.write(memoryview(buffer))
        buffer[:] = bytes(len(buffer))  # the caller reuses its buffer once write returned
        stream.write(torch.arange(1000, dtype=torch.float32).numpy())
    data = (tmp_path / "f").read_bytes()
    assert seen["f"] == ("f", len(data), "blake3:" + blake3.blake3(data).hexdigest())
    assert timings.files == 1 and timings.bytes == len(data) and timings.fsync_s > 0


def _write_in_stretches(path, streams, pieces):
    with streams.create_stream(path, "wb") as stream:
        for piece in pieces:
            stream.write(piece)


@pytest.mark.parametrize("platform_has_it", [True, False])
def test_a_durable_stream_hands_each_stretch_to_the_disk_as_it_goes_and_fsyncs_once(
    tmp_path, small_thresholds, monkeypatch, platform_has_it
):
    handed, fsynced = [], []
    real_writeout, real_fsync = _checkpoint_writes.start_writeout, os.fsync

    def writeout(fd, offset, length):
        # The bytes handed over are in the file already (flushed from Python's buffer).
        assert os.fstat(fd).st_size >= offset + length
        handed.append((offset, length))
        return real_writeout(fd, offset, length) if platform_has_it else False

    monkeypatch.setattr(_checkpoint_writes, "start_writeout", writeout)
    monkeypatch.setattr(os, "fsync", lambda fd: (fsynced.append(fd), real_fsync(fd)))

    class Fs:
        def create_stream(self, path, mode):
            return open(path, mode)

    timings = SaveTimings()
    pieces = [os.urandom(40 << 10) for _ in range(8)]  # 320 KiB in stretches of 64 KiB
    _write_in_stretches(tmp_path / "f", SaveStreams(Fs(), timings, hashed=False, durable=True), pieces)
    assert (tmp_path / "f").read_bytes() == b"".join(pieces)
    assert len(fsynced) == 1 and timings.fsync_s > 0
    if platform_has_it:
        # Every stretch once, in order, each beginning where the last one ended.
        assert handed[0][0] == 0 and len(handed) == 4
        assert all(a + n == b for (a, n), (b, _) in zip(handed, handed[1:]))
        assert sum(n for _, n in handed) == 4 * (80 << 10)
    else:
        assert len(handed) == 1  # asked once; the final fsync then writes everything

    handed.clear()
    _write_in_stretches(tmp_path / "g", SaveStreams(Fs(), SaveTimings(), hashed=False, durable=False), pieces)
    assert handed == []  # remote stores have no pages to hand over


def test_start_writeout_reports_an_error_the_kernel_gives():
    if _checkpoint_writes._sync_file_range() is None:
        pytest.skip("this platform has no sync_file_range")
    read, write = os.pipe()
    os.close(write)
    try:
        with pytest.raises(OSError, match="sync_file_range"):
            _checkpoint_writes.start_writeout(read, 0, 1)  # a pipe is no file: ESPIPE
    finally:
        os.close(read)


def _tensor_record_checksums(path) -> list[int]:
    """The CRC32 fields of the tensor records DCP wrote with ``torch.save`` into the data file."""
    import io
    import pickle
    import zipfile

    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    data = (path / "__0_0.distcp").read_bytes()
    checksums = []
    for info in metadata.storage_data.values():
        record = data[info.offset : info.offset + info.length]
        if record[:2] == b"PK":  # a tensor's zip archive; the app's bytes are written raw
            with zipfile.ZipFile(io.BytesIO(record)) as archive:
                checksums += [entry.CRC for entry in archive.infolist() if "/data/" in entry.filename]
    return checksums


@pytest.mark.parametrize("async_save", [True, False])
def test_a_signed_save_skips_torchs_checksum_of_each_tensor_and_an_unsigned_one_keeps_it(
    tmp_path, monkeypatch, async_save
):
    model, optimizer = training()
    unsigned = Checkpointer(tmp_path / "unsigned", async_save=async_save, handle_sigterm=False)
    unsigned.save(1, model=model, optimizer=optimizer, wait=True)
    unsigned.close()
    kept = _tensor_record_checksums(tmp_path / "unsigned" / "step-0000000001")
    assert kept and all(kept)  # 2 Linear layers and AdamW: every tensor record has its CRC32

    monkeypatch.setenv("SPARKGPU_JOB_ID", JOB)
    hold_job_key(bytes(range(32)))
    try:
        signed = Checkpointer(tmp_path / "signed", async_save=async_save, handle_sigterm=False)
        signed.save(1, model=model, optimizer=optimizer, wait=True)
        signed.close()
        assert torch.serialization.get_crc32_options()  # the process's own setting is back
        skipped = _tensor_record_checksums(tmp_path / "signed" / "step-0000000001")
        assert len(skipped) == len(kept) and not any(skipped)
        fresh, fresh_optimizer = training(seed=1)
        restorer = Checkpointer(tmp_path / "signed", handle_sigterm=False)
        assert restorer.restore(model=fresh, optimizer=fresh_optimizer) == 2
        restorer.close()
    finally:
        hold_job_key(None)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
