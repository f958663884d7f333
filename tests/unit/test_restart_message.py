"""The client's restart message names where the next attempt starts: a step, or the start."""

from __future__ import annotations


import blake3

from sparkgpu.rundir.keyring import derive_key
from sparkgpu.store import Store
from sparkgpu.train import sealed_files
from sparkgpu.train.checkpoint_directory import SigningKey
from tests.unit.test_supervisor import run_job


def _seal(checkpoints, step: int, key: bytes) -> None:
    store = Store(checkpoints).child(sealed_files.TRAINER_FOLDER)
    name = sealed_files.sealed_name(step)
    store.write_bytes(f"{name}/trainer_state.json", b"{}")
    files = {"trainer_state.json": (2, "blake3:" + blake3.blake3(b"{}").hexdigest())}
    sealed_files.write_marker(store, name, step, files, SigningKey(key, "job-1"))


def test_with_no_checkpoint_the_message_says_from_the_start(tmp_path):
    sup, _, _, _, out = run_job(tmp_path, ["segv", "ok"], max_restarts=1)
    sup.run()
    assert (
        "attempt 0 failed (native_crash: the process died from SIGSEGV); restarting from the start: no checkpoint "
        "(restart 1 of 1)" in out.getvalue()
    )


def test_a_trainers_sealed_checkpoint_is_named_and_a_forged_one_is_not(tmp_path):
    sup, _, _, rd, out = run_job(tmp_path, ["segv", "ok"], max_restarts=1)
    _seal(rd.checkpoints, 7, derive_key(b"k" * 32, "checkpoints"))
    _seal(rd.checkpoints, 99, b"someone else's key".ljust(32, b"!"))
    sup.run()
    assert "restarting from step 7 (restart 1 of 1)" in out.getvalue()
