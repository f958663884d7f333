"""Staging: content-addressed blobs, uploads only of what changed, the size limit."""

from __future__ import annotations

import os

import pytest

from sparkgpu.env import BlobStore, hydrate_environment, snapshot_environment, stage_environment, stage_snapshot
from sparkgpu.env._pack import FileEntry, tar_digest
from sparkgpu.errors import ConfigurationError, EnvironmentTooLargeError
from tests.unit.test_env_support import write_dist


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    site = tmp_path / "site-packages"
    write_dist(site, "alpha", "1.0", {"alpha/__init__.py": "X = 1\n", "alpha/table.bin": os.urandom(3000)})
    write_dist(site, "beta", "2.0", {"beta.py": "Y = 2\n"})
    return site


def entries_of(paths):
    return tuple(FileEntry(str(p), f"site/{p.name}", p.stat().st_size, p.stat().st_mtime_ns, False) for p in paths)


def test_blob_hash_depends_on_content_only(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("one")
    b.write_text("two")
    digest, length = tar_digest(entries_of([a, b]))
    assert length % 10240 == 0  # whole tar records
    os.utime(a, (1, 1))
    os.chmod(b, 0o600)
    assert tar_digest(entries_of([b, a]))[0] == digest  # times, permissions and order do not count
    a.write_text("One")
    assert tar_digest(entries_of([a, b]))[0] != digest


def test_size_limit_is_checked_before_anything_is_read_or_uploaded(site, tmp_path):
    write_dist(site, "huge-model-zoo", "0.1", {"zoo/weights.bin": b"\0" * 200_000})
    store = tmp_path / "store"
    snapshot = snapshot_environment(paths=[str(site)])
    with pytest.raises(EnvironmentTooLargeError) as err:
        stage_snapshot(snapshot, str(store), size_limit=100_000)
    message = str(err.value)
    assert "over the 100.00 kB limit" in message and "SPARKGPU_ENV_SIZE_LIMIT" in message
    listed = message.split("Largest parts:\n")[1].splitlines()
    assert listed[0].strip().startswith("huge-model-zoo 0.1") and listed[1].strip().startswith("alpha 1.0")
    assert "exclude=['huge-model-zoo', 'alpha', 'beta']" in message
    assert not store.exists()


def test_size_limit_comes_from_the_setting(site, monkeypatch):
    monkeypatch.setenv("SPARKGPU_ENV_SIZE_LIMIT", "1KB")
    from sparkgpu.config import reset_settings

    reset_settings()
    with pytest.raises(EnvironmentTooLargeError, match="over the 1.00 kB limit"):
        stage_environment(paths=[str(site)])


def test_second_stage_uploads_nothing_even_without_the_pack_index(site, tmp_path):
    store = BlobStore(tmp_path / "store")
    first = stage_snapshot(snapshot_environment(paths=[str(site)]), store)
    assert sorted(first.report.uploaded) == ["alpha", "beta"]
    assert first.report.step("hash").items == 0  # an empty store: hashed while uploading, read once
    assert first.report.uploaded_bytes == first.report.step("upload").bytes + first.report.step("manifest").bytes > 0
    second = stage_snapshot(snapshot_environment(paths=[str(site)]), store)
    assert second.report.uploaded_bytes == 0 and second.report.uploaded == ()
    assert second.report.skipped_bytes == first.report.step("upload").bytes
    assert second.report.step("hash").items == 2  # re-read and re-hashed: no pack index given
    assert second.manifest == first.manifest and second.manifest_name == first.manifest_name


def test_pack_index_skips_reading_unchanged_files(site, tmp_path):
    store, index = tmp_path / "store", tmp_path / "pack-index.json"
    stage_snapshot(snapshot_environment(paths=[str(site)]), str(store), pack_index=index)
    again = stage_snapshot(snapshot_environment(paths=[str(site)]), str(store), pack_index=index)
    assert again.report.step("hash").items == 0 and again.report.step("hash").bytes == 0
    assert again.report.step("index").items == 2 and again.report.uploaded_bytes == 0


def test_only_what_changed_is_uploaded(site, tmp_path):
    store, index = tmp_path / "store", tmp_path / "pack-index.json"
    first = stage_snapshot(snapshot_environment(paths=[str(site)]), str(store), pack_index=index)
    write_dist(site, "gamma", "0.5", {"gamma.py": "Z = 3\n"})
    (site / "beta.py").write_text("Y = 20\n")  # an edited install: same version, new content
    second = stage_snapshot(snapshot_environment(paths=[str(site)]), str(store), pack_index=index)
    assert sorted(second.report.uploaded) == ["beta", "gamma"]
    hashes = {e["name"]: e["hash"] for e in second.manifest["entries"]}
    assert hashes["alpha"] == {e["name"]: e["hash"] for e in first.manifest["entries"]}["alpha"]
    assert second.report.step("upload").items == 2


def test_a_file_changed_after_hashing_is_stored_under_its_real_hash(site, tmp_path):
    store, index = tmp_path / "other-store", tmp_path / "pack-index.json"
    stage_snapshot(snapshot_environment(paths=[str(site)]), str(tmp_path / "store"), pack_index=index)
    beta = site / "beta.py"
    stat = beta.stat()
    beta.write_text("Y = 9\n")  # same size and mtime: the pack index still trusts its old hash
    os.utime(beta, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    staged = stage_snapshot(snapshot_environment(paths=[str(site)]), str(store), pack_index=index)
    overlay = hydrate_environment(staged.manifest, tmp_path / "cache", installed={})
    assert (
        open(os.path.join(overlay.view, "beta.py")).read() == "Y = 9\n"
    )  # fetched and verified against the hash of what was uploaded


def test_gzip_blobs_round_trip(site, tmp_path):
    staged = stage_snapshot(snapshot_environment(paths=[str(site)]), str(tmp_path / "store"), compression="gzip")
    assert all(e["object"].endswith(".tar.gz") for e in staged.manifest["entries"])
    overlay = hydrate_environment(staged.manifest, tmp_path / "cache", installed={})
    assert open(os.path.join(overlay.view, "alpha", "__init__.py")).read() == "X = 1\n"
    with pytest.raises(ConfigurationError, match="compression='zstd'"):
        stage_snapshot(snapshot_environment(paths=[str(site)]), str(tmp_path / "store"), compression="zstd")


def test_stage_environment_reads_its_defaults_from_settings(site, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKGPU_ENV_EXCLUDE", "beta")
    from sparkgpu.config import reset_settings, settings

    reset_settings()
    staged = stage_environment(paths=[str(site)])
    assert staged.manifest["store"] == settings().env_store and os.path.isdir(settings().env_store)
    assert [e["name"] for e in staged.manifest["entries"]] == ["alpha"]
    assert (settings().home / "env" / "pack-index.json").is_file()
    assert staged.lock.splitlines()[1:] == ["alpha==1.0", "beta==2.0"]
    assert "uploaded" in str(staged.report) and staged.report.to_dict()["steps"][0]["name"] == "scan"


def test_files_edited_or_deleted_during_staging_go_in_as_they_are_then(site, tmp_path):
    snapshot = snapshot_environment(paths=[str(site)])
    (site / "beta.py").write_text("Y = 'a longer edit made while staging'\n")
    (site / "alpha" / "table.bin").unlink()
    staged = stage_snapshot(snapshot, str(tmp_path / "store"))
    overlay = hydrate_environment(staged.manifest, tmp_path / "cache", installed={})
    assert open(os.path.join(overlay.view, "beta.py")).read() == "Y = 'a longer edit made while staging'\n"
    assert not os.path.exists(os.path.join(overlay.view, "alpha", "table.bin"))
