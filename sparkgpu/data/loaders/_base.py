"""What the loaders share: the read options they open with, their resume state, and the split of
a rank's batches over DataLoader workers.

- :class:`ReadOptions`: the options every loader of MDS shards takes (``dataset``, mixtures,
  ``token_dataset``, ``sft_dataset``), gathered once by the entry point and passed along whole;
  :class:`ReadSettings`: the same options, resolved, kept as a loader's attributes;
- :class:`StateLayout` and :class:`Resumable`: a loader's ``state_dict()`` built from the entries
  it declares, and ``load_state_dict()`` checking a saved one against them;
- :func:`job_rank`: this process's rank and the world size, given or the job's;
- :func:`worker_batches`: which of a plan's batches this process builds;
- :class:`WorkerCuts`: what a DataLoader worker of the token and SFT loaders iterates.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from sparkgpu.data.loaders.order import EpochPlan, PlannedEpochs, check_int, restore_position
from sparkgpu.errors import ConfigurationError

__all__ = [
    "ReadOptions",
    "ReadSettings",
    "StateLayout",
    "Resumable",
    "job_rank",
    "worker_batches",
    "WorkerCuts",
    "STATE_VERSION",
]

# The layout version of every loader's state; a state of another version is refused.
STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """The read options shared by the loaders of MDS shards, as the entry point was given them.

    The fields mean what the keywords of :func:`sparkgpu.data.dataset` of the same names mean;
    ``None`` stands for the same defaults (``rank`` and ``world_size`` from the job,
    ``cache_limit`` from the settings, ``shuffle_block_size`` 262144).
    """

    batch_size: int
    shuffle: bool = False
    seed: int = 0
    shuffle_block_size: int | None = None
    drop_last: bool = False
    num_workers: int = 0
    cache_limit: int | str | None = None
    download_threads: int = 8
    rank: int | None = None
    world_size: int | None = None
    storage_options: dict | None = None

    @classmethod
    def of(cls, arguments: dict[str, Any]) -> ReadOptions:
        """The options among an entry point's ``arguments`` (its ``locals()``), the rest left out."""
        return cls(**{field.name: arguments[field.name] for field in dataclasses.fields(cls)})


class ReadSettings:
    """A loader's read options as attributes of the same names, taken from resolved
    :class:`ReadOptions` (rank, world size, block size and cache limit worked out)."""

    batch_size: int
    shuffle: bool
    seed: int
    shuffle_block_size: int
    drop_last: bool
    num_workers: int
    cache_limit: int | None
    download_threads: int
    rank: int
    world_size: int
    storage_options: dict | None

    def _read_with(self, options: ReadOptions) -> None:
        for field in dataclasses.fields(options):
            setattr(self, field.name, getattr(options, field.name))

    def _read_options(self) -> ReadOptions:
        """The options this loader reads with, resolved: for a loader that reads the same shards."""
        return ReadOptions(**{field.name: getattr(self, field.name) for field in dataclasses.fields(ReadOptions)})


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """How a loader's state reads: ``{"version", "epoch", counter, *fields, *identity}`` and what a
    resume checks.

    Args:
        fields: The loader's attributes saved as they are, in order, after the position.
        checked: Entries that must match for the rest of the epoch to be the part not yet seen.
        counter: The entry of the position: what all ranks consumed of the epoch.
        marks: Entries a state of this loader always has (a state without them is another loader's).
        name: The loader in a refusal, with its article (``"a loader"``: "not a loader state").
        what: The loader where an entry differs ("this loader has seed=1").
        fix: What to do instead; ``{key}`` names the entry that differs.
    """

    fields: tuple[str, ...]
    checked: tuple[str, ...]
    fix: str = "open the dataset with the same {key} to resume, or start a fresh epoch with set_epoch()"
    counter: str = "samples_consumed"
    marks: tuple[str, ...] = ()
    name: str = "a loader"
    what: str = "loader"


class Resumable(PlannedEpochs):
    """A loader whose position is plain JSON, laid out as its ``_layout`` says.

    Subclasses set ``_layout`` and define ``_state_identity()`` (the entries after the fields,
    which name the data read: its fingerprint, columns...) and ``_state_extent(state)`` (how far the counter goes in the saved state's epoch, and
    what that is, for the message); their ``state_dict()`` and ``load_state_dict()`` return
    :meth:`_saved_state` and apply :meth:`_restored_position`.
    """

    _layout: StateLayout
    rank: int
    world_size: int
    batch_size: int  # None in a loader of single rows, which passes the batches it plans in to _rank_plan
    drop_last: bool

    def _state_identity(self) -> dict:
        raise NotImplementedError

    def _state_extent(self, state: dict) -> tuple[int, str]:
        raise NotImplementedError

    def _saved_state(self) -> dict:
        """The position after the last batch handed out: version, epoch, counter, fields, identity."""
        layout = self._layout
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            layout.counter: self._consumed,
            **{name: getattr(self, name) for name in layout.fields},
            **self._state_identity(),
        }

    def _restored_position(self, state: dict) -> tuple[int, int]:
        """``(epoch, consumed)`` of a saved state, checked against this loader's own.

        Raises:
            ConfigurationError: Not this loader's state, a checked entry differs, or the
                position lies outside the epoch.
        """
        layout = self._layout
        if (
            not isinstance(state, dict)
            or state.get("version") != STATE_VERSION
            or any(mark not in state for mark in layout.marks)
        ):
            raise ConfigurationError(
                f"not {layout.name} state (expected a dict from {type(self).__name__}.state_dict(), got {state!r:.200})"
            )
        total, unit = self._state_extent(state)
        return restore_position(
            state,
            self._saved_state(),
            keys=layout.checked,
            total=total,
            unit=unit,
            what=layout.what,
            fix=layout.fix,
            counter=layout.counter,
        )

    def _rank_plan(self, order, start: int, batch_size: int | None = None, **options) -> EpochPlan:
        """This rank's plan of an epoch in ``order``, from position ``start`` of all ranks on, in
        the loader's batches (or of ``batch_size``); ``options``: ``located=``, another ``drop_last=``."""
        size = batch_size if batch_size is not None else self.batch_size
        assert size is not None, "a loader of single rows names the batches it plans in"
        options = {"drop_last": getattr(self, "drop_last", False), **options}
        return EpochPlan.for_rank(
            order, start=start, rank=self.rank, world_size=self.world_size, batch_size=size, **options
        )

    def _advance(self, plan: EpochPlan, start: int, batches: int) -> None:
        """Sets the position to just after the rank's first ``batches`` batches of ``plan``."""
        self._consumed = start + min(batches * plan.batch_size, len(plan.samples)) * self.world_size

    def _hand_out(self, plan: EpochPlan, start: int, batches, source=None):
        """Yields ``batches`` (the rank's of ``plan``, from position ``start`` on), moving the
        position past each as it is handed out, and to the next epoch after the last; closes
        ``source`` (what ``batches`` come from) however the iteration ends."""
        try:
            for number, batch in enumerate(batches, 1):
                # Counted when handed out: a checkpoint taken after this step resumes after it.
                self._advance(plan, start, number)
                yield batch
        finally:
            close = getattr(source, "close", None)
            if close:
                close()
        self.epoch, self._consumed = self.epoch + 1, 0


def job_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``: the ones given, else the job's (:mod:`sparkgpu.runtime`), checked.

    Raises:
        ConfigurationError: ``world_size`` is not a positive integer, or ``rank`` not one below it.
    """
    from sparkgpu import runtime

    rank = runtime.get_global_rank() if rank is None else rank
    world_size = runtime.get_world_size() if world_size is None else world_size
    check_int("world_size", world_size, 1)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigurationError(f"rank={rank!r} must be an integer in [0, world_size={world_size})")
    return rank, world_size


def worker_batches(num_batches: int) -> range:
    """The batches of a plan this process builds: all of them, or ``w, w + W, ...`` in DataLoader
    worker ``w`` of ``W``. The DataLoader takes a batch from each worker in turn, which restores
    the rank's order exactly."""
    info = torch.utils.data.get_worker_info()
    return range(num_batches) if info is None else range(info.id, num_batches, info.num_workers)


class WorkerCuts(torch.utils.data.IterableDataset):
    """What a DataLoader worker of the token and SFT loaders iterates: its share of a plan's batches.

    Yields ``loader.batches(*before, plan, numbers)`` for this worker's ``numbers``
    (:func:`worker_batches`), after ``loader._reopen()`` in a worker process: a forked copy of
    the loader lacks its parent's download threads.
    """

    def __init__(self, loader, plan, *before):
        self.loader, self.plan, self.before = loader, plan, before

    def __iter__(self):
        if torch.utils.data.get_worker_info() is not None:
            self.loader._reopen()
        yield from self.loader.batches(*self.before, self.plan, worker_batches(self.plan.num_batches))
