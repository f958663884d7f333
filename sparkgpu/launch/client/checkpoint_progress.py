"""How far a job's checkpoints got, read back on the client.

The supervisor asks before and after an attempt: a capped attempt that committed a new
checkpoint counts as preempted (it resumes, using no restart), and a restart says from which
step it starts.
"""

from __future__ import annotations

from sparkgpu.rundir.keyring import derive_key
from sparkgpu._util.report import report
from sparkgpu.store import Store
from sparkgpu.train import sealed_files
from sparkgpu.train.checkpoint_directory import CheckpointDirectory, SigningKey

__all__ = ["latest_checkpoint", "restart_point"]


def latest_checkpoint(directory: str, key: bytes, job_id: str, out=None) -> tuple[int, float] | None:
    """``(step, created)`` of the newest complete checkpoint in the job's checkpoint dir:
    a Checkpointer's, or a Trainer's sealed one (``created`` 0 for those); ``None`` when there is
    none, or it cannot be read (said on ``out``)."""
    try:
        # Only markers sealed under this job's key count: a planted one would make a capped
        # attempt pass for a preemption, which uses up no restart.
        signing = SigningKey(derive_key(key, "checkpoints"), job_id)
        info = CheckpointDirectory(directory, key=signing).latest()
        store = Store(directory, what="the job's checkpoint store")
        sealed = sealed_files.latest_sealed(store.child(sealed_files.TRAINER_FOLDER), signing)
    except Exception as exc:  # unreadable (permissions, a store that is down: fsspec raises its own types)
        report(
            f"cannot read the checkpoints in {directory} ({exc}); an attempt stopped "
            "at the runtime cap counts as preempted only if its ranks stop for a restart",
            out,
        )
        return None
    found = [] if info is None else [(info.step, info.created)]
    if sealed is not None:
        found.append((sealed[0], 0.0))
    return max(found) if found else None


def restart_point(latest: tuple[int, float] | None) -> str:
    """Where the next attempt starts, for the restart message: the step of the newest checkpoint."""
    return "from the start: no checkpoint" if latest is None else f"from step {latest[0]}"
