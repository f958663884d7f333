"""The Checkpointer's argument checks and their error messages.

Every check runs before anything is written, and each message says what to pass instead.
"""

from __future__ import annotations

import json
import math

from sparkgpu.errors import CheckpointError, ConfigurationError
from sparkgpu.train.checkpoint_directory import CheckpointInfo

# Keyword names of save()/restore() that cannot name a stateful object.
RESERVED_NAMES = frozenset({"model", "optimizer", "extras", "step", "wait"})


def dcp_errors():
    # DCP reports failures as CheckpointException, a BaseException: name it explicitly.
    from torch.distributed.checkpoint import CheckpointException

    return (Exception, CheckpointException)


def describe(exc: BaseException) -> str:
    """One line per failed rank instead of DCP's full tracebacks."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, (e, _) in sorted(failures.items()))
    return f"{type(exc).__name__}: {exc}"


def save_failed(info: CheckpointInfo, exc: BaseException) -> CheckpointError:
    return CheckpointError(
        f"the checkpoint of step {info.step} could not be written to {info.path!r} "
        f"({describe(exc)}); check free space and write permission there"
    )


def check_positive(name, value, kind) -> None:
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, kind)
        or value <= 0
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise ConfigurationError(f"{name} must be a positive number or None, got {value!r}")


def check_step(step) -> int:
    import numbers

    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ConfigurationError(f"step must be a non-negative integer (the step just finished), got {step!r}")
    return int(step)


def check_first_step(first_step) -> int | None:
    if first_step not in (None, 0, 1) or isinstance(first_step, bool):
        raise ConfigurationError(
            f"first_step must be 0 (the loop passes the index of the step just finished), 1 (it passes "
            f"the number of steps done) or None (learnt from the first save), got {first_step!r}"
        )
    return first_step


def check_resumed_step(step: int, resumed_at: int, first_step: int) -> None:
    """The first step a loop saves after ``restore()`` must follow the restored one.

    ``restore()`` returned ``steps_done``; a loop that counts steps done goes on with
    ``steps_done + 1``, one that passes indices with ``steps_done``, and both land on the
    restored step + 1 (``resumed_at``). Anything else skips or repeats steps.
    """
    if step == resumed_at:
        return
    steps_done = resumed_at - first_step  # what restore() returned
    gap = step - resumed_at
    habit = (
        "`step = ckpt.restore(...)`, then `step += 1` after each step and `ckpt.maybe_save(step, ...)`"
        if first_step == 1
        else "`for step in range(ckpt.restore(...), total): ...; ckpt.maybe_save(step, ...)`"
    )
    raise CheckpointError(
        f"the training loop resumed out of step: restore() returned {steps_done} (steps done), so the "
        f"first step saved after it should be {resumed_at}, but maybe_save got {step}: the loop would "
        f"{'skip' if gap > 0 else 'repeat'} {abs(gap)} step(s) and no longer match the restored optimizer "
        f"and data position. This checkpoint was saved by a loop that passes "
        f"{'the number of steps done' if first_step == 1 else 'the index of the step just finished'}; "
        f"resume with {habit}"
    )


def check_objects(model, optimizer, stateful: dict) -> list:
    import torch

    if model is not None and not isinstance(model, torch.nn.Module):
        raise ConfigurationError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    optimizers = [] if optimizer is None else list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigurationError(
                f"optimizer must be a torch.optim.Optimizer or a list of them, got {type(opt).__name__}"
            )
    if optimizers and model is None:
        raise ConfigurationError("an optimizer is saved and restored with its model: pass model= too")
    for name, obj in stateful.items():
        if name in RESERVED_NAMES:
            raise ConfigurationError(f"{name!r} is a reserved name; pass that object under another name")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ConfigurationError(
                f"{name}={type(obj).__name__} has no state_dict()/load_state_dict(); pass objects "
                "that have both, and plain values through extras={...}"
            )
    return optimizers


def check_extras(extras) -> dict:
    if extras is None:
        return {}
    if not isinstance(extras, dict):
        raise ConfigurationError(f"extras must be a dict of JSON values, got {type(extras).__name__}")
    try:
        return json.loads(json.dumps(extras, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"extras must hold JSON values only ({exc}); save tensors and other objects as stateful objects"
        ) from None


def check_compatible(info: CheckpointInfo, model, optimizers, stateful) -> None:
    missing = []
    if model is not None and not info.has_model:
        missing.append("model")
    if optimizers and not info.has_optimizer:
        missing.append("optimizer")
    missing += [name for name in stateful if name not in info.stateful]
    if missing:
        held = (
            (["model"] if info.has_model else []) + (["optimizer"] if info.has_optimizer else []) + list(info.stateful)
        )
        raise CheckpointError(
            f"checkpoint {info.path!r} holds no state for {', '.join(missing)} (it holds: "
            f"{', '.join(held) or 'nothing'}); pass restore() the same names as save()"
        )


def local_nbytes(obj) -> int:
    import torch

    if isinstance(obj, dict):
        return sum(local_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(local_nbytes(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "_local_tensor", obj)  # a DTensor's own shard
        return local.numel() * local.element_size()
    return 0
