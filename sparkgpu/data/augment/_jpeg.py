"""JPEG decode + crop + resize + flip in one step, into a ``uint8`` batch the caller may preallocate.

``RandomResizedCrop`` keeps part of an image and shrinks it; decoding all of it first and
cropping after is wasted work. With the C extension ``sparkgpu._jpeg`` built and a libjpeg-turbo
(1.5 or newer, libjpeg 6.2 ABI) found, :func:`decode_crops` decodes only the rows and iMCU
columns around each box, at 1/2 or 1/4 scale in the IDCT while the scaled box still has at least
as many pixels as the output (1/8 while it has twice as many), resizes with antialiasing and
mirrors straight into the batch, with the GIL released and the batch shared among a few threads.
Boxes too small for IDCT scaling come out within rounding of the fallback's; scaled ones differ
by what the smaller IDCT leaves out (35 dB PSNR or more on test photos). The library is the one
Pillow's wheels bundle (``pillow.libs/libjpeg*.so*``), else a system ``libjpeg.so.62``; the
extension loads it at run time, so it builds without JPEG headers or libraries installed.

Without them the same call decodes with torchvision (full image, crop, ``resize(antialias=True)``,
flip): same shapes, values within rounding and the IDCT scaling's small differences.
``benchmarks/bench_jpeg_decode.py`` measures both against Pillow and torchvision pipelines.

Corrupt data: an error libjpeg cannot recover from, or data that ends before the rows a crop
needs, raises :class:`~sparkgpu.errors.DataError` naming the image's position in the batch. A
file cut short *below* its box decodes (the native path never reads that far; the fallback
decodes the whole image and raises), and warnings about corrupt entropy-coded data are ignored
as Pillow and torchvision ignore them: libjpeg fills what it cannot read and goes on.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np

from sparkgpu.errors import ConfigurationError, DataError

try:
    from sparkgpu import _jpeg as _ext
except ImportError:  # built without a C compiler: torchvision decodes instead
    _ext = None

__all__ = [
    "native_available",
    "native_enabled",
    "native_unavailable_reason",
    "set_native_enabled",
    "jpeg_sizes",
    "decode_crops",
]

logger = logging.getLogger(__name__)

_THREADS = max(1, min(8, os.cpu_count() or 1))
_FAIL_DATA, _FAIL_BOX = 1, 2
_load_lock = threading.Lock()
_load_tried = False
_library: str | None = None
_unavailable: str | None = (
    None
    if _ext is not None
    else "the C extension sparkgpu._jpeg is not built (it needs a C compiler: pip install -e . or "
    "python setup.py build_ext --inplace)"
)
_enabled = True


def native_available() -> bool:
    """True when the C extension is built and a libjpeg-turbo with the 6.2 ABI is loaded."""
    return _load()


def native_enabled() -> bool:
    """True when :func:`decode_crops` takes the native path (available and not switched off)."""
    return _enabled and _load()


def native_unavailable_reason() -> str | None:
    """Why the native path is unavailable (with what to install or build), or ``None`` when it is."""
    _load()
    return _unavailable


def set_native_enabled(enabled: bool) -> bool:
    """Switches the native path on or off (tests and benchmarks compare both); returns the previous value.

    Args:
        enabled: Use the C extension when it is available.
    """
    global _enabled
    previous = _enabled
    _enabled = bool(enabled)
    return previous


def _candidate_libraries() -> list[str]:
    candidates = []
    try:
        import PIL

        site = Path(PIL.__file__).resolve().parent
        for pattern in ("../pillow.libs/libjpeg*.so*", ".dylibs/libjpeg*.dylib"):
            candidates += sorted(str(p) for p in site.glob(pattern))
    except ImportError:
        pass
    candidates.append("libjpeg.so.62")  # a system libjpeg-turbo, found by the dynamic loader
    return candidates


def _load() -> bool:
    global _load_tried, _library, _unavailable
    if _ext is None:
        return False
    with _load_lock:
        if not _load_tried:
            _load_tried = True
            reasons = []
            for path in _candidate_libraries():
                try:
                    _ext.load(path)
                except OSError as exc:
                    reasons.append(str(exc))
                    continue
                _library = path
                logger.debug("JPEG crops are decoded natively with %s", path)
                break
            else:
                _unavailable = (
                    f"no libjpeg-turbo with the libjpeg 6.2 ABI could be loaded ({'; '.join(reasons)}); "
                    "install Pillow from its wheels (pip install pillow) or the system's libjpeg-turbo "
                    "(apt-get install libjpeg62-turbo)"
                )
                logger.info("%s: JPEG crops are decoded with torchvision", _unavailable)
    return _library is not None


# Inputs.


def _as_buffers(encoded) -> list:
    """The encoded images as objects exposing contiguous byte buffers."""
    items = list(encoded)
    for i, item in enumerate(items):
        if isinstance(item, (bytes, bytearray)):
            continue
        if isinstance(item, memoryview):
            if not item.c_contiguous:
                items[i] = item.tobytes()
            continue
        if type(item).__module__.startswith("torch"):
            item = item.detach().cpu().numpy()
        if not isinstance(item, np.ndarray) or item.dtype != np.uint8 or item.ndim != 1:
            described = (
                f"a {item.dtype} array of shape {item.shape}" if isinstance(item, np.ndarray) else type(item).__name__
            )
            raise DataError(
                f"encoded image {i} of the batch is {described}; pass JPEG bytes as bytes, bytearray, memoryview "
                "or a 1-D uint8 array or tensor"
            )
        items[i] = np.ascontiguousarray(item)
    return items


def _describe(item) -> str:
    head = bytes(memoryview(item)[:8])
    return f"{len(memoryview(item).cast('B'))} bytes starting {head!r}"


# Sizes from the frame header.


def jpeg_sizes(encoded: list) -> np.ndarray:
    """``(height, width)`` of each JPEG, read from its frame header (SOF marker) without decoding.

    Args:
        encoded: JPEG files' bytes: ``bytes``, ``bytearray``, ``memoryview``, or 1-D ``uint8``
            numpy arrays or torch tensors.

    Returns:
        An ``int32`` array of shape ``(n, 2)``.

    Raises:
        DataError: An item is not a JPEG, or ends before its frame header.
    """
    items = _as_buffers(encoded)
    sizes = np.empty((len(items), 2), dtype=np.int32)
    if _ext is not None and _enabled:
        failure = _ext.jpeg_sizes(sizes, items)
    else:
        failure = _python_sizes(items, sizes)
    if failure is not None:
        index, why = failure
        raise DataError(
            f"encoded image {index} of the batch ({_describe(items[index])}) {why}; only JPEGs are read here "
            "(decode other formats with sparkgpu.data.decode_image)"
        )
    return sizes


_NOT_FRAMES = {0xC4, 0xC8, 0xCC}  # DHT, JPG, DAC share the SOF range


def _python_sizes(items: list, sizes: np.ndarray) -> tuple[int, str] | None:
    for i, item in enumerate(items):
        why = _frame_size(memoryview(item).cast("B"), sizes[i])
        if why is not None:
            return i, why
    return None


def _frame_size(data: memoryview, size: np.ndarray) -> str | None:
    # The same walk as frame_size() in native/jpeg_crop.c.
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return "does not start with a JPEG SOI marker (FF D8)"
    pos = 2
    while True:
        while pos < n and data[pos] != 0xFF:
            pos += 1
        while pos < n and data[pos] == 0xFF:
            pos += 1
        if pos >= n:
            return "ends before its frame header (truncated?)"
        marker = data[pos]
        pos += 1
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            continue
        if marker in (0xD9, 0xDA):
            return "has no frame header before its image data"
        if pos + 2 > n:
            return "ends before its frame header (truncated?)"
        length = (data[pos] << 8) | data[pos + 1]
        if length < 2:
            return "has a marker segment of a bad length"
        if 0xC0 <= marker <= 0xCF and marker not in _NOT_FRAMES:
            if length < 7 or pos + 7 > n:
                return "ends inside its frame header (truncated?)"
            size[0] = (data[pos + 3] << 8) | data[pos + 4]
            size[1] = (data[pos + 5] << 8) | data[pos + 6]
            if size[0] == 0 or size[1] == 0:
                return "has a frame header with a zero height or width"
            return None
        pos += length


# Decode + crop + resize + flip.


def decode_crops(
    encoded: list,
    boxes: np.ndarray,
    flips: np.ndarray,
    size: tuple[int, int],
    out: np.ndarray | None = None,
    *,
    threads: int | None = None,
) -> np.ndarray:
    """Decodes a box of each JPEG, resizes it with antialiasing, mirrors it where asked, into one batch.

    The resize is bilinear with its support widened by the downscale factor (as torchvision's
    ``antialias=True`` and PIL's ``BILINEAR`` reduce). Grayscale JPEGs come out as RGB, and
    CMYK ones are converted as torchvision converts them (Adobe's inverted ink).

    Args:
        encoded: JPEG files' bytes: ``bytes``, ``bytearray``, ``memoryview``, or 1-D ``uint8``
            numpy arrays or torch tensors.
        boxes: Integer array of shape ``(n, 4)``: ``(top, left, height, width)`` of each crop in
            its full image's pixels (:func:`jpeg_sizes` reads the images' sizes).
        flips: Array of ``n`` booleans: mirror image ``i`` horizontally where true.
        size: The output's ``(height, width)``.
        out: A C-contiguous ``uint8`` array of shape ``(n, 3, height, width)`` to fill (for
            instance a numpy view of a pinned torch tensor); allocated when ``None``.
        threads: Threads decoding the batch (native path); by default up to 8, as the CPUs allow.

    Returns:
        ``out``, filled with RGB images.

    Raises:
        ConfigurationError: ``boxes``, ``flips``, ``size`` or ``out`` has the wrong shape or type,
            or a box is not inside its image.
        DataError: An item is not a JPEG, or is corrupt or cut short where its box lies.
    """
    items = _as_buffers(encoded)
    n = len(items)
    height, width = _check_size(size)
    boxes = _check_boxes(boxes, n)
    flips = _check_flips(flips, n)
    out = _check_out(out, (n, 3, height, width))
    if n == 0:
        return out
    if _enabled and _load():
        assert _ext is not None
        failure = _ext.decode_crops(out, items, boxes, flips, height, width, threads or _THREADS)
        if failure is not None:
            index, kind, message = failure
            _raise_failure(items, index, kind, message, boxes)
        return out
    _decode_crops_torchvision(items, boxes, flips, (height, width), out)
    return out


def _check_size(size) -> tuple[int, int]:
    try:
        height, width = (int(v) for v in size)
    except (TypeError, ValueError):
        raise ConfigurationError(f"size={size!r} must be (height, width), e.g. (224, 224)") from None
    if height < 1 or width < 1:
        raise ConfigurationError(f"size={size!r} must be positive, e.g. (224, 224)")
    return height, width


def _check_boxes(boxes, n: int) -> np.ndarray:
    array = np.asarray(boxes)
    if array.shape != (n, 4) or not np.issubdtype(array.dtype, np.integer):
        raise ConfigurationError(
            f"boxes must be an integer array of shape ({n}, 4) of (top, left, height, width), "
            f"got {array.dtype} of shape {array.shape}"
        )
    bad = np.flatnonzero((array[:, :2] < 0).any(axis=1) | (array[:, 2:] < 1).any(axis=1))
    if len(bad):
        raise ConfigurationError(
            f"box {int(bad[0])} of the batch is {array[bad[0]].tolist()}: top and left must be >= 0 "
            "and height and width >= 1"
        )
    return np.ascontiguousarray(array, dtype=np.int32)


def _check_flips(flips, n: int) -> np.ndarray:
    array = np.asarray(flips)
    if array.shape != (n,):
        raise ConfigurationError(f"flips must hold one boolean per image, shape ({n},); got shape {array.shape}")
    return np.ascontiguousarray(array != 0, dtype=np.uint8)


def _check_out(out, shape: tuple[int, int, int, int]) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype=np.uint8)
    if (
        not isinstance(out, np.ndarray)
        or out.dtype != np.uint8
        or out.shape != shape
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        got = f"{out.dtype} of shape {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ConfigurationError(
            f"out must be a writable C-contiguous uint8 numpy array of shape {shape}, got {got}"
            + ("" if not isinstance(out, np.ndarray) or out.flags.c_contiguous else " (not C-contiguous)")
            + "; pass out=None to allocate one, or tensor.numpy() of a contiguous uint8 tensor"
        )
    return out


def _raise_failure(items: list, index: int, kind: int, message: str, boxes: np.ndarray) -> None:
    if kind == _FAIL_BOX:
        raise ConfigurationError(
            f"box {index} of the batch: {message}; boxes are (top, left, height, width) in the image's pixels "
            "(read the sizes with jpeg_sizes)"
        )
    if kind == _FAIL_DATA:
        raise DataError(
            f"JPEG {index} of the batch ({_describe(items[index])}) cannot be decoded: {message}; "
            "drop or re-encode that sample (decode formats other than JPEG with sparkgpu.data.decode_image)"
        )
    raise MemoryError(f"out of memory decoding JPEG {index} of the batch (box {boxes[index].tolist()})")


def _decode_crops_torchvision(
    items: list, boxes: np.ndarray, flips: np.ndarray, size: tuple[int, int], out: np.ndarray
) -> None:
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2 import functional as F

    for i, item in enumerate(items):
        encoded = torch.from_numpy(np.frombuffer(item, dtype=np.uint8).copy())
        try:
            image = decode_jpeg(encoded, mode=ImageReadMode.RGB)
        except RuntimeError as exc:  # "decode_jpeg, <source file>:<line>, <libjpeg's message>"
            _raise_failure(items, i, _FAIL_DATA, str(exc).strip().split(", ", 2)[-1], boxes)
        top, left, box_h, box_w = boxes[i].tolist()
        image_h, image_w = image.shape[-2:]
        if top + box_h > image_h or left + box_w > image_w:
            _raise_failure(
                items,
                i,
                _FAIL_BOX,
                f"box (top={top}, left={left}, height={box_h}, width={box_w}) is not inside the "
                f"{image_w}x{image_h} image (width x height)",
                boxes,
            )
        crop = F.resize(image[:, top : top + box_h, left : left + box_w], list(size), antialias=True)
        if flips[i]:
            crop = crop.flip(-1)
        out[i] = crop.numpy()
