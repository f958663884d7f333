"""Crops decided from JPEG headers, decoded and resized into one ``uint8`` batch.

```python
from sparkgpu import data
crop = data.RandomResizedCrop(224)                      # torchvision's distribution, plus a flip
images = crop.batch(list_of_jpeg_bytes, seed=0, epoch=3, indices=sample_ids)   # (n, 3, 224, 224) uint8
images = crop.batch(list_of_jpeg_bytes, seed=0, epoch=3, indices=sample_ids, device="cuda")  # nvJPEG
x = data.normalize(images.cuda(non_blocking=True))      # float32, (x / 255 - mean) / std on the GPU
```

Crop parameters. :meth:`RandomResizedCrop.params` is torchvision's
``RandomResizedCrop.get_params`` (v1 and v2 draw alike) for a whole batch at once: ten tries of
an area fraction uniform in ``scale`` and a log aspect ratio uniform in ``log(ratio)``, width
and height rounded half to even as Python's ``round``, the first try that fits the image
placed uniformly on it; when none fits, the centre crop of the whole image clamped to the
ratio range. A horizontal flip follows with probability ``flip``.

Seeding. Every uniform number is a pure function of ``(seed, epoch, global sample index,
draw number)``, computed in numpy ``uint64`` arithmetic with no generator state:

* a sample's key is ``h(h(h(K, seed), epoch), index)`` with ``h(a, b) = mix(a ^ (b * G + G))``,
  where ``mix`` is SplitMix64's finaliser (a bijection of 64-bit words), ``G`` the golden-ratio
  increment ``0x9E3779B97F4A7C15`` and ``K`` a fixed constant; for a fixed seed and epoch
  distinct indices get distinct keys;
* draw ``d`` of the sample is ``mix(key + (d + 1) * G)``, the ``d + 1``-th output of a
  SplitMix64 generator whose state is the key, and its top 53 bits make a uniform in ``[0, 1)``;
* draws ``2t`` and ``2t + 1`` are try ``t``'s area and log ratio (``t < 10``), draws 20 and 21
  the top and left offset of the crop, draw 22 the flip.

So the crop of sample ``i`` in epoch ``e`` does not depend on which worker process, batch or
rank reads it, and a loader resumed mid-epoch produces the same pixels.

Decoding. :meth:`RandomResizedCrop.batch` reads the images' sizes from their headers
(``_jpeg.jpeg_sizes``), draws the boxes and flips, then the native decoder decodes each box
(region of interest and DCT scaling where the crop allows), resizes it and writes it into one
preallocated ``(n, 3, H, W)`` ``uint8`` buffer; without the native decoder, torchvision
decodes and crops (``_jpeg.decode_crops`` chooses). ``device="cuda"`` decodes the batch with
nvJPEG in one call, then crops, resizes (bilinear, antialiased) and flips each image on the
GPU, with the same boxes and flips: only the resampling differs, by a few grey levels.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["RandomResizedCrop", "CenterCrop", "normalize", "uniforms", "IMAGENET_MEAN", "IMAGENET_STD"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_KEY = np.uint64(0x5350_4152_4B47_5055)  # a fixed start, so seed 0 does not begin at 0
_TRIES = 10
_TOP, _LEFT, _FLIP = 2 * _TRIES, 2 * _TRIES + 1, 2 * _TRIES + 2
_DRAWS = _FLIP + 1


def _mix(z: np.ndarray) -> np.ndarray:
    # SplitMix64's finaliser (Stafford's Mix13); uint64 arrays wrap silently, as intended.
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _absorb(key: np.ndarray, value: np.ndarray) -> np.ndarray:
    return _mix(key ^ (value * _GAMMA + _GAMMA))


def uniforms(seed: int, epoch: int, indices, draws: int) -> np.ndarray:
    """The uniform numbers in ``[0, 1)`` of each sample: ``(len(indices), draws)`` ``float64``.

    Row ``k`` depends only on ``(seed, epoch, indices[k])`` (see the module's description).
    """
    ids = np.asarray(indices, dtype=np.int64).reshape(-1).astype(np.uint64)
    key = _absorb(np.full(1, _KEY, dtype=np.uint64), np.full(1, seed & (2**64 - 1), dtype=np.uint64))
    key = _absorb(key, np.full(1, epoch & (2**64 - 1), dtype=np.uint64))
    keys = _absorb(np.broadcast_to(key, ids.shape), ids)
    steps = (np.arange(1, draws + 1, dtype=np.uint64) * _GAMMA)[None, :]
    words = _mix(keys[:, None] + steps)
    return (words >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _pair(value, name: str, example: str) -> tuple[float, float]:
    if (
        not isinstance(value, Sequence)
        or len(value) != 2
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
        or not 0 < value[0] <= value[1]
    ):
        raise ConfigurationError(
            f"{name}={value!r} must be a (min, max) pair of positive numbers, e.g. {name}={example}"
        )
    return float(value[0]), float(value[1])


def _size(value, name: str = "size") -> tuple[int, int]:
    pair = (value, value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else value
    if (
        not isinstance(pair, Sequence)
        or len(pair) != 2
        or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in pair)
    ):
        raise ConfigurationError(f"{name}={value!r} must be a positive int or a (height, width) pair, e.g. {name}=224")
    return int(pair[0]), int(pair[1])


def _device(value) -> str:
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigurationError(f"device={value!r} is not where a crop can decode; pass 'cpu' or 'cuda[:N]'")
    return str(device)


def _check_sizes(sizes) -> tuple[np.ndarray, np.ndarray]:
    sizes = np.asarray(sizes)
    if sizes.ndim != 2 or sizes.shape[1] != 2:
        raise ConfigurationError(f"sizes must be an (n, 2) array of (height, width), got shape {sizes.shape}")
    return sizes[:, 0].astype(np.int64), sizes[:, 1].astype(np.int64)


class _FusedCrop:
    """What both crops share: boxes from image sizes, then one batch decode into a buffer."""

    size: tuple[int, int]

    def params(self, sizes, *, seed: int, epoch: int, indices) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def batch(self, encoded: list, *, seed: int, epoch: int, indices, out=None, device="cpu") -> torch.Tensor:
        """Decodes, crops, resizes and flips a batch of JPEGs into one ``uint8`` tensor.

        Args:
            encoded: The JPEG files' bytes (``bytes``, or anything the native decoder takes).
            seed: The run's seed.
            epoch: The epoch the batch belongs to.
            indices: Global sample index of each image (what makes its crop reproducible).
            out: A C-contiguous ``uint8`` tensor of shape ``(n, 3, *size)`` on ``device`` to
                write into (for instance pinned memory); ``None`` allocates one.
            device: ``"cpu"`` (the native decoder), or ``"cuda[:N]"`` (nvJPEG, crops on the GPU).

        Returns:
            ``(n, 3, height, width)`` ``uint8`` RGB images: ``out`` when given.

        Raises:
            DataError: A value is not a JPEG file, or cannot be decoded.
            ConfigurationError: ``out`` or ``device`` does not fit.
        """
        from sparkgpu.data.augment import _jpeg

        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ConfigurationError(f"device={device} is not supported; pass 'cpu' or 'cuda[:N]'")
        n = len(encoded)
        if out is not None:
            _check_out(out, n, self.size, device)
        if n == 0:
            return out if out is not None else torch.empty((0, 3, *self.size), dtype=torch.uint8, device=device)
        sizes = _jpeg.jpeg_sizes(encoded)
        boxes, flips = self.params(sizes, seed=seed, epoch=epoch, indices=indices)
        if device.type == "cuda":
            return _device_path(encoded, boxes, flips, self.size, device, out=out)
        result = _jpeg.decode_crops(encoded, boxes, flips, self.size, out=None if out is None else out.numpy())
        return out if out is not None else torch.from_numpy(result)


@dataclasses.dataclass(frozen=True, init=False)
class RandomResizedCrop(_FusedCrop):
    """torchvision's ``RandomResizedCrop`` and a horizontal flip, fused with JPEG decoding.

    ``data.dataset(..., decode={"image": data.RandomResizedCrop(224)})`` gives batches whose
    ``"image"`` is a ``(batch, 3, 224, 224)`` ``uint8`` tensor, reproducible per
    ``(seed, epoch, sample index)``.

    Args:
        size: Output size: an int (square) or ``(height, width)``.
        scale: Range of the crop's area, as a fraction of the image's.
        ratio: Range of the crop's aspect ratio (width / height), sampled on a log scale.
        flip: Probability of a horizontal flip (0 for none).
        device: Where a loader's ``decode=`` decodes: ``"cpu"`` (the native decoder, in the
            loader's workers) or ``"cuda[:N]"`` (nvJPEG in the training process, one call per
            batch, crops on the GPU; needs ``num_workers=0``).

    Raises:
        ConfigurationError: An argument is out of range.
    """

    size: tuple[int, int]
    scale: tuple[float, float]
    ratio: tuple[float, float]
    flip: float
    device: str

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip: float = 0.5, device: str = "cpu"):
        if isinstance(flip, bool) or not isinstance(flip, (int, float)) or not 0 <= flip <= 1:
            raise ConfigurationError(f"flip={flip!r} must be a probability in [0, 1], e.g. flip=0.5 (0: no flips)")
        object.__setattr__(self, "device", _device(device))
        object.__setattr__(self, "size", _size(size))
        object.__setattr__(self, "scale", _pair(scale, "scale", "(0.08, 1.0)"))
        object.__setattr__(self, "ratio", _pair(ratio, "ratio", "(3 / 4, 4 / 3)"))
        object.__setattr__(self, "flip", float(flip))

    def params(self, sizes, *, seed: int, epoch: int, indices) -> tuple[np.ndarray, np.ndarray]:
        """The crop box and flip of each image.

        Args:
            sizes: ``(n, 2)`` image sizes as ``(height, width)``.
            seed: The run's seed.
            epoch: The epoch.
            indices: The ``n`` global sample indices.

        Returns:
            ``(boxes, flips)``: ``int32`` ``(n, 4)`` boxes as ``(top, left, height, width)`` and
            ``bool`` ``(n,)`` flips.
        """
        heights, widths = _check_sizes(sizes)
        if indices is None:
            raise ConfigurationError(
                "RandomResizedCrop needs indices= (the global sample index of each image), which make each "
                "image's crop reproducible; pass e.g. indices=numpy.arange(start, start + n)"
            )
        if len(np.asarray(indices).reshape(-1)) != len(heights):
            raise ConfigurationError(
                f"indices has {len(np.asarray(indices).reshape(-1))} values for {len(heights)} images"
            )
        u = uniforms(seed, epoch, indices, _DRAWS)
        H, W = heights[:, None].astype(np.float64), widths[:, None].astype(np.float64)
        low, high = self.scale
        log_low, log_high = math.log(self.ratio[0]), math.log(self.ratio[1])
        target = H * W * (low + (high - low) * u[:, 0:_TOP:2])
        aspect = np.exp(log_low + (log_high - log_low) * u[:, 1:_TOP:2])
        w = np.rint(np.sqrt(target * aspect))  # rint rounds half to even, as Python's round
        h = np.rint(np.sqrt(target / aspect))
        fits = (w > 0) & (w <= W) & (h > 0) & (h <= H)
        found = fits.any(axis=1)
        first = fits.argmax(axis=1)
        rows = np.arange(len(heights))
        crop_h = h[rows, first].astype(np.int64)
        crop_w = w[rows, first].astype(np.int64)
        top = np.minimum((u[:, _TOP] * (heights - crop_h + 1)).astype(np.int64), heights - crop_h)
        left = np.minimum((u[:, _LEFT] * (widths - crop_w + 1)).astype(np.int64), widths - crop_w)
        if not found.all():
            # No try fits: the whole image, cut to the nearest allowed aspect ratio, centred.
            in_ratio = widths / np.maximum(heights, 1)
            narrow, wide = in_ratio < self.ratio[0], in_ratio > self.ratio[1]
            fallback_w = np.where(wide, np.rint(heights * self.ratio[1]).astype(np.int64), widths)
            fallback_h = np.where(narrow, np.rint(widths / self.ratio[0]).astype(np.int64), heights)
            crop_h, crop_w = np.where(found, crop_h, fallback_h), np.where(found, crop_w, fallback_w)
            top = np.where(found, top, (heights - crop_h) // 2)
            left = np.where(found, left, (widths - crop_w) // 2)
        boxes = np.stack([top, left, crop_h, crop_w], axis=1).astype(np.int32)
        return boxes, u[:, _FLIP] < self.flip


@dataclasses.dataclass(frozen=True, init=False)
class CenterCrop(_FusedCrop):
    """The evaluation crop: shorter side resized to ``resize``, centre ``size`` cut out. Deterministic.

    The box is taken in the decoded image's own pixels (the region torchvision's
    ``Resize(resize)`` then ``CenterCrop(size)`` keeps, within a pixel), then resized to ``size``
    in one step.

    Args:
        size: Output size: an int (square) or ``(height, width)``.
        resize: The shorter side's length before the crop; default ``size / 0.875`` rounded
            (256 for 224), taken from the shorter of the two sides of ``size``.
        device: Where a loader's ``decode=`` decodes, as for :class:`RandomResizedCrop`.

    Raises:
        ConfigurationError: An argument is out of range.
    """

    size: tuple[int, int]
    resize: int
    device: str

    def __init__(self, size, resize: int | None = None, device: str = "cpu"):
        object.__setattr__(self, "device", _device(device))
        object.__setattr__(self, "size", _size(size))
        if resize is None:
            resize = round(min(self.size) / 0.875)
        if isinstance(resize, bool) or not isinstance(resize, (int, np.integer)) or resize < max(self.size):
            raise ConfigurationError(
                f"resize={resize!r} must be an integer >= the crop's size {max(self.size)} "
                f"(the shorter side's length before the crop), e.g. resize={round(max(self.size) / 0.875)}"
            )
        object.__setattr__(self, "resize", int(resize))

    def params(self, sizes, *, seed: int = 0, epoch: int = 0, indices=None) -> tuple[np.ndarray, np.ndarray]:
        """The centre box of each image and no flips (``seed``, ``epoch``, ``indices`` are unused).

        Args:
            sizes: ``(n, 2)`` image sizes as ``(height, width)``.
            seed: Unused.
            epoch: Unused.
            indices: Unused.

        Returns:
            ``(boxes, flips)`` as :meth:`RandomResizedCrop.params`'s.
        """
        heights, widths = _check_sizes(sizes)
        pixels_per_unit = np.minimum(heights, widths) / self.resize  # source pixels per resized pixel
        crop_h = np.clip(np.rint(self.size[0] * pixels_per_unit).astype(np.int64), 1, heights)
        crop_w = np.clip(np.rint(self.size[1] * pixels_per_unit).astype(np.int64), 1, widths)
        boxes = np.stack([(heights - crop_h) // 2, (widths - crop_w) // 2, crop_h, crop_w], axis=1).astype(np.int32)
        return boxes, np.zeros(len(heights), dtype=bool)


def _check_out(out, n: int, size: tuple[int, int], device: torch.device) -> None:
    if (
        not isinstance(out, torch.Tensor)
        or out.dtype != torch.uint8
        or tuple(out.shape) != (n, 3, *size)
        or not out.is_contiguous()
        or out.device.type != device.type
    ):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigurationError(
            f"out= must be a contiguous uint8 tensor of shape {(n, 3, *size)} on {device}, got {shape}; "
            f"allocate it as torch.empty({(n, 3, *size)}, dtype=torch.uint8)"
        )


def _device_path(encoded: list, boxes: np.ndarray, flips: np.ndarray, size: tuple[int, int], device, out=None):
    """nvJPEG decode of the whole batch, then crop, resize and flip per image on ``device``.

    Runs on CPU tensors too (``device="cpu"``: torchvision's CPU decoder), which is how it is
    tested where there is no GPU.
    """
    from torchvision.io import ImageReadMode, decode_jpeg

    device = torch.device(device)
    data = [_as_uint8(item) for item in encoded]
    try:
        images = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError as exc:
        if device.type == "cpu":
            raise DataError(f"cannot decode a JPEG of this batch: {exc}; check the column holds JPEG files") from exc
        # A torchvision built without nvJPEG, or a file nvJPEG refuses: decode on the CPU, crop on the device.
        images = [image.to(device) for image in decode_jpeg(data, mode=ImageReadMode.RGB)]
    if out is None:
        out = torch.empty((len(images), 3, *size), dtype=torch.uint8, device=device)
    for k, (image, (top, left, height, width), flip) in enumerate(zip(images, boxes.tolist(), flips.tolist())):
        crop = image[None, :, top : top + height, left : left + width].float()
        resized = torch.nn.functional.interpolate(crop, size=size, mode="bilinear", antialias=True, align_corners=False)
        if flip:
            resized = resized.flip(-1)
        out[k].copy_(resized[0].round_().clamp_(0, 255))
    return out


def _as_uint8(item) -> torch.Tensor:
    if isinstance(item, torch.Tensor):
        return item.reshape(-1).cpu()
    return torch.frombuffer(bytearray(item), dtype=torch.uint8)


def normalize(
    images: torch.Tensor,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    *,
    dtype: torch.dtype = torch.float32,
    channels_last: bool = False,
) -> torch.Tensor:
    """``(images / 255 - mean) / std`` per channel, on the images' device.

    Made for after the loader's ``device=`` transfer: ``uint8`` batches cross the bus in a
    quarter of ``float32``'s bytes, and this runs on the GPU.

    Args:
        images: ``uint8`` images, ``(n, C, H, W)`` or ``(C, H, W)``.
        mean: Per-channel mean, on the 0..1 scale (default ImageNet's).
        std: Per-channel standard deviation, on the 0..1 scale (default ImageNet's).
        dtype: The floating-point dtype of the result.
        channels_last: Return a 4-D result in ``torch.channels_last`` memory format.

    Returns:
        A new tensor of ``dtype`` on the images' device.

    Raises:
        ConfigurationError: ``images`` is not ``uint8`` with one channel per mean and std.
    """
    channels = len(mean)
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() not in (3, 4):
        what = (
            f"{images.dtype} tensor of shape {tuple(images.shape)}"
            if isinstance(images, torch.Tensor)
            else type(images).__name__
        )
        raise ConfigurationError(f"normalize takes uint8 (n, C, H, W) images, got a {what}")
    if len(std) != channels or images.shape[-3] != channels:
        raise ConfigurationError(
            f"images have {images.shape[-3]} channels, mean {len(mean)} and std {len(std)} values; pass one per channel"
        )
    if not dtype.is_floating_point:
        raise ConfigurationError(
            f"dtype={dtype} is not a floating-point type; pass e.g. torch.float32 or torch.bfloat16"
        )
    memory_format = torch.channels_last if channels_last and images.dim() == 4 else torch.contiguous_format
    x = images.to(dtype=dtype, memory_format=memory_format)
    shape = (channels, 1, 1)
    x.div_(255).sub_(torch.tensor(mean, dtype=dtype).view(shape).to(x.device, non_blocking=True))
    return x.div_(torch.tensor(std, dtype=dtype).view(shape).to(x.device, non_blocking=True))
