"""A sparkgpu loader as the ``train_dataset`` of TRL's ``SFTTrainer``: packed rows, not re-tokenized.

TRL 1.x takes only a ``datasets.Dataset`` or ``datasets.IterableDataset`` as ``train_dataset``.
:func:`as_hf_dataset` gives it one that carries the loader::

    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(output_dir="out", dataset_kwargs={"skip_prepare_dataset": True}),
        train_dataset=sparkgpu.hf.as_hf_dataset(data.sft_dataset(local=..., seq_len=4096, batch_size=8)),
        processing_class=tokenizer,
        peft_config=lora,
    )

A Trainer patched by the job (:mod:`sparkgpu.hf.resume`) recognises it as a sparkgpu loader: each
rank reads its own share in the loader's batches (``input_ids``, ``labels`` with ``-100`` on
prompts, padding and each document's first token, ``position_ids`` restarting at every
document), whatever Accelerate's ``dispatch_batches`` says, and a resumed trainer restores the
loader's position. TRL's own preparation (tokenizing, truncating, packing) must be skipped:
the rows are packed already, and a re-mapped copy would lose the loader.
:func:`patch_sft_trainer` makes an ``SFTTrainer`` class do both by itself for a loader given as
it is.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from typing import Any

from sparkgpu.errors import ConfigurationError
from sparkgpu.hf.datasets import LoaderDataset, is_loader, loader_of

__all__ = ["as_hf_dataset", "patch_sft_trainer", "SKIP_PREPARATION"]

logger = logging.getLogger(__name__)
_PATCHED = "_sparkgpu_takes_loaders"


SKIP_PREPARATION = {"skip_prepare_dataset": True}  # SFTConfig(dataset_kwargs=...) for a loader
_COLUMNS = ("input_ids", "labels", "position_ids")
_NAMES = ("input_ids", "labels")


def _refuse(name: str):
    def method(self, *args, **kwargs):
        raise ConfigurationError(
            f"{name}() of a sparkgpu loader seen as a datasets.IterableDataset: its rows are tokenized and "
            "packed already, and a re-mapped copy would lose each rank's share and the loader's position. "
            "Give SFTTrainer SFTConfig(dataset_kwargs={'skip_prepare_dataset': True}), which skips TRL's "
            "preparation, or set the loader's options (seq_len, overflow, shuffle) instead"
        )

    method.__name__ = name
    return method


@functools.cache
def _view_class():
    """The ``datasets.IterableDataset`` subclass, made on first use (``datasets`` loads lazily)."""
    # datasets ships no type information; it is the project's [hf] extra, imported on first use.
    datasets: Any = importlib.import_module("datasets")

    class LoaderRows(datasets.IterableDataset):
        """A sparkgpu loader seen as a ``datasets.IterableDataset`` of its packed rows.

        Iterating it yields the loader's rows from its current position (dicts of 1-D tensors)
        and leaves that position where it was. A Trainer reads the loader itself, through
        :func:`sparkgpu.hf.datasets.dataloader_for`.
        """

        wraps_sparkgpu_loader = True

        def __init__(self, loader, names: tuple[str, ...]):
            self.loader = loader
            self.names = names
            columns = list(_COLUMNS) if getattr(loader, "packs_documents", False) else list(names)
            if getattr(loader, "attention_mask", False) is True:
                columns.append("attention_mask")
            features = datasets.Features({c: datasets.Sequence(datasets.Value("int64")) for c in columns})
            super().__init__(
                datasets.iterable_dataset.ExamplesIterable(self._keyed_rows, {}),
                info=datasets.DatasetInfo(features=features),
            )

        def __len__(self) -> int:
            return len(self.loader)

        def __iter__(self):
            return self._rows()

        def _keyed_rows(self):
            for i, row in enumerate(self._rows()):
                yield i, row

        def _rows(self):
            saved = self.loader.state_dict()
            try:
                for batch in LoaderDataset(self.loader, self.names):
                    for i in range(len(batch["input_ids"])):
                        yield {k: v[i] for k, v in batch.items()}
            finally:
                self.loader.load_state_dict(saved)

        map = _refuse("map")
        filter = _refuse("filter")
        shuffle = _refuse("shuffle")
        select_columns = _refuse("select_columns")
        remove_columns = _refuse("remove_columns")
        batch = _refuse("batch")

        def __repr__(self) -> str:
            return f"LoaderRows({type(self.loader).__name__}, rows of a sparkgpu loader)"

    return LoaderRows


def as_hf_dataset(loader, names: tuple[str, ...] = _NAMES):
    """A sparkgpu loader as a ``datasets.IterableDataset``, for trainers that accept nothing else.

    Args:
        loader: ``data.sft_dataset(...)`` (batches of packed rows), or another sparkgpu loader.
        names: The model's argument names a tensor batch is passed as (an SFT loader's dict
            batches go as they are).

    Returns:
        A ``datasets.IterableDataset`` whose rows are the loader's; pass it as TRL's
        ``train_dataset`` with ``SFTConfig(dataset_kwargs={"skip_prepare_dataset": True})``.
    """
    from sparkgpu.hf._requirements import require_transformers

    require_transformers("sparkgpu.hf.as_hf_dataset")
    loader = loader_of(loader)
    return _view_class()(loader, names)


def patch_sft_trainer(trainer_class: Any) -> None:
    """Makes ``trainer_class`` (TRL's ``SFTTrainer``) take a sparkgpu loader as ``train_dataset`` as it is.

    A loader (or :func:`as_hf_dataset`'s view) given as ``train_dataset`` is wrapped by
    :func:`as_hf_dataset`, and the trainer's ``SFTConfig`` told to skip TRL's preparation.
    Reading it rank by rank and resuming it by position still need the patched ``Trainer``
    (inside a job) or :func:`sparkgpu.hf.resumable`.
    """
    init = trainer_class.__init__
    if getattr(init, _PATCHED, False):
        return
    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        dataset = bound.arguments.get("train_dataset")
        if dataset is not None and is_loader(dataset):
            if not getattr(type(dataset), "wraps_sparkgpu_loader", False):  # a loader, or a LoaderDataset
                bound.arguments["train_dataset"] = as_hf_dataset(dataset, getattr(dataset, "names", _NAMES))
            config = bound.arguments.get("args")
            if config is not None and hasattr(config, "dataset_kwargs"):
                config.dataset_kwargs = {**(config.dataset_kwargs or {}), **SKIP_PREPARATION}
                logger.info("TRL's dataset preparation skipped: the sparkgpu loader's rows are tokenized and packed")
        return init(*bound.args, **bound.kwargs)

    setattr(wrapper, _PATCHED, True)
    trainer_class.__init__ = wrapper
