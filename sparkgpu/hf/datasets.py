"""A sparkgpu loader as a Trainer's ``train_dataset``: each rank reads its own share, resumed by position.

sparkgpu's loaders (``data.token_dataset``, ``data.dataset``, ...) hand out whole batches of
this rank's share of the data. A Trainer would index them, or batch their batches, and
Accelerate's ``dispatch_batches`` would read rank 0's share only and send it to every rank. A
patched Trainer (:mod:`sparkgpu.hf.resume`) instead reads such a loader through a plain
``DataLoader`` that Accelerate does not touch (``batch_size=None``: the loader's batches as
they are), saves the loader's ``state_dict()`` beside every checkpoint, and on resume loads
it instead of letting the Trainer replay the batches it skips.

Token ids are stored in whatever dtype the data was written with (``int32`` from
``data.tokenize``, ``uint16`` or ``int32`` from Megatron and litdata pipelines), and the loaders
hand them out in that dtype. HF models index embeddings and compute their loss with ``int64``
only (``cross_entropy`` refuses ``int32`` targets, ``embedding`` refuses ``uint16`` indices), so
:func:`batches_of`, which every batch a Trainer reads passes through, makes the integer tensors a
model takes as ids or masks ``int64``: one conversion per batch, none on disk.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

from sparkgpu._util.report import report
from sparkgpu.data.loaders.order import PlannedEpochs

__all__ = [
    "LOADER_STATE",
    "INDEX_ARGUMENTS",
    "LoaderDataset",
    "train_dataset",
    "is_loader",
    "loader_of",
    "batches_of",
    "keep_documents_apart",
]

logger = logging.getLogger(__name__)

LOADER_STATE = "sparkgpu_loader_state.json"  # in each checkpoint-N folder, written by rank 0

#: The model arguments that hold token ids, positions or 0/1 masks: an integer tensor under one
#: of these names reaches the model as ``int64``. Other values (pixels, features) keep their dtype.
INDEX_ARGUMENTS = frozenset({"input_ids", "labels", "position_ids", "attention_mask", "token_type_ids"})


def _wraps_loader(dataset: Any) -> bool:
    """Whether ``dataset`` wraps a sparkgpu loader (a :class:`LoaderDataset`, ``as_hf_dataset``'s view)."""
    return isinstance(dataset, LoaderDataset) or getattr(type(dataset), "wraps_sparkgpu_loader", False) is True


def is_loader(dataset: Any) -> bool:
    """Whether ``dataset`` is a sparkgpu loader (batches of this rank's share, with a position)."""
    if _wraps_loader(dataset):
        return True
    module = type(dataset).__module__ or ""
    return (
        module.startswith("sparkgpu.data")
        and callable(getattr(dataset, "state_dict", None))
        and callable(getattr(dataset, "load_state_dict", None))
    )


def loader_of(dataset: Any):
    """The sparkgpu loader behind ``dataset`` (a :class:`LoaderDataset`, ``as_hf_dataset``'s view, or the loader)."""
    return dataset.loader if _wraps_loader(dataset) else dataset


class LoaderDataset(torch.utils.data.IterableDataset):
    """A sparkgpu loader seen as a Trainer's dataset of ready-made batches.

    Args:
        loader: The loader; it reads this rank's share by itself.
        names: What a tensor batch is handed to the model as: ``("input_ids", "labels")``
            by default (a causal LM shifts the labels itself). A batch that is a dict already
            (an SFT loader's ``input_ids``, ``labels``, ``position_ids``) keeps its keys.
            Token ids and masks are handed out as ``int64`` (:func:`batches_of`).
    """

    def __init__(self, loader, names: tuple[str, ...] = ("input_ids", "labels")):
        self.loader = loader
        self.names = names

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield batches_of(batch, self.names)


def batches_of(batch: Any, names: tuple[str, ...] = ("input_ids", "labels")) -> Any:
    """The model's keyword arguments for one loader batch.

    A tensor batch goes under each of ``names`` (one tensor, converted once); a dict batch keeps
    its keys. Integer tensors under the names in :data:`INDEX_ARGUMENTS` become ``int64``,
    whatever dtype the tokens were stored in.
    """
    if isinstance(batch, torch.Tensor):
        ids = _as_int64(batch) if INDEX_ARGUMENTS.intersection(names) else batch
        return {name: ids if name in INDEX_ARGUMENTS else batch for name in names}
    if isinstance(batch, dict):
        return {key: _as_int64(value) if key in INDEX_ARGUMENTS else value for key, value in batch.items()}
    return batch


def _as_int64(value: Any) -> Any:
    """``value`` as ``int64`` when it is a tensor of another integer dtype (bool and floats stay)."""
    if (
        isinstance(value, torch.Tensor)
        and value.dtype not in (torch.int64, torch.bool)
        and not value.is_floating_point()
        and not value.is_complex()
    ):
        return value.long()
    return value


def train_dataset(loader, names: tuple[str, ...] = ("input_ids", "labels")) -> LoaderDataset:
    """Wraps a sparkgpu loader as a Trainer's ``train_dataset`` (a loader passed as it is works too).

    Args:
        loader: ``data.token_dataset(...)``, ``data.dataset(...)`` or another sparkgpu loader.
        names: The model's argument names a tensor batch is passed as.
    """
    return LoaderDataset(loader, names)


class LoaderBatches(torch.utils.data.DataLoader):
    """The DataLoader a patched Trainer reads a sparkgpu loader through (Accelerate leaves it alone)."""

    sparkgpu_positioned = True

    def __init__(self, dataset: LoaderDataset):
        super().__init__(dataset, batch_size=None, num_workers=0)


def dataloader_for(dataset: Any) -> LoaderBatches:
    """The DataLoader of a sparkgpu loader, a :class:`LoaderDataset` or ``as_hf_dataset``'s view.

    The view is read through a plain :class:`LoaderDataset` of its loader: the loader's batches,
    each rank its own share, not the view's rows.
    """
    if type(dataset) is not LoaderDataset:
        dataset = LoaderDataset(loader_of(dataset), getattr(dataset, "names", ("input_ids", "labels")))
    return LoaderBatches(dataset)


def keep_documents_apart(model: Any, dataset: Any) -> None:
    """Turns the model's key/value cache off for a loader that packs documents into rows.

    HF models keep packed documents apart by ``position_ids`` only without an attention mask and
    without a cache; a model whose config says ``use_cache=True`` (Llama's default) builds one in
    training too, and every document would then attend to the ones before it in its row.
    """
    config: Any = getattr(model, "config", None)
    if getattr(loader_of(dataset), "packs_documents", False) and getattr(config, "use_cache", False):
        config.use_cache = False
        logger.info("use_cache turned off for training: the loader packs documents, kept apart by position_ids")


def position(dataset: Any) -> tuple[int, int] | None:
    """``(epoch, batches)``: the epoch the loader reads next and the batches this rank has left
    of it at this world size (:meth:`~sparkgpu.data.loaders.order.PlannedEpochs.position`);
    ``None`` for a loader that does not plan its epochs.

    A loader's position counts the samples of the epoch all ranks consumed together, so the
    rest is this rank's share at whatever world size the loader was opened with.
    """
    loader = loader_of(dataset)
    return loader.position() if isinstance(loader, PlannedEpochs) else None


def save_position(dataset: Any, folder: str) -> None:
    """Writes the loader's position into a Trainer checkpoint folder (its state is the same on every rank)."""
    state = loader_of(dataset).state_dict()
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, LOADER_STATE), "w") as f:
        json.dump(state, f)


def load_position(dataset: Any, folder: str) -> bool:
    """Restores the loader's position from a checkpoint folder; False when it holds none."""
    path = os.path.join(folder, LOADER_STATE)
    if not os.path.exists(path):
        return False
    with open(path) as f:
        loader_of(dataset).load_state_dict(json.load(f))
    report("the loader resumes at its saved position: no batch is replayed")
    return True
