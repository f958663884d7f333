"""Folders sealed into a job's checkpoint store: a writer of the store can neither plant nor change one."""

from __future__ import annotations

import json
import os

import pytest

from sparkgpu.errors import CheckpointError
from sparkgpu.store import Store
from sparkgpu.train import sealed_files
from sparkgpu.train.checkpoint_directory import SigningKey

KEY = SigningKey(b"k" * 32, "job-1")


def _seal(tmp_path, step=3):
    src = tmp_path / "out" / f"checkpoint-{step}"
    (src / "sub").mkdir(parents=True)
    (src / "optimizer.pt").write_bytes(b"optimizer" * 1000)
    (src / "sub" / "adapter.safetensors").write_bytes(b"adapter")
    store = Store(tmp_path / "store")
    name = sealed_files.sealed_name(step)
    files = {
        rel: sealed_files.copy_hashed(src / rel, store, f"{name}/{rel}")
        for rel in ("optimizer.pt", "sub/adapter.safetensors")
    }
    sealed_files.write_marker(store, name, step, files, KEY)
    return store, name


def test_a_sealed_folder_restores_file_for_file(tmp_path):
    store, name = _seal(tmp_path)
    step, files = sealed_files.read_marker(store, name, KEY)
    sealed_files.restore_folder(store, name, files, tmp_path / "local" / name)
    assert step == 3
    assert (tmp_path / "local" / name / "sub" / "adapter.safetensors").read_bytes() == b"adapter"
    assert sealed_files.latest_sealed(store, KEY)[:2] == (3, name)


def test_another_key_an_unsigned_or_edited_seal_is_refused(tmp_path):
    store, name = _seal(tmp_path)
    with pytest.raises(CheckpointError, match="does not match"):
        sealed_files.read_marker(store, name, SigningKey(b"x" * 32, "job-1"))
    marker = tmp_path / "store" / name / sealed_files.SEALED_MARKER
    data = json.loads(marker.read_text())
    data["signed"]["files"]["optimizer.pt"]["size"] += 1
    marker.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="does not match"):
        sealed_files.read_marker(store, name, KEY)
    data.pop("mac")
    marker.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="not signed"):
        sealed_files.read_marker(store, name, KEY)
    assert sealed_files.latest_sealed(store, KEY) is None


def test_a_changed_or_missing_file_fails_the_restore_and_leaves_nothing(tmp_path):
    store, name = _seal(tmp_path)
    _, files = sealed_files.read_marker(store, name, KEY)
    (tmp_path / "store" / name / "optimizer.pt").write_bytes(b"planted pickle")
    local = tmp_path / "local" / name
    with pytest.raises(CheckpointError, match="differs"):
        sealed_files.restore_folder(store, name, files, local)
    assert not local.exists() and os.listdir(tmp_path / "local") == []
    (tmp_path / "store" / name / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        sealed_files.restore_folder(store, name, files, local)


def test_a_seal_that_names_another_step_or_a_path_outside_is_refused(tmp_path):
    store, name = _seal(tmp_path)
    os.rename(tmp_path / "store" / name, tmp_path / "store" / "checkpoint-99")
    with pytest.raises(CheckpointError, match="another step"):
        sealed_files.read_marker(store, "checkpoint-99", KEY)
    sealed_files.write_marker(store, "checkpoint-5", 5, {"../escape": (1, "blake3:" + "0" * 64)}, KEY)
    with pytest.raises(CheckpointError, match="bad entry"):
        sealed_files.read_marker(store, "checkpoint-5", KEY)


def test_a_sealed_copy_outlives_the_trainers_rotation_and_a_change_in_the_store_is_caught(tmp_path):
    src = tmp_path / "out" / "checkpoint-4"
    src.mkdir(parents=True)
    (src / "optimizer.pt").write_bytes(b"state")
    store = Store(tmp_path / "store", durable=False)
    files = {"optimizer.pt": sealed_files.copy_hashed(src / "optimizer.pt", store, "checkpoint-4/optimizer.pt")}
    sealed_files.write_marker(store, "checkpoint-4", 4, files, KEY)
    assert not os.path.samefile(src / "optimizer.pt", tmp_path / "store" / "checkpoint-4" / "optimizer.pt")
    (src / "optimizer.pt").unlink()  # the Trainer's rotation
    _, listed = sealed_files.read_marker(store, "checkpoint-4", KEY)
    sealed_files.restore_folder(store, "checkpoint-4", listed, tmp_path / "restored")
    assert (tmp_path / "restored" / "optimizer.pt").read_bytes() == b"state"
    (tmp_path / "store" / "checkpoint-4" / "optimizer.pt").write_bytes(b"STATE")
    with pytest.raises(CheckpointError, match="differs"):
        sealed_files.restore_folder(store, "checkpoint-4", listed, tmp_path / "restored")
