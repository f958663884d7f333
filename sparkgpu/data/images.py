"""Images: encoded bytes (JPEG, PNG, WebP) and MDS image columns to ``uint8`` CHW tensors.

```python
from sparkgpu import data
img = data.decode_image(sample["image"])                       # (3, H, W) uint8
imgs = data.decode_image(list_of_jpeg_bytes, device="cuda")    # nvJPEG, one call per batch
```

MDS columns written with MosaicML Streaming's ``jpeg``, ``png`` and ``pil`` encodings are
decoded by the loader into lists of ``uint8`` tensors of shape ``(channels, height, width)``,
channels as stored (use ``decode_image(tensor, mode="rgb")`` to make every image 3-channel).
"""

from __future__ import annotations

import numpy as np
import torch

from sparkgpu.errors import ConfigurationError, DataError

__all__ = ["decode_image", "IMAGE_ENCODINGS", "decode_image_column"]

# MDS encodings the loader decodes to image tensors.
IMAGE_ENCODINGS = frozenset({"jpeg", "png", "pil"})
_MODES = ("unchanged", "gray", "gray_alpha", "rgb", "rgb_alpha")
_PIL_CHANNELS = {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4}


def decode_image(data, *, mode: str = "rgb", device="cpu"):
    """Decodes an encoded image (JPEG, PNG, WebP, GIF) into a ``uint8`` tensor ``(C, H, W)``.

    Args:
        data: Encoded bytes (``bytes``, ``bytearray``, ``memoryview``, a 1-D ``uint8``
            tensor or array); an already decoded ``(C, H, W)`` ``uint8`` tensor, which only
            gets its channels converted to ``mode``; or a list of these, decoded together.
        mode: ``"rgb"`` (3 channels, the default), ``"rgb_alpha"``, ``"gray"``,
            ``"gray_alpha"`` or ``"unchanged"`` (as stored).
        device: ``"cpu"``, or ``"cuda[:N]"`` to decode JPEGs on the GPU with nvJPEG (a
            list is decoded in one batched call); other formats, or a torchvision without
            GPU decoding, fall back to the CPU and are then copied to the device.

    Returns:
        A tensor, or a list of tensors for a list input, on ``device``.

    Raises:
        ConfigurationError: ``mode`` or ``device`` is not one of the accepted values.
        DataError: The bytes are not an image torchvision can decode.
    """
    from torchvision.io import ImageReadMode

    if mode not in _MODES:
        raise ConfigurationError(f"mode={mode!r} is not an image mode; pass one of {', '.join(map(repr, _MODES))}")
    read_mode = getattr(ImageReadMode, mode.upper())
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ConfigurationError(f"device={device} is not supported; pass 'cpu' or 'cuda[:N]'")
    if isinstance(data, (list, tuple)):
        if device.type == "cuda":
            return _decode_on_gpu(list(data), mode, read_mode, device)
        return [_decode_one(item, mode, read_mode) for item in data]
    image = _decode_one(data, mode, read_mode)
    return image.to(device) if device.type == "cuda" else image


def _decode_one(data, mode: str, read_mode) -> torch.Tensor:
    from torchvision.io import decode_image as tv_decode

    if isinstance(data, torch.Tensor) and data.dim() == 3:
        return _convert_channels(data, mode)
    encoded = _as_uint8_tensor(data)
    try:
        return tv_decode(encoded, mode=read_mode)
    except RuntimeError as exc:
        raise DataError(
            f"cannot decode an image of {encoded.numel()} bytes starting {bytes(encoded[:8].tolist())!r}: {exc}; "
            "JPEG, PNG, WebP and GIF are supported (store other formats as one of these)"
        ) from exc


def _decode_on_gpu(items: list, mode: str, read_mode, device) -> list[torch.Tensor]:
    # nvJPEG takes JPEGs only (in RGB, gray or unchanged mode): the rest go through the CPU.
    from torchvision.io import decode_jpeg

    encoded = [None if isinstance(item, torch.Tensor) and item.dim() == 3 else _as_uint8_tensor(item) for item in items]
    jpegs = [i for i, e in enumerate(encoded) if e is not None and bytes(e[:3].tolist()) == b"\xff\xd8\xff"]
    out: list = [None] * len(items)
    if jpegs and mode in ("rgb", "gray", "unchanged"):
        try:
            decoded = decode_jpeg([encoded[i] for i in jpegs], mode=read_mode, device=device)
        except RuntimeError:  # a torchvision built without nvJPEG, or an image nvJPEG rejects
            decoded = None
        if decoded is not None:
            for i, image in zip(jpegs, decoded):
                out[i] = image
    for i, item in enumerate(items):
        if out[i] is None:
            out[i] = _decode_one(item, mode, read_mode).to(device)
    return out


def _as_uint8_tensor(data) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise DataError(
                f"expected encoded image bytes as a 1-D uint8 tensor, got dtype {data.dtype} and shape {tuple(data.shape)}"
            )
        return data.cpu()
    if isinstance(data, np.ndarray):
        return torch.from_numpy(np.array(data, dtype=np.uint8).reshape(-1))  # a copy: the source may be read-only
    if isinstance(data, (bytes, bytearray, memoryview)):
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    raise DataError(
        f"cannot decode an image from a {type(data).__name__}; pass the encoded bytes (e.g. a 'bytes' or 'jpeg' column)"
    )


def _convert_channels(image: torch.Tensor, mode: str) -> torch.Tensor:
    if image.dtype != torch.uint8:
        raise DataError(f"expected a uint8 (C, H, W) image, got dtype {image.dtype}")
    channels = image.shape[0]
    wanted = {"unchanged": channels, "gray": 1, "gray_alpha": 2, "rgb": 3, "rgb_alpha": 4}[mode]
    if channels == wanted:
        return image
    color = image[: 1 if channels <= 2 else 3]
    alpha = image[-1:] if channels in (2, 4) else torch.full_like(image[:1], 255)
    if wanted in (1, 2):
        if color.shape[0] == 3:
            from torchvision.transforms.v2.functional import rgb_to_grayscale

            color = rgb_to_grayscale(color)
        return color if wanted == 1 else torch.cat([color, alpha])
    if color.shape[0] == 1:
        color = color.expand(3, -1, -1)
    return color.contiguous() if wanted == 3 else torch.cat([color, alpha])


def decode_image_column(encoding: str, items: list[bytes]) -> list[torch.Tensor]:
    """Decodes the values of an MDS ``jpeg``, ``png`` or ``pil`` column, as stored."""
    if encoding == "pil":
        return [_decode_pil(item) for item in items]
    return [_decode_one(item, "unchanged", _unchanged()) for item in items]


def _unchanged():
    from torchvision.io import ImageReadMode

    return ImageReadMode.UNCHANGED


def _decode_pil(item: bytes) -> torch.Tensor:
    # streaming's PIL encoding: [width u32][height u32][mode length u32][mode][raw pixels].
    width, height, mode_size = np.frombuffer(item[:12], np.uint32).tolist()
    pil_mode = item[12 : 12 + mode_size].decode("utf-8")
    raw = item[12 + mode_size :]
    channels = _PIL_CHANNELS.get(pil_mode)
    if channels is not None and len(raw) == width * height * channels:
        pixels = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return pixels.view(height, width, channels).permute(2, 0, 1).contiguous()
    from PIL import Image
    from torchvision.transforms.v2.functional import pil_to_tensor

    image = Image.frombytes(pil_mode, (width, height), raw)
    return pil_to_tensor(
        image if pil_mode in _PIL_CHANNELS else image.convert("RGBA" if "A" in image.getbands() else "RGB")
    )
