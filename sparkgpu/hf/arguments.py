"""``TrainingArguments`` on a CPU rank: ``use_cpu`` follows the rank's ``ACCELERATE_USE_CPU``.

Arguments written for GPUs (TRL's configs turn ``bf16`` on by default) are refused by
``TrainingArguments`` on a host without a GPU unless ``use_cpu`` is set, although the rank's
``ACCELERATE_USE_CPU`` already puts Accelerate on the CPU. In a rank, the patch below sets
``use_cpu`` where the rank's environment says CPU and the user did not say otherwise. Importing
this module does not import ``transformers``.

``fsdp=`` and ``deepspeed=`` are for GPU worlds: Accelerate makes neither from a CPU world and
trains CPU ranks as plain DDP. On a CPU rank the patch says so; it drops ``deepspeed=``, whose
configuration would otherwise need DeepSpeed installed on a machine where it is never used.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from sparkgpu import runtime

__all__ = ["patch_training_arguments"]

logger = logging.getLogger(__name__)

_PATCHED = "_sparkgpu_cpu_rank"


def _cpu_rank() -> bool:
    flag = os.environ.get("ACCELERATE_USE_CPU", "").strip().lower()
    return runtime.job_id() is not None and flag in ("1", "true", "yes", "on")


def patch_training_arguments(arguments_class: Any) -> None:
    """Makes ``arguments_class`` (``TrainingArguments`` and its subclasses) use the CPU on CPU ranks."""
    post_init = arguments_class.__post_init__
    if getattr(post_init, _PATCHED, False):
        return

    @functools.wraps(post_init)
    def __post_init__(self, *args, **kwargs):
        if not self.use_cpu and _cpu_rank():
            self.use_cpu = True
        if self.fsdp and _cpu_rank():
            # Accelerate applies its FSDP plugin to GPU-like worlds only: on CPU ranks it trains as DDP.
            logger.warning("fsdp=%r is ignored on CPU ranks: Accelerate trains them as plain DDP", self.fsdp)
        if self.deepspeed and _cpu_rank():
            logger.warning("deepspeed= is ignored on CPU ranks: Accelerate trains them as plain DDP")
            self.deepspeed = None
        return post_init(self, *args, **kwargs)

    setattr(__post_init__, _PATCHED, True)
    arguments_class.__post_init__ = __post_init__
