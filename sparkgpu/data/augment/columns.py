"""The loaders' ``decode=`` option: JPEG columns cropped while they are decoded.

```python
ds = data.dataset(remote=..., batch_size=256, shuffle=True, decode={"image": data.RandomResizedCrop(224)})
```

The batch decoder hands each column named in ``decode=`` over as its encoded bytes
(:class:`sparkgpu.data.mds.decode.BatchDecoder`'s ``encoded=``), and :class:`ColumnCrops`
turns them into the crop's ``(batch, 3, H, W)`` ``uint8`` tensor, with the batch's global
sample indices and the epoch, before ``transform=`` and ``batch_transform=`` run: those see the
cropped tensor.

Columns. ``jpeg`` columns, and ``bytes`` columns holding JPEG files (a value that is not one
raises :class:`~sparkgpu.errors.DataError` when its batch is read). ``png`` and ``pil`` columns
are refused when the dataset is opened: the fused path exists because a JPEG can be decoded in
part and at a reduced scale, which PNG cannot; crop them with ``transform=`` (torchvision's
``RandomResizedCrop`` on :func:`sparkgpu.data.decode_image`), or store the images as JPEG.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from sparkgpu.data.augment.crops import CenterCrop, RandomResizedCrop
from sparkgpu.errors import ConfigurationError

__all__ = ["check_decode", "check_decode_columns", "check_decode_device", "ColumnCrops", "CROPS"]

CROPS = (RandomResizedCrop, CenterCrop)
# Encodings whose values the fused decoder takes: JPEG files.
_ENCODINGS = ("jpeg", "bytes")
_EXAMPLE = 'decode={"image": data.RandomResizedCrop(224)}'


def check_decode(decode) -> dict | None:
    """Checks ``decode=`` on its own (before the dataset's index is read).

    Returns:
        ``{column: crop}``, or ``None`` for no ``decode=``.

    Raises:
        ConfigurationError: ``decode`` is not a non-empty mapping of column names to crops.
    """
    if decode is None:
        return None
    if not isinstance(decode, Mapping) or not decode:
        raise ConfigurationError(f"decode={decode!r:.200} must map image column names to crops, e.g. {_EXAMPLE}")
    for name, crop in decode.items():
        if not isinstance(name, str):
            raise ConfigurationError(f"decode= has the key {name!r}; its keys are column names, e.g. {_EXAMPLE}")
        if not isinstance(crop, CROPS):
            raise ConfigurationError(
                f"decode[{name!r}]={crop!r:.200} is not a crop; pass data.RandomResizedCrop(size) for training or "
                "data.CenterCrop(size) for evaluation (for any other image transform, use transform=)"
            )
    return dict(decode)


def check_decode_columns(decode: dict, columns) -> None:
    """Checks that every column of ``decode=`` exists and holds JPEG files.

    Args:
        decode: The checked ``decode=`` (:func:`check_decode`).
        columns: The dataset's :class:`~sparkgpu.data.mds.reader.Column` objects.

    Raises:
        ConfigurationError: A column is missing, or is not a ``jpeg`` (or ``bytes``) column.
    """
    encodings = {column.name: column.encoding for column in columns}
    for name in decode:
        if name not in encodings:
            raise ConfigurationError(
                f"decode= names the column {name!r}, which the dataset does not have; its columns are "
                f"{', '.join(map(repr, encodings))}"
            )
        encoding = encodings[name]
        if encoding in ("png", "pil"):
            raise ConfigurationError(
                f"column {name!r} is stored as {encoding!r}; decode= crops JPEG columns only (a JPEG can be decoded "
                "in part and at reduced scale, a PNG cannot): leave it out of decode= and crop in transform= "
                "(torchvision's RandomResizedCrop on data.decode_image(sample[...])), or write the images as JPEG "
                "(data.to_mds(..., columns={...: 'jpeg'}))"
            )
        if encoding not in _ENCODINGS:
            raise ConfigurationError(
                f"column {name!r} is stored as {encoding!r}, not as JPEG files; decode= takes 'jpeg' columns "
                "(or 'bytes' columns of JPEG files): leave it out of decode="
            )


class ColumnCrops:
    """Replaces each ``decode=`` column of a batch (encoded bytes) by its cropped ``uint8`` tensor.

    Args:
        decode: ``{column: crop}`` (checked), or ``None``.
        seed: The dataset's seed.
        pinned: Write the images into page-locked memory.
    """

    def __init__(self, decode: dict | None, *, seed: int, pinned: bool):
        self.decode = dict(decode or {})
        self.seed = seed
        self.pinned = pinned

    def __bool__(self) -> bool:
        return bool(self.decode)

    def __call__(self, batch: dict, *, epoch: int, sample_ids: np.ndarray) -> dict:
        """Crops one batch's columns; ``sample_ids`` are the global sample indices of its rows."""
        n = len(sample_ids)
        for name, crop in self.decode.items():
            on_host = crop.device == "cpu"
            out = (
                torch.empty((n, 3, *crop.size), dtype=torch.uint8, pin_memory=True) if self.pinned and on_host else None
            )
            batch[name] = crop.batch(
                batch[name], seed=self.seed, epoch=epoch, indices=sample_ids, out=out, device=crop.device
            )
        return batch


def check_decode_device(decode: dict, num_workers: int, cuda_available: bool) -> None:
    """Checks that crops decoding on a GPU (nvJPEG) run where they can.

    Raises:
        ConfigurationError: A crop decodes on ``cuda`` while the loader has worker processes
            (nvJPEG runs in the training process), or without CUDA on this machine.
    """
    for name, crop in decode.items():
        if crop.device == "cpu":
            continue
        if not cuda_available:
            raise ConfigurationError(
                f"decode[{name!r}] decodes on {crop.device} but CUDA is not available on this machine; "
                "leave device= out of the crop to decode on the CPU"
            )
        if num_workers:
            raise ConfigurationError(
                f"decode[{name!r}] decodes on {crop.device} with nvJPEG, in the training process, but the loader has "
                f"num_workers={num_workers}: pass num_workers=0 (the GPU does the decoding work), or leave device= "
                "out of the crop to decode in the workers"
            )
