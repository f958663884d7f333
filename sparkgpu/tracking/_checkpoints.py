"""Model weights from ``torch.distributed.checkpoint`` directories, and whether a save of them finished."""

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
        CheckpointError: the directory is not a complete checkpoint or lacks the model's keys.
    """
    import torch.distributed.checkpoint as dcp

    checkpoint = str(checkpoint)
    reader: dcp.StorageReader
    remote = "://" in checkpoint and not checkpoint.startswith("file://")
    if remote:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        reader = FsspecReader(checkpoint)
    else:
        local = checkpoint[len("file://") :] if checkpoint.startswith("file://") else checkpoint
        if not (Path(local) / ".metadata").is_file():
            raise CheckpointError(
                f"{checkpoint} is not a complete torch.distributed.checkpoint directory (no .metadata file); "
                "pass the directory of a committed checkpoint"
            )
        reader = dcp.FileSystemReader(local)
    try:
        stored_keys = list(reader.read_metadata().state_dict_metadata)
    except Exception as exc:
        raise CheckpointError(f"cannot read the checkpoint metadata of {checkpoint}: {exc}") from exc
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
    with warnings.catch_warnings():
        # One process loads the whole model, also on rank 0 of a running job (no collective).
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(wanted, storage_reader=reader, no_dist=True)
    model.load_state_dict(state)
    return model


def committed_checkpoint(checkpoint: str):
    """The completion marker of a checkpoint saved by ``sparkgpu.train.Checkpointer``.

    Args:
        checkpoint: Directory (or fsspec URL) of one checkpoint (``.../step-0000000900``).

    Returns:
        Its :class:`~sparkgpu.train.CheckpointInfo` (step, world size, ...).

    Raises:
        CheckpointError: the directory has no completion marker: its save did not finish.
    """
    from sparkgpu.train._checkpoint_store import MARKER_NAME, checkpoint_at

    info = checkpoint_at(checkpoint)
    if info is None:
        raise CheckpointError(
            f"{checkpoint} has no completion marker ({MARKER_NAME}): its save did not finish (it is still being "
            "written, or the job stopped mid-save), so it may hold partial data. Register a complete checkpoint: "
            "sparkgpu.train.latest_checkpoint(<checkpoint directory>).path is the newest one"
        )
    return info
