"""The fused JPEG decode + crop + resize + flip (sparkgpu.data.augment._jpeg), native and fallback.

The native path is compared with the reference it stands in for: torchvision decodes the whole
image, crops, resizes with antialias=True and flips. Real JPEGs encoded by Pillow: RGB 4:2:0,
4:4:4 and 4:2:2, progressive, grayscale, CMYK, odd sizes.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from sparkgpu.data.augment import _jpeg
from sparkgpu.errors import ConfigurationError, DataError

# name -> (width, height, mode, save options)
KINDS = {
    "rgb420": (500, 375, "RGB", {"subsampling": 2}),
    "odd444": (333, 517, "RGB", {"subsampling": 0}),
    "odd422": (517, 333, "RGB", {"subsampling": 1}),
    "progressive": (401, 299, "RGB", {"subsampling": 2, "progressive": True}),
    "gray": (301, 199, "L", {}),
    "small": (64, 48, "RGB", {"subsampling": 2}),
    "cmyk": (200, 150, "CMYK", {}),
}


def _content(width: int, height: int, seed: int) -> np.ndarray:
    """Smooth random colours, a few shapes and some noise: what a photo's statistics look like."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(2, height // 25), max(2, width // 25), 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(5, width // 2 + 6)), y0 + int(rng.integers(5, height // 2 + 6))
        draw.ellipse((x0, y0, x1, y1), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    pixels = np.asarray(image, dtype=np.float32) + rng.normal(0, 8, (height, width, 3))
    return pixels.clip(0, 255).astype(np.uint8)


def _encode(width: int, height: int, mode: str, options: dict, seed: int = 0) -> bytes:
    image = Image.fromarray(_content(width, height, seed)).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90, **options)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def jpegs() -> dict[str, bytes]:
    return {
        name: _encode(w, h, mode, options, seed) for seed, (name, (w, h, mode, options)) in enumerate(KINDS.items())
    }


@pytest.fixture
def native():
    """The native path, on; skipped with the reason when the extension or a libjpeg is missing."""
    if not _jpeg.native_available():
        pytest.skip(_jpeg.native_unavailable_reason() or "native JPEG path unavailable")
    previous = _jpeg.set_native_enabled(True)
    yield
    _jpeg.set_native_enabled(previous)


@pytest.fixture
def fallback():
    previous = _jpeg.set_native_enabled(False)
    yield
    _jpeg.set_native_enabled(previous)


def _reference(data: bytes, box, flip: bool, size) -> np.ndarray:
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2 import functional as F

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        image = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    top, left, h, w = box
    crop = F.resize(image[:, top : top + h, left : left + w], list(size), antialias=True)
    return (crop.flip(-1) if flip else crop).numpy()


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _boxes(width: int, height: int, seed: int) -> list[tuple[int, int, int, int]]:
    """RandomResizedCrop-like boxes plus the edge cases: edges, 1-pixel strips, whole image, tiny."""
    rng = np.random.default_rng(seed)
    boxes = [(0, 0, height, width), (height - 1, 0, 1, width), (0, width - 1, height, 1)]
    boxes += [(height - 20, width - 30, 20, 30), (0, 0, min(12, height), min(9, width))]
    boxes += [(height // 3, width // 4, 1, 1), (height - height // 2, width - width // 2, height // 2, width // 2)]
    for _ in range(8):
        h = int(rng.integers(1, height + 1))
        w = int(rng.integers(1, width + 1))
        boxes.append((int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w))
    return boxes


# Sizes from the frame header.


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "python"])
def test_jpeg_sizes_match_pillow(jpegs, use_native):
    if use_native and _jpeg._ext is None:
        pytest.skip(_jpeg.native_unavailable_reason() or "sparkgpu._jpeg is not built")
    previous = _jpeg.set_native_enabled(use_native)
    try:
        items = list(jpegs.values())
        kinds = [items[0], bytearray(items[1]), memoryview(items[2]), np.frombuffer(items[3], dtype=np.uint8)]
        kinds += [torch.frombuffer(bytearray(items[4]), dtype=torch.uint8)] + items[5:]
        sizes = _jpeg.jpeg_sizes(kinds)
    finally:
        _jpeg.set_native_enabled(previous)
    assert sizes.dtype == np.int32 and sizes.shape == (len(items), 2)
    assert sizes.tolist() == [list(Image.open(io.BytesIO(data)).size[::-1]) for data in items]


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "python"])
def test_jpeg_sizes_name_bad_items(jpegs, use_native):
    if use_native and _jpeg._ext is None:
        pytest.skip(_jpeg.native_unavailable_reason() or "sparkgpu._jpeg is not built")
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, "PNG")
    data = jpegs["rgb420"]
    sof = data.index(b"\xff\xc0")
    previous = _jpeg.set_native_enabled(use_native)
    try:
        with pytest.raises(DataError, match="encoded image 1 of the batch .* JPEG SOI marker"):
            _jpeg.jpeg_sizes([data, png.getvalue()])
        with pytest.raises(DataError, match="encoded image 0 .*ends before its frame header"):
            _jpeg.jpeg_sizes([data[: sof - 10]])
        with pytest.raises(DataError, match="ends inside its frame header"):
            _jpeg.jpeg_sizes([data[: sof + 6]])
        with pytest.raises(DataError, match="1-D uint8"):
            _jpeg.jpeg_sizes([np.zeros(10, dtype=np.float32)])
    finally:
        _jpeg.set_native_enabled(previous)


# Decoding against the reference.


@pytest.mark.parametrize("kind", list(KINDS))
def test_native_matches_torchvision(native, jpegs, kind):
    data = jpegs[kind]
    width, height = KINDS[kind][:2]
    boxes = _boxes(width, height, seed=len(kind))
    flips = np.arange(len(boxes)) % 2 == 1
    for size in [(224, 224), (40, 56)]:  # (40, 56): the IDCT scaling path on the larger boxes
        out = _jpeg.decode_crops([data] * len(boxes), np.array(boxes), flips, size)
        assert out.shape == (len(boxes), 3, *size) and out.dtype == np.uint8
        for i, box in enumerate(boxes):
            expected = _reference(data, box, bool(flips[i]), size)
            # Within rounding unless the box is large enough for IDCT scaling (1/2 and more).
            scalable = box[2] >= 2 * size[0] and box[3] >= 2 * size[1]
            assert _psnr(out[i], expected) >= (30 if scalable else 45), (kind, size, box)


@pytest.mark.parametrize("kind", ["rgb420", "odd422", "progressive"])
def test_pixels_at_imcu_boundaries_match_a_full_decode(native, jpegs, kind):
    # Fancy chroma upsampling treats a partial row's ends as the image's: the crop reaches past the box.
    data = jpegs[kind]
    positions = [(y, x) for y in (0, 7, 8, 15, 16, 17, 31, 32) for x in (0, 15, 16, 17, 31, 32, 33, 47, 48)]
    boxes = np.array([(y, x, 1, 1) for y, x in positions])
    out = _jpeg.decode_crops([data] * len(boxes), boxes, np.zeros(len(boxes), dtype=bool), (1, 1))
    width, height = Image.open(io.BytesIO(data)).size
    full = _reference(data, (0, 0, height, width), False, (height, width))
    np.testing.assert_array_equal(out[:, :, 0, 0], np.array([full[:, y, x] for y, x in positions]))


def test_flip_mirrors_exactly(native, jpegs):
    data = jpegs["odd444"]
    boxes = np.array(_boxes(333, 517, seed=3))
    n = len(boxes)
    plain = _jpeg.decode_crops([data] * n, boxes, np.zeros(n, dtype=bool), (37, 53))
    flipped = _jpeg.decode_crops([data] * n, boxes, np.ones(n, dtype=bool), (37, 53))
    np.testing.assert_array_equal(flipped, plain[..., ::-1])


def test_threads_give_the_same_batch(native, jpegs):
    items = list(jpegs.values()) * 2
    sizes = _jpeg.jpeg_sizes(items)
    boxes = np.array([[h // 4, w // 5, h // 2, w // 2] for h, w in sizes.tolist()])
    flips = np.arange(len(items)) % 3 == 0
    one = _jpeg.decode_crops(items, boxes, flips, (64, 48), threads=1)
    three = _jpeg.decode_crops(items, boxes, flips, (64, 48), threads=3)
    np.testing.assert_array_equal(one, three)


def test_fallback_is_close_to_native(native, jpegs):
    items = [jpegs["rgb420"], jpegs["gray"], jpegs["progressive"]]
    boxes = np.array([[10, 20, 300, 400], [0, 0, 199, 301], [50, 60, 120, 90]])
    flips = np.array([True, False, True])
    fast = _jpeg.decode_crops(items, boxes, flips, (112, 96))
    _jpeg.set_native_enabled(False)
    slow = _jpeg.decode_crops(items, boxes, flips, (112, 96))
    assert slow.shape == fast.shape
    for i in range(len(items)):
        assert _psnr(fast[i], slow[i]) >= 35


def test_fallback_decodes_without_the_extension(fallback, jpegs):
    assert not _jpeg.native_enabled()
    boxes = np.array([[0, 0, 375, 500], [100, 50, 20, 30]])
    out = _jpeg.decode_crops([jpegs["rgb420"]] * 2, boxes, [False, True], (32, 32))
    for i, box in enumerate(boxes.tolist()):
        np.testing.assert_array_equal(out[i], _reference(jpegs["rgb420"], box, i == 1, (32, 32)))


# The output buffer.


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "fallback"])
def test_out_is_filled_in_place(jpegs, use_native):
    if use_native and not _jpeg.native_available():
        pytest.skip(_jpeg.native_unavailable_reason() or "native JPEG path unavailable")
    previous = _jpeg.set_native_enabled(use_native)
    try:
        batch = torch.zeros(2, 3, 32, 24, dtype=torch.uint8)  # as a pinned tensor's numpy view would be
        result = _jpeg.decode_crops(
            [jpegs["small"]] * 2, np.array([[0, 0, 48, 64]] * 2), [0, 1], (32, 24), batch.numpy()
        )
    finally:
        _jpeg.set_native_enabled(previous)
    assert np.shares_memory(result, batch.numpy())
    assert batch.float().mean() > 10
    np.testing.assert_array_equal(batch[1].numpy(), batch[0].numpy()[..., ::-1])


@pytest.mark.parametrize(
    "out",
    [
        np.zeros((2, 3, 24, 32), dtype=np.uint8),  # height and width swapped
        np.zeros((2, 3, 32, 24), dtype=np.float32),
        np.zeros((2, 3, 32, 48), dtype=np.uint8)[..., ::2],  # not contiguous
        torch.zeros(2, 3, 32, 24, dtype=torch.uint8),  # a tensor, not its numpy view
    ],
    ids=["shape", "dtype", "strided", "tensor"],
)
def test_wrong_out_names_the_expected_shape(jpegs, out):
    with pytest.raises(ConfigurationError, match=r"shape \(2, 3, 32, 24\)"):
        _jpeg.decode_crops([jpegs["small"]] * 2, np.array([[0, 0, 48, 64]] * 2), [0, 0], (32, 24), out)


def test_bad_boxes_flips_and_size_are_configuration_errors(jpegs):
    items = [jpegs["small"]] * 2
    with pytest.raises(ConfigurationError, match=r"shape \(2, 4\)"):
        _jpeg.decode_crops(items, np.zeros((2, 3), dtype=np.int32), [0, 0], (8, 8))
    with pytest.raises(ConfigurationError, match="integer"):
        _jpeg.decode_crops(items, np.zeros((2, 4), dtype=np.float32), [0, 0], (8, 8))
    with pytest.raises(ConfigurationError, match="box 1 of the batch"):
        _jpeg.decode_crops(items, np.array([[0, 0, 4, 4], [0, 0, 0, 4]]), [0, 0], (8, 8))
    with pytest.raises(ConfigurationError, match=r"one boolean per image, shape \(2,\)"):
        _jpeg.decode_crops(items, np.array([[0, 0, 4, 4]] * 2), [0], (8, 8))
    with pytest.raises(ConfigurationError, match="size="):
        _jpeg.decode_crops(items, np.array([[0, 0, 4, 4]] * 2), [0, 0], (8, 0))


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "fallback"])
def test_box_outside_its_image_names_it(jpegs, use_native):
    if use_native and not _jpeg.native_available():
        pytest.skip(_jpeg.native_unavailable_reason() or "native JPEG path unavailable")
    previous = _jpeg.set_native_enabled(use_native)
    try:
        with pytest.raises(ConfigurationError, match=r"box 1 of the batch: .*not inside the 64x48 image"):
            _jpeg.decode_crops([jpegs["small"]] * 2, np.array([[0, 0, 48, 64], [1, 0, 48, 64]]), [0, 0], (8, 8))
    finally:
        _jpeg.set_native_enabled(previous)


# Corrupt data: DataError naming the position, never a crash.


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "fallback"])
def test_not_a_jpeg_names_its_position(jpegs, use_native):
    if use_native and not _jpeg.native_available():
        pytest.skip(_jpeg.native_unavailable_reason() or "native JPEG path unavailable")
    png = io.BytesIO()
    Image.new("RGB", (64, 48)).save(png, "PNG")
    items = [jpegs["small"], png.getvalue(), jpegs["small"]]
    previous = _jpeg.set_native_enabled(use_native)
    try:
        with pytest.raises(DataError, match=r"JPEG 1 of the batch \(\d+ bytes starting b'\\x89PNG"):
            _jpeg.decode_crops(items, np.array([[0, 0, 48, 64]] * 3), [0, 0, 0], (8, 8))
    finally:
        _jpeg.set_native_enabled(previous)


def test_truncated_jpeg_raises_where_the_box_needs_the_missing_rows(native, jpegs):
    data = jpegs["rgb420"]
    half = data[: len(data) // 2]
    with pytest.raises(DataError, match="JPEG 0 of the batch .*truncated"):
        _jpeg.decode_crops([half], np.array([[0, 0, 375, 500]]), [0], (64, 64))
    # A baseline JPEG cut below the box decodes: the rows after it are never read.
    top = _jpeg.decode_crops([half], np.array([[0, 0, 40, 500]]), [0], (16, 64))
    assert _psnr(top[0], _reference(data, (0, 0, 40, 500), False, (16, 64))) >= 30
    # A progressive one holds every row in every scan: cut anywhere, it is truncated for every box.
    progressive = jpegs["progressive"]
    with pytest.raises(DataError, match="truncated"):
        _jpeg.decode_crops([progressive[: len(progressive) * 3 // 4]], np.array([[0, 0, 10, 10]]), [0], (8, 8))


def test_fallback_raises_on_truncated_jpeg_whatever_the_box(fallback, jpegs):
    data = jpegs["rgb420"]
    with pytest.raises(DataError, match="JPEG 0 of the batch"):
        _jpeg.decode_crops([data[: len(data) // 2]], np.array([[0, 0, 40, 500]]), [0], (16, 64))


def test_corrupt_huffman_table_is_a_data_error(native, jpegs):
    data = bytearray(jpegs["rgb420"])
    dht = data.index(b"\xff\xc4")
    data[dht + 5 : dht + 21] = b"\x7f" * 16  # code counts summing past 256
    with pytest.raises(DataError, match="JPEG 2 of the batch .*Huffman table"):
        _jpeg.decode_crops(
            [jpegs["small"]] * 2 + [bytes(data)], np.array([[0, 0, 48, 64]] * 2 + [[0, 0, 8, 8]]), [0] * 3, (8, 8)
        )


def test_garbage_in_the_entropy_coded_data_decodes_as_libjpeg_recovers(native, jpegs):
    data = bytearray(jpegs["rgb420"])
    middle = len(data) // 2
    data[middle : middle + 200] = np.random.default_rng(0).integers(0, 255, 200, dtype=np.uint8).tobytes()  # no 0xFF
    out = _jpeg.decode_crops([bytes(data)], np.array([[0, 0, 375, 500]]), [0], (64, 64))
    reference = _reference(bytes(data), (0, 0, 375, 500), False, (64, 64))  # torchvision decodes it too
    assert _psnr(out[0], reference) >= 30


def test_random_corruption_never_crashes(native, jpegs):
    rng = np.random.default_rng(1)
    sources = [jpegs["rgb420"], jpegs["progressive"], jpegs["gray"], jpegs["cmyk"]]
    outcomes = set()
    for trial in range(60):
        data = bytearray(sources[trial % len(sources)])
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(2, len(data) - 1))
            span = int(rng.integers(1, 64))
            data[at : at + span] = rng.integers(0, 256, min(span, len(data) - at), dtype=np.uint8).tobytes()
        if trial % 5 == 0:
            data = data[: int(rng.integers(2, len(data)))]
        try:
            sizes = _jpeg.jpeg_sizes([bytes(data)])
            h, w = (int(v) for v in sizes[0])
            out = _jpeg.decode_crops([bytes(data)], np.array([[0, 0, h, w]]), [trial % 2], (24, 24))
            assert out.shape == (1, 3, 24, 24)
            outcomes.add("decoded")
        except (DataError, ConfigurationError):
            outcomes.add("raised")
    assert outcomes == {"decoded", "raised"}


def test_items_of_every_buffer_kind(native, jpegs):
    data = jpegs["small"]
    items = [data, bytearray(data), memoryview(data), np.frombuffer(data, dtype=np.uint8)]
    items.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    out = _jpeg.decode_crops(items, np.array([[0, 0, 48, 64]] * 5), np.zeros(5, dtype=bool), (16, 16))
    for i in range(1, 5):
        np.testing.assert_array_equal(out[i], out[0])
    assert _jpeg.decode_crops([], np.zeros((0, 4), dtype=np.int32), [], (8, 8)).shape == (0, 3, 8, 8)
