"""Lightning checkpoints in a job are signed: a planted or changed one is never unpickled.

Each forgery carries a payload that creates a file when it is unpickled; the tests assert
that the file never appears.
"""

from __future__ import annotations

import json
import logging
import os
import pickle

import pytest
import torch

from sparkgpu.rundir.keyring import hold_job_key
from sparkgpu.errors import CheckpointError

pytest.importorskip("lightning")

from sparkgpu.train.lightning import SignedCheckpointIO, latest_checkpoint_path  # noqa: E402

JOB = "fit-20260101-120000-a1b2c3"


class Planted:
    """Unpickling it creates ``path``: the proof that a forgery was unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.makedirs, (self.path,))


@pytest.fixture
def job_store(tmp_path, monkeypatch):
    """This process as a rank of job JOB, its checkpoint store in tmp_path."""
    monkeypatch.setenv("SPARKGPU_JOB_ID", JOB)
    monkeypatch.setenv("SPARKGPU_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))
    hold_job_key(bytes(range(32)))
    yield tmp_path / "checkpoints" / "lightning"
    hold_job_key(None)


def save(folder, step: int) -> str:
    path = str(folder / f"step-{step:010d}.ckpt")
    SignedCheckpointIO().save_checkpoint(
        {"global_step": step, "state_dict": {"w": torch.full((3,), float(step))}}, path
    )
    return path


def plant(path: str, sentinel) -> bytes:
    """Replaces the checkpoint at ``path`` with a pickle that creates ``sentinel`` when loaded."""
    data = pickle.dumps(Planted(sentinel))
    with open(path, "wb") as f:
        f.write(data)
    return data


def test_a_saved_checkpoint_loads_back_and_its_marker_is_signed_by_the_job(job_store):
    path = save(job_store, 3)
    marker = json.loads(open(path + ".signed.json").read())
    assert marker["signed"]["job_id"] == JOB and len(marker["mac"]) == 64
    assert torch.equal(SignedCheckpointIO().load_checkpoint(path)["state_dict"]["w"], torch.full((3,), 3.0))
    assert latest_checkpoint_path() == path


def test_a_changed_checkpoint_is_refused_and_the_newest_genuine_one_is_resumed(job_store, tmp_path, caplog):
    older, newer = save(job_store, 3), save(job_store, 6)
    plant(newer, tmp_path / "ran")
    with pytest.raises(CheckpointError, match="differs from the hash in its marker.*nothing of it was unpickled"):
        SignedCheckpointIO().load_checkpoint(newer)
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint_path() == older
    assert "skipping a checkpoint" in caplog.text and not (tmp_path / "ran").exists()


def test_a_planted_checkpoint_with_an_unsigned_or_foreign_marker_is_refused(job_store, tmp_path):
    import hashlib

    path = save(job_store, 3)
    data = plant(path, tmp_path / "ran")
    marker = json.loads(open(path + ".signed.json").read())
    marker["signed"]["files"] = {
        os.path.basename(path): {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    }
    for forged, why in (
        (dict(marker, mac="0" * 64), "does not match the job's key"),
        (
            {k: v for k, v in marker.items() if k != "mac"} | {"signed": dict(marker["signed"], job_id=None)},
            "not signed",
        ),
    ):
        with open(path + ".signed.json", "w") as f:
            json.dump(forged, f)
        with pytest.raises(CheckpointError, match=why):
            SignedCheckpointIO().load_checkpoint(path)
    assert latest_checkpoint_path() is None and not (tmp_path / "ran").exists()


def test_in_the_job_store_a_checkpoint_without_marker_is_refused_elsewhere_it_loads_as_lightning_does(
    job_store, tmp_path
):
    job_store.mkdir(parents=True)
    inside = str(job_store / "step-0000000001.ckpt")
    plant(inside, tmp_path / "ran")
    with pytest.raises(CheckpointError, match="no marker.*did not finish"):
        SignedCheckpointIO().load_checkpoint(inside)
    assert not (tmp_path / "ran").exists()
    own = tmp_path / "pretrained.ckpt"
    torch.save({"global_step": 0, "state_dict": {}}, own)  # the user's own file, passed as ckpt_path
    assert SignedCheckpointIO().load_checkpoint(str(own))["global_step"] == 0
