"""Model weights from ``torch.distributed.checkpoint`` directories, and whether a save of them finished.

A checkpoint that belongs to a job (it lies in the job's checkpoint directory, or its
marker names the job) is loaded only once verified with the job's key, from this user's
keyring on the client or the rank's own in a job: its marker's signature, then the files the
model is read from, before anything is unpickled (``sparkgpu.train.checkpoint_directory``).
Other checkpoints, and plain DCP directories elsewhere, load unverified: they come from
directories the caller trusts.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from sparkgpu.errors import CheckpointError

__all__ = ["load_checkpoint_into", "committed_checkpoint"]


def load_checkpoint_into(model, checkpoint: str, key: str | None = None):
    """Loads a ``torch.distributed.checkpoint`` directory into ``model`` (in place).

    The whole model is loaded in this process, whatever the number of ranks that saved it
    (DCP reshards on load), and without a collective, so rank 0 alone may call it in a job.

    Args:
        model: The ``torch.nn.Module`` to fill.
        checkpoint: Directory (or fsspec URL) of a complete DCP checkpoint.
        key: Entry of the checkpoint that holds the model's state dict; by default
            ``"model"`` when the checkpoint has one, else the top level.

    Returns:
        ``model``.

    Raises:
        CheckpointError: the directory is not a complete checkpoint or lacks the model's keys;
            or it belongs to a job and is not signed with that job's key, that key is not on
            this machine, or a file it is read from changed since it was signed.
    """
    import torch.distributed.checkpoint as dcp

    from sparkgpu.train.checkpoint_directory import (
        check_checkpoint_files,
        open_checkpoint,
        reader_for,
        refusal_of,
        unmarked_in_job,
        weights_only_planner,
    )

    checkpoint = str(checkpoint)
    remote = "://" in checkpoint and not checkpoint.startswith("file://")
    local = checkpoint[len("file://") :] if checkpoint.startswith("file://") else checkpoint
    if not remote and not (Path(local) / ".metadata").is_file():
        raise CheckpointError(
            f"{checkpoint} is not a complete torch.distributed.checkpoint directory (no .metadata file); "
            "pass the directory of a committed checkpoint"
        )
    found = open_checkpoint(checkpoint)  # verifies its marker where a key applies
    if found is None and unmarked_in_job(checkpoint):
        raise CheckpointError(
            f"{checkpoint} has no completion marker, and lies in a job's checkpoint directory, where only "
            "checkpoints signed by the job are loaded: its save did not finish, or the job did not write it. "
            "Pass a complete checkpoint: sparkgpu.train.latest_checkpoint(<checkpoint directory>).path"
        )
    manifest = found.manifest if found is not None else None
    reader = reader_for(checkpoint, manifest)
    try:
        metadata = reader.read_metadata()  # with a manifest, its bytes are checked before unpickling
    except Exception as exc:
        raise refusal_of(reader) or CheckpointError(
            f"cannot read the checkpoint metadata of {checkpoint}: {exc}"
        ) from exc
    stored_keys = list(metadata.state_dict_metadata)
    if key is None:
        key = "model" if any(k.startswith("model.") for k in stored_keys) else ""
    state = model.state_dict()
    wanted = {key: state} if key else state
    prefix = f"{key}." if key else ""
    missing = [k for k in state if prefix + k not in stored_keys]
    if missing:
        sample = ", ".join(sorted(stored_keys)[:8])
        raise CheckpointError(
            f"checkpoint {checkpoint} has no entries for {len(missing)} of the model's keys (first: "
            f"{prefix + missing[0]!r}); it holds {sample}{' ...' if len(stored_keys) > 8 else ''}. "
            "Pass the model class that was trained, or checkpoint_key= naming the entry with its state dict."
        )
    if found is not None and manifest is not None:
        wanted_keys = {prefix + k for k in state}
        needed = {where.relative_path for index, where in metadata.storage_data.items() if index.fqn in wanted_keys}
        check_checkpoint_files(found, needed)  # hashed whole before DCP reads (and unpickles) from them
    with warnings.catch_warnings():
        # One process loads the whole model, also on rank 0 of a running job (no collective).
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(
                wanted,
                storage_reader=reader,
                planner=weights_only_planner() if manifest is not None else None,
                no_dist=True,
            )
        except BaseException as exc:
            refusal = refusal_of(reader)
            if refusal is not None:
                raise refusal from exc
            raise
    model.load_state_dict(state)
    return model


def committed_checkpoint(checkpoint: str):
    """The completion marker of a checkpoint saved by ``sparkgpu.train.Checkpointer``.

    Args:
        checkpoint: Directory (or fsspec URL) of one checkpoint (``.../step-0000000900``).

    Returns:
        Its :class:`~sparkgpu.train.CheckpointInfo` (step, world size, ...).

    Raises:
        CheckpointError: the directory has no completion marker: its save did not finish; or
            it belongs to a job and its marker is not signed with that job's key, or that key
            is not on this machine.
    """
    from sparkgpu.train.checkpoint_directory import MARKER_NAME, open_checkpoint

    found = open_checkpoint(checkpoint)  # verifies its marker where a key applies
    if found is None:
        raise CheckpointError(
            f"{checkpoint} has no completion marker ({MARKER_NAME}): its save did not finish (it is still being "
            "written, or the job stopped mid-save), so it may hold partial data. Register a complete checkpoint: "
            "sparkgpu.train.latest_checkpoint(<checkpoint directory>).path is the newest one"
        )
    return found.info
