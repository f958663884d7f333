"""Signed checkpoints: a planted or changed checkpoint is never unpickled where a key applies.

Each forgery carries a payload that creates a file when it is unpickled; the tests assert that
the file never appears. One control test shows the payload does run where checkpoints are
trusted (no key), so its absence elsewhere means something.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import pickle
import shutil

import blake3
import pytest
import torch
from torch import nn

from sparkgpu.rundir.keyring import derive_key, hold_job_key, save_key
from sparkgpu.errors import CheckpointError
from sparkgpu.tracking._checkpoints import committed_checkpoint, load_checkpoint_into
from sparkgpu.train import Checkpointer, latest_checkpoint, list_checkpoints
from sparkgpu.train._checkpoint_signing import (
    _MARKER_DOMAIN,
    Manifest,
    _mac,
    check_app_blob,
    sign_marker,
    verify_marker,
    weights_only_planner,
)
from sparkgpu.train.checkpoint_directory import MARKER_NAME, CheckpointDirectory

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

JOB = "train-20250101-120000-a1b2c3"
KEY = bytes(range(32))


class _Planted:
    """Unpickles as ``open(path, "w")``: the file appears if anything unpickles it."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


class PlantedState:
    """A stateful object whose saved state carries the payload."""

    def __init__(self, sentinel):
        self.sentinel = sentinel

    def state_dict(self):
        return {"position": _Planted(self.sentinel)}

    def load_state_dict(self, state):
        pass


class Loader:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def training(seed=0):
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    return dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loader=Loader())


@contextlib.contextmanager
def rank_of_job(directory=None, key=KEY, job=JOB):
    """This process as a rank of ``job``: its key held, its id and checkpoint directory set,
    as the entrypoint leaves them before the training function runs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPARKGPU_JOB_ID", job)
        if directory is not None:
            mp.setenv("SPARKGPU_CHECKPOINT_DIR", str(directory))
        hold_job_key(key)
        try:
            yield
        finally:
            hold_job_key(None)


def save_steps(directory, steps, **state):
    ckpt = Checkpointer(directory, keep_last=None, handle_sigterm=False)
    state = state or training()
    for step in steps:
        state["loader"].position = step + 1
        ckpt.save(step, wait=True, **state)
    ckpt.close()
    return state


def forge(directory, step, sentinel):
    """An attacker's checkpoint: unsigned, its app state carrying the payload."""
    state = training(1)
    state["loader"] = PlantedState(sentinel)
    save_steps(directory, [step], **state)
    return directory / f"step-{step:010d}"


def restore(directory, step=None):
    state = training(7)
    ckpt = Checkpointer(directory, handle_sigterm=False)
    try:
        return ckpt.restore(step=step, **state), state
    finally:
        ckpt.close()


def marker_of(path):
    return json.loads((path / MARKER_NAME).read_text())


def files_in(path):
    return {
        name: "blake3:" + blake3.blake3((path / name).read_bytes()).hexdigest()
        for name in os.listdir(path)
        if name != MARKER_NAME and not name.startswith("_FILES.")
    }


# -- what a signed marker holds --------------------------------------------------------


def test_a_marker_lists_every_file_with_its_blake3_digest_under_a_mac(tmp_path):
    directory = tmp_path / JOB / "checkpoints"
    with rank_of_job(directory):
        save_steps(directory, [1])
    path = directory / "step-0000000001"
    data = marker_of(path)

    listed = data["signed"]["files"]
    assert {name: entry["digest"] for name, entry in listed.items()} == files_in(path)
    assert {name: entry["size"] for name, entry in listed.items()} == {
        name: (path / name).stat().st_size for name in listed
    }
    assert set(listed) == {".metadata", "__0_0.distcp"}
    assert data["signed"]["job_id"] == JOB and set(data["signed"]["app_digests"]) == {"rank0"}

    key = derive_key(KEY, "checkpoints")
    assert verify_marker(data, key).files["__0_0.distcp"] == (
        listed["__0_0.distcp"]["size"],
        files_in(path)["__0_0.distcp"],
    )
    for changed in ({**data, "step": 9}, {**data, "signed": {**data["signed"], "job_id": "other"}}):
        with pytest.raises(CheckpointError, match="does not match the job's key"):
            verify_marker(changed, key)
    with pytest.raises(CheckpointError, match="does not match the job's key"):
        verify_marker(data, derive_key(b"another job's key".ljust(32), "checkpoints"))
    with pytest.raises(CheckpointError, match="not signed"):
        verify_marker({k: v for k, v in data.items() if k != "mac"}, key)


def _resigned(path, signed):
    """The marker of ``path`` with ``signed`` as its file list, signed with the job's key."""
    data = {k: v for k, v in marker_of(path).items() if k not in ("mac", "signed")}
    data = {**data, "signed": signed}
    data["mac"] = _mac(derive_key(KEY, "checkpoints"), _MARKER_DOMAIN, data)
    (path / MARKER_NAME).write_text(json.dumps(data))


def test_a_checkpoint_signed_with_sha256_digests_by_an_earlier_version_restores_and_is_still_checked(
    tmp_path, monkeypatch
):
    from sparkgpu.train import _digests

    directory = tmp_path / JOB / "checkpoints"
    with rank_of_job(directory):
        monkeypatch.setattr(_digests, "ALGORITHM", "sha256")  # hashed as an earlier version did
        saved = save_steps(directory, [3])
        monkeypatch.undo()
        path = directory / "step-0000000003"
        signed = marker_of(path)["signed"]
        bare = {name: entry["digest"].removeprefix("sha256:") for name, entry in signed["files"].items()}
        assert bare == {name: hashlib.sha256((path / name).read_bytes()).hexdigest() for name in bare}
        # The earlier marker's shape: bare hex digests, named by their key.
        older = {
            "files": {name: {"size": entry["size"], "sha256": bare[name]} for name, entry in signed["files"].items()},
            "app_sha256": {rank: digest.removeprefix("sha256:") for rank, digest in signed["app_digests"].items()},
            "job_id": JOB,
        }
        _resigned(path, older)
        steps, state = restore(directory)
        assert steps == 4 and state["loader"].position == saved["loader"].position

        data = (path / "__0_0.distcp").read_bytes()
        (path / "__0_0.distcp").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        with pytest.raises(CheckpointError, match="__0_0.distcp differs from its signed hash"):
            restore(directory, step=3)


def test_a_digest_of_an_unknown_algorithm_is_refused_even_under_a_valid_mac(tmp_path):
    directory = tmp_path / JOB / "checkpoints"
    with rank_of_job(directory):
        save_steps(directory, [3])
        path = directory / "step-0000000003"
        signed = marker_of(path)["signed"]
        entry = signed["files"]["__0_0.distcp"]
        signed["files"]["__0_0.distcp"] = {**entry, "digest": "md5:" + entry["digest"].partition(":")[2]}
        _resigned(path, signed)
        with pytest.raises(CheckpointError, match="signed file list cannot be read"):
            restore(directory, step=3)


def test_outside_a_job_checkpoints_are_written_and_restored_unsigned(tmp_path):
    saved = save_steps(tmp_path, [2])
    path = tmp_path / "step-0000000002"
    assert "mac" not in marker_of(path) and "signed" not in marker_of(path)
    assert not [name for name in os.listdir(path) if name.startswith("_FILES.")]
    steps, state = restore(tmp_path)
    assert steps == 3 and state["loader"].position == saved["loader"].position


def test_the_planted_payload_runs_where_checkpoints_are_trusted(tmp_path):
    """The control: without a key nothing is verified, and the forgery's payload runs."""
    sentinel = tmp_path / "pwned"
    forge(tmp_path / "forged", 9, sentinel)
    restore(tmp_path / "forged")
    assert sentinel.exists()


# -- a rank restores only what its job signed -----------------------------------------


def _plant(directory, forgery, sentinel, tmp_path) -> int:
    """Plants ``forgery`` among the job's checkpoints of steps 1 and 3; returns its step."""
    if forgery in ("unsigned", "signed_by_another_key"):
        planted = directory / "step-0000000009"
        shutil.copytree(forge(tmp_path / "forged", 9, sentinel), planted)
        if forgery == "signed_by_another_key":
            data = marker_of(planted)
            files = {name: ((planted / name).stat().st_size, sha) for name, sha in files_in(planted).items()}
            manifest = Manifest(files=files, app_digests={}, job_id=JOB)
            data = sign_marker(data, manifest, derive_key(b"another job's key".ljust(32), "checkpoints"))
            (planted / MARKER_NAME).write_text(json.dumps(data))
        return 9
    genuine = directory / "step-0000000003"
    if forgery == "changed_metadata":
        (genuine / ".metadata").write_bytes(pickle.dumps(_Planted(sentinel)))
    else:  # changed_data: the forgery's files under the genuine marker
        forged = forge(tmp_path / "forged", 3, sentinel)
        for name in (".metadata", "__0_0.distcp"):
            shutil.copyfile(forged / name, genuine / name)
    return 3


@pytest.mark.parametrize("forgery", ["unsigned", "signed_by_another_key", "changed_metadata", "changed_data"])
def test_a_rank_skips_a_forged_checkpoint_for_the_newest_genuine_one_and_runs_none_of_it(tmp_path, caplog, forgery):
    directory = tmp_path / JOB / "checkpoints"
    sentinel = tmp_path / "pwned"
    with rank_of_job(directory):
        save_steps(directory, [1, 3])
    planted = _plant(directory, forgery, sentinel, tmp_path)

    with rank_of_job(directory), caplog.at_level(logging.WARNING, logger="sparkgpu.train"):
        steps, state = restore(directory)
        newest_genuine = 1 if planted == 3 else 3
        assert steps == newest_genuine + 1 and state["loader"].position == newest_genuine + 1
        assert f"ignoring checkpoint {directory}/step-{planted:010d}" in caplog.text
        with pytest.raises(CheckpointError, match=f"step-{planted:010d}' is refused: .*nothing of it was loaded"):
            restore(directory, step=planted)
        if planted == 9:
            assert [info.step for info in list_checkpoints(directory)] == [1, 3]
    assert not sentinel.exists(), "the forged checkpoint's code ran"


def test_inside_a_job_an_unsigned_checkpoint_is_never_restored(tmp_path):
    save_steps(tmp_path, [4])  # outside a job: unsigned
    with rank_of_job(tmp_path / JOB / "checkpoints"):
        assert restore(tmp_path)[0] == 0
        with pytest.raises(CheckpointError, match="is refused: its completion marker is not signed"):
            restore(tmp_path, step=4)


def test_a_metadata_file_changed_after_its_check_is_refused_as_it_is_read(tmp_path, monkeypatch):
    """The files are hashed, then read again by DCP: what it unpickles is checked as it reads."""
    directory = tmp_path / JOB / "checkpoints"
    sentinel = tmp_path / "pwned"
    with rank_of_job(directory):
        save_steps(directory, [1, 3])
        monkeypatch.setattr(CheckpointDirectory, "check_files", lambda self, *args: [])  # changed after the check
        (directory / "step-0000000003" / ".metadata").write_bytes(pickle.dumps(_Planted(sentinel)))
        with pytest.raises(CheckpointError, match=r"\.metadata differs from its signed hash"):
            restore(directory, step=3)
    assert not sentinel.exists()


def test_an_app_state_that_differs_from_its_signed_hash_is_not_unpickled(tmp_path):
    directory = tmp_path / JOB / "checkpoints"
    with rank_of_job(directory):
        save_steps(directory, [3])
        path = directory / "step-0000000003"
        data = marker_of(path)
        data["signed"]["app_digests"]["rank0"] = "blake3:" + blake3.blake3(b"another state").hexdigest()
        data = sign_marker(
            {k: v for k, v in data.items() if k not in ("mac", "signed")},
            Manifest.from_json(data["signed"]),
            derive_key(KEY, "checkpoints"),
        )
        (path / MARKER_NAME).write_text(json.dumps(data))
        with pytest.raises(CheckpointError, match="rank0 training state differs from its signed hash"):
            restore(directory, step=3)


def test_dcp_byte_items_are_unpickled_weights_only(tmp_path):
    sentinel = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save(_Planted(sentinel), buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        weights_only_planner().load_bytes(None, buffer)
    assert not sentinel.exists()
    with pytest.raises(CheckpointError, match="differs from its signed hash"):
        check_app_blob(
            Manifest(files={}, app_digests={"rank0": "blake3:" + blake3.blake3(b"a").hexdigest()}), "rank0", b"b", "p"
        )


def test_signed_checkpoints_on_an_fsspec_url(tmp_path):
    import fsspec

    url = f"memory://signed-{os.getpid()}/{JOB}/checkpoints"
    sentinel = tmp_path / "pwned"
    try:
        with rank_of_job(url):
            save_steps(url, [1, 3])
            fs = fsspec.filesystem("memory")
            root = url[len("memory://") :]
            fs.pipe_file(f"{root}/step-0000000003/.metadata", pickle.dumps(_Planted(sentinel)))
            assert restore(url)[0] == 2
            with pytest.raises(CheckpointError, match="differs from its signed hash"):
                restore(url, step=3)
    finally:
        fsspec.filesystem("memory").rm(f"/signed-{os.getpid()}", recursive=True)
    assert not sentinel.exists()


# -- the client: register and load_checkpoint_into -------------------------------------


def _job_checkpoints(tmp_path):
    """Steps 1 and 3 saved by a rank of JOB, whose key this user's keyring holds."""
    save_key(JOB, KEY)
    directory = tmp_path / JOB / "checkpoints"
    with rank_of_job(directory):
        state = save_steps(directory, [1, 3])
    return directory, state


def test_the_client_loads_a_job_checkpoint_verified_with_the_key_in_its_keyring(tmp_path):
    directory, state = _job_checkpoints(tmp_path)
    path = str(directory / "step-0000000003")
    assert committed_checkpoint(path).step == 3
    loaded = load_checkpoint_into(nn.Linear(4, 2), path)
    assert torch.equal(loaded.weight, state["model"].weight)


def test_the_client_refuses_a_forged_job_checkpoint_before_unpickling_it(tmp_path):
    directory, _ = _job_checkpoints(tmp_path)
    sentinel = tmp_path / "pwned"
    shutil.copytree(forge(tmp_path / "forged", 9, sentinel), directory / "step-0000000009")
    assert latest_checkpoint(directory).step == 3  # the forged one is not a checkpoint of the job
    with pytest.raises(CheckpointError, match="step-0000000009' is refused: its completion marker is not signed"):
        committed_checkpoint(str(directory / "step-0000000009"))
    with pytest.raises(CheckpointError, match="is refused"):
        load_checkpoint_into(nn.Linear(4, 2), str(directory / "step-0000000009"))

    genuine = directory / "step-0000000003"
    (genuine / ".metadata").write_bytes(pickle.dumps(_Planted(sentinel)))
    assert committed_checkpoint(str(genuine)).step == 3  # the marker is genuine; loading checks the files
    with pytest.raises(CheckpointError, match=r"\.metadata differs from its signed hash"):
        load_checkpoint_into(nn.Linear(4, 2), str(genuine))
    assert not sentinel.exists()


def test_a_job_checkpoint_is_refused_where_its_key_is_not(tmp_path):
    directory = tmp_path / "elsewhere"
    with rank_of_job(tmp_path / JOB / "checkpoints"):  # a rank of JOB saving into a directory of its own
        save_steps(directory, [3])
    with pytest.raises(CheckpointError, match=f"signed by job '{JOB}', whose key is not on this machine"):
        committed_checkpoint(str(directory / "step-0000000003"))


def test_an_unmarked_directory_in_a_jobs_checkpoints_is_not_loaded(tmp_path):
    import torch.distributed.checkpoint as dcp

    directory, _ = _job_checkpoints(tmp_path)
    flat = directory / "step-0000000009"
    dcp.save({"model": nn.Linear(4, 2).state_dict()}, checkpoint_id=str(flat), no_dist=True)
    with pytest.raises(CheckpointError, match="no completion marker, and lies in a job's checkpoint directory"):
        load_checkpoint_into(nn.Linear(4, 2), str(flat))
    # Elsewhere, a plain DCP directory loads as before.
    shutil.copytree(flat, tmp_path / "plain")
    load_checkpoint_into(nn.Linear(4, 2), str(tmp_path / "plain"))
