"""Metrics from training code, and autologging of plain PyTorch loops (no Lightning needed).

Inside a job every rank can call :func:`log`; what reaches the run is decided like this:

* ``reduce=None`` (default): rank 0's values are logged, other ranks' calls return at once.
  No collective runs, so ranks may call it at different places. This is Lightning's and Ray
  Train's default too: in data-parallel training rank 0's loss is a fair sample.
* ``reduce="mean" | "sum" | "max" | "min"``: the values are all-reduced over the ranks, then
  rank 0 logs the result. It is a collective: every rank must call it, with the same keys.

``step=None`` means the number of optimizer steps taken so far (Lightning's ``global_step``)
once autolog has seen an optimizer step, else a per-key counter.

Autolog (on by default in jobs) hooks ``torch.optim`` through
``register_optimizer_step_post_hook``: on rank 0 it logs each optimizer's class and
hyper-parameters (``optimizer.lr``, ``optimizer.betas``, ...) at its first step, and the
learning rate as metric ``lr``: at the first step, at every change after a constant stretch
(a step decay shows at its exact step), and every ``every_n_steps`` steps while it changes at
every step (a warm-up or cosine schedule is sampled). Step numbers follow the
optimizer's own ``step`` state where it keeps one (Adam, AdamW, ...), so they continue after a
resume from a checkpoint. Steps that are not the training's are not recorded: torch's
state-dict helpers take one optimizer step with ``lr=0`` to create an optimizer's state
while a checkpoint is restored (:func:`unrecorded_optimizer_steps`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import logging
import math
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING

from sparkgpu._util.modules import imported
from sparkgpu.errors import ConfigurationError

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from sparkgpu.tracking.spool import SpoolWriter

__all__ = [
    "log",
    "log_checkpoint",
    "OptimizerAutolog",
    "current_step",
    "logs_to_job_run",
    "unrecorded_optimizer_steps",
]

_logger = logging.getLogger(__name__)

_REDUCTIONS = ("mean", "sum", "max", "min")
# Implementation switches of torch optimizers, not hyper-parameters.
_NOT_HYPERPARAMETERS = {"params", "foreach", "capturable", "differentiable", "fused", "maximize", "name"}


@dataclasses.dataclass
class _Session:
    """What this worker process knows about the job it logs into."""

    writer: SpoolWriter
    rank: int
    world_size: int
    autolog: "OptimizerAutolog | None" = None
    counters: dict = dataclasses.field(default_factory=dict)


_session: _Session | None = None
_unrecorded = contextvars.ContextVar("sparkgpu_unrecorded_optimizer_steps", default=False)
_session_lock = threading.Lock()
_warned_outside = False


def _activate(writer, rank: int, world_size: int) -> _Session:
    global _session
    with _session_lock:
        _session = _Session(writer, rank, world_size)
        return _session


def _deactivate() -> None:
    global _session
    with _session_lock:
        if _session is not None and _session.autolog is not None:
            _session.autolog.remove()
        _session = None


def _current_session() -> _Session | None:
    """The job session of this process, created from the environment in processes the
    launcher did not set up itself (subprocesses of a rank)."""
    if _session is not None:
        return _session
    from sparkgpu.tracking.spool import SpoolDir, SpoolWriter, spool_path_from_env

    spool = spool_path_from_env()
    if not spool:
        return None
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return _activate(SpoolWriter.for_process(SpoolDir(spool)), rank, world)


def logs_to_job_run() -> bool:
    """Whether this process is a job's worker, whose records go to the job's run (spool)."""
    return _current_session() is not None


def current_step() -> int | None:
    """Optimizer steps taken so far by the job's first optimizer, as seen by autolog."""
    session = _current_session()
    if session is None or session.autolog is None:
        return None
    return session.autolog.current_step


def _as_float(key, value) -> float:
    if hasattr(value, "item"):  # torch / numpy scalars
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"metric {key!r} must be a number or a one-element tensor, got {value!r}")
    return float(value)


def _all_reduce(values: list[float], reduce: str) -> list[float]:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return values
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    op = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[
        reduce
    ]
    dist.all_reduce(tensor, op=op)
    if reduce == "mean":
        tensor /= dist.get_world_size()
    return tensor.tolist()


def log(metrics: dict, step: int | None = None, *, reduce: str | None = None) -> None:
    """Logs metrics of the training loop into the job's MLflow run, from any rank.

    Args:
        metrics: Names to numbers (Python numbers, or one-element tensors / numpy scalars).
        step: Step of these values; ``None`` for the optimizer steps taken so far (or a
            per-key counter without autolog).
        reduce: ``None`` logs rank 0's values; ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``
            all-reduces them over the ranks first (a collective: call it on every rank with
            the same keys).

    Outside a job the values go to the active MLflow run, and nowhere when none is active.

    Raises:
        ConfigurationError: a value is not a number, or ``reduce`` is unknown.
    """
    global _warned_outside
    if reduce is not None and reduce not in _REDUCTIONS:
        raise ConfigurationError(
            f"reduce={reduce!r} is not supported; use None (rank 0's values) or one of {_REDUCTIONS}"
        )
    if not isinstance(metrics, dict):
        raise ConfigurationError(f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
    keys = sorted(metrics)
    values = [_as_float(k, metrics[k]) for k in keys]
    session = _current_session()
    if session is None:
        mlflow = imported("mlflow")
        if mlflow is not None and mlflow.active_run() is not None:
            mlflow.log_metrics(dict(zip(keys, values)), step=step)
        elif not _warned_outside:
            _warned_outside = True
            _logger.info("sparkgpu.log outside a job with no active MLflow run: nothing is recorded")
        return
    if reduce is not None and session.world_size > 1:
        values = _all_reduce(values, reduce)
    if session.rank != 0:
        return
    if step is None:
        step = session.autolog.current_step if session.autolog is not None else None
    timestamp = int(time.time() * 1000)
    records = []
    for key, value in zip(keys, values):
        if step is None:
            key_step = session.counters.get(key, 0)
            session.counters[key] = key_step + 1
        else:
            key_step = int(step)
        records.append((key, value, key_step, timestamp))
    session.writer.write(metrics=records)


def log_checkpoint(step: int, path: str, *, run_id: str | None = None) -> None:
    """Records a committed checkpoint in the job run's lineage.

    The checkpointer calls it after a checkpoint is complete. The run gets a
    ``checkpoint/step`` metric point, tags ``sparkgpu.checkpoint.latest_step`` and
    ``sparkgpu.checkpoint.latest_path``, and the artifact ``lineage/checkpoints.json`` lists
    every checkpoint; the registry reads it to tag model versions with their step. Any rank
    may call it (duplicates are merged). Outside a job it tags the active MLflow run, if any.

    Args:
        step: Training step the checkpoint holds.
        path: Where the checkpoint lives (path or URL).
        run_id: Outside a job, the MLflow run to record it in (default: this thread's active run).
    """
    step = int(step)
    session = _current_session()
    if session is None:
        mlflow = imported("mlflow")
        if mlflow is None:
            return
        if run_id is None and mlflow.active_run() is not None:
            run_id = mlflow.active_run().info.run_id
        if run_id is not None:
            client = mlflow.MlflowClient()
            client.set_tag(run_id, "sparkgpu.checkpoint.latest_step", str(step))
            client.set_tag(run_id, "sparkgpu.checkpoint.latest_path", str(path))
            client.log_metric(run_id, "checkpoint/step", step, step=step)
        return
    session.writer.write(checkpoints=[(step, str(path), int(time.time() * 1000))])


# -- optimizer autolog ----------------------------------------------------------------------


@contextlib.contextmanager
def unrecorded_optimizer_steps():
    """Optimizer steps taken inside are not recorded by autolog.

    For the steps that are not training: ``torch.distributed.checkpoint.state_dict`` creates
    a fresh optimizer's state by stepping it once with ``lr=0``, which autolog would log as
    the optimizer's learning rate (and as a step).
    """
    token = _unrecorded.set(True)
    try:
        yield
    finally:
        _unrecorded.reset(token)


def _state_step(optimizer) -> int | None:
    """Steps the optimizer itself counts (Adam-style ``state[p]["step"]``), which a restored
    optimizer state carries over from the checkpoint."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state and "step" in state:
                value = state["step"]
                return int(value.item() if hasattr(value, "item") else value)
    return None


def _param_value(value) -> str | None:
    if isinstance(value, (bool, int, float, str)):
        return str(value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float)) for v in value):
        return str(tuple(value))
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:  # tensor lr
        return str(value.item())
    return None


def _hyperparameters(optimizer, prefix: str) -> dict[str, str]:
    params = {prefix: type(optimizer).__name__}
    groups = optimizer.param_groups
    if len(groups) > 1:
        params[f"{prefix}.param_groups"] = str(len(groups))
    keys = [k for k in dict.fromkeys(itertools.chain.from_iterable(groups)) if k not in _NOT_HYPERPARAMETERS]
    for key in keys:
        values = [_param_value(g.get(key)) for g in groups]
        if all(v is None for v in values):
            continue
        if len(set(values)) == 1 and values[0] is not None:
            params[f"{prefix}.{key}"] = values[0]
        else:
            for index, value in enumerate(values):
                if value is not None:
                    params[f"{prefix}.group_{index}.{key}"] = value
    return params


@dataclasses.dataclass
class _OptimizerState:
    index: int
    steps: int = 0
    last_lrs: tuple | None = None  # as last logged
    previous_lrs: tuple | None = None  # at the step before
    last_logged_step: int = -(10**9)


class OptimizerAutolog:
    """Logs optimizer hyper-parameters and the learning-rate schedule from a global torch hook.

    Args:
        writer: The spool writer of this rank (records go to the job's run).
        every_n_steps: Most frequent learning-rate logging for a schedule that changes every
            step; a change after a longer constant stretch is logged at its step.
    """

    def __init__(self, writer, every_n_steps: int = 10):
        if every_n_steps < 1:
            raise ConfigurationError(f"every_n_steps must be at least 1, got {every_n_steps}")
        self.writer = writer
        self.every_n_steps = every_n_steps
        self._optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._handle: RemovableHandle | None = None
        self.current_step: int | None = None

    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        if self._handle is None:
            self._handle = register_optimizer_step_post_hook(self._after_step)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _after_step(self, optimizer, args, kwargs) -> None:
        if _unrecorded.get():
            return
        try:
            self._record(optimizer)
        except Exception as exc:  # autolog must never break a training step
            _logger.warning("sparkgpu autolog: could not record the optimizer step: %s", exc)

    def _record(self, optimizer) -> None:
        state = self._optimizers.get(optimizer)
        if state is None:
            state = self._optimizers[optimizer] = _OptimizerState(index=len(self._optimizers))
            prefix = "optimizer" if state.index == 0 else f"optimizer_{state.index}"
            self.writer.write(params=sorted(_hyperparameters(optimizer, prefix).items()))
        state.steps += 1
        taken = _state_step(optimizer) or state.steps
        step = taken - 1  # index of the step just taken
        if state.index == 0:
            self.current_step = taken
        lrs = tuple(_lr(group) for group in optimizer.param_groups)
        previous, state.previous_lrs = state.previous_lrs, lrs
        if lrs == state.last_lrs:
            return
        # A change after a constant stretch (a step decay) is logged at its step; a schedule
        # that changes every step is sampled every `every_n_steps`.
        sudden = previous == state.last_lrs and state.last_logged_step < step - 1
        if state.last_lrs is not None and not sudden and step - state.last_logged_step < self.every_n_steps:
            return
        state.last_lrs, state.last_logged_step = lrs, step
        base = "lr" if state.index == 0 else f"lr/optimizer_{state.index}"
        timestamp = int(time.time() * 1000)
        metrics = [
            (base if g == 0 else f"{base}/group_{g}", lr, step, timestamp)
            for g, lr in enumerate(lrs)
            if lr is not None and math.isfinite(lr)
        ]
        self.writer.write(metrics=metrics)


def _lr(group) -> float | None:
    value = group.get("lr")
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)
