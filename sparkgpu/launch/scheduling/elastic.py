"""When an elastic job changes size: the decisions, apart from the supervisor that acts on them.

An elastic job (``min_gpus=`` below ``gpus=``) runs each attempt on a number of GPUs between
the two, in whole nodes. Two moments decide it, both from the backend's
:meth:`~sparkgpu.launch.backends.capabilities.ElasticCapacity.available_gpus`:

* **Shrink.** An attempt whose GPUs have not all come ``elastic_wait`` after it was submitted
  (a lost node not yet replaced, a cluster busy at submit) is withdrawn before its ranks start
  and submitted again on what is free, when that is at least ``min_gpus``. The withdrawn
  attempt ran nothing: it is neither billed nor a restart.
* **Grow.** While an attempt runs on fewer GPUs than the job asks for, the backend is asked
  every :attr:`ElasticPlan.check_seconds` whether all of them would fit now. When they would,
  the ranks are asked to checkpoint and stop (as at the runtime cap); the next attempt resumes
  from that checkpoint on every GPU, using no restart.

Data loaders and checkpoints carry the job's position across the change (the loaders count
samples of the whole job, model and optimizer state is resharded on restore), so every sample
of an epoch is trained on once whatever the sizes were.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from sparkgpu.spec import JobSpec

__all__ = ["ElasticPlan", "CHECK_SECONDS"]

logger = logging.getLogger(__name__)

#: Seconds between two asks of the backend whether a smaller attempt may shrink or grow.
#: Each ask may run a small probe on the cluster, so not every poll.
CHECK_SECONDS = 30.0


@dataclasses.dataclass
class ElasticPlan:
    """The size decisions of one elastic job.

    Attributes:
        job: The job as asked for (its full size).
        available: The backend's :meth:`~sparkgpu.launch.backends.capabilities.ElasticCapacity.available_gpus`
            for the job.
        check_seconds: Seconds between two asks (:data:`CHECK_SECONDS` by default).
    """

    job: JobSpec
    available: Callable[[JobSpec], int | None]
    check_seconds: float | None = None
    _next_check: float = 0.0

    def __post_init__(self):
        if self.check_seconds is None:
            self.check_seconds = CHECK_SECONDS

    @property
    def target(self) -> int:
        return self.job.resources.gpus

    @property
    def minimum(self) -> int:
        return self.job.resources.min_gpus or self.target

    def _due(self, now: float) -> bool:
        if now < self._next_check:
            return False
        self._next_check = now + (self.check_seconds or 0.0)
        return True

    def _ask(self) -> int | None:
        try:
            return self.available(self.job)
        except Exception as exc:  # a probe that fails keeps the size: the job goes on as it is
            logger.warning(
                "could not tell how many GPUs are free (%s: %s); keeping the job's size", type(exc).__name__, exc
            )
            return None

    def shrink_to(self, size: int, waited: float, now: float) -> int | None:
        """The smaller size to submit again on, for an attempt of ``size`` GPUs whose ranks have
        waited ``waited`` seconds without starting; ``None`` to wait on."""
        if size <= self.minimum or waited < self.job.elastic_wait or not self._due(now):
            return None
        free = self._ask()
        if free is None or not self.minimum <= free < size:
            return None
        return free

    def grows(self, size: int, now: float) -> bool:
        """Whether an attempt running on ``size`` GPUs should stop at a checkpoint to resume on all of them."""
        if size >= self.target or not self._due(now):
            return False
        free = self._ask()
        return free is not None and free >= self.target
