"""Fused JPEG decode + RandomResizedCrop + flip: sparkgpu's decode_crops against Pillow and torchvision.

Question: on one CPU thread, how many ImageNet-like JPEGs per second become (3, 224, 224) uint8
crops in a batch buffer when only the box is decoded (libjpeg-turbo's jpeg_crop_scanline and
jpeg_skip_scanlines, IDCT scaling while the scaled box keeps at least 224 pixels) and resized
and mirrored straight into the batch, against decoding whole images first?

Method: --images JPEGs of 500x375 made by bench_images.py's generator (random smooth content plus
noise, quality 90: about 110 KB each), held in memory as bytes. One box per image drawn as
torchvision's RandomResizedCrop draws them (scale (0.08, 1), ratio (3/4, 4/3)) and one coin per
image for the flip, the same for every side. Sides, each writing every crop into the same
preallocated (n, 3, 224, 224) uint8 buffer:
  * pillow: Image.open + resize(BILINEAR, box=...) (PIL's reduce is antialiased) + transpose;
  * torchvision: torchvision.io.decode_jpeg + v2.functional.resized_crop(antialias=True) + hflip;
  * native: sparkgpu.data.augment._jpeg.decode_crops, one call for the whole set, threads=1;
  * fallback: the same call with the native path switched off (torchvision underneath).
torch runs on one thread. Each of --repeats repeats times every side once over all images, in an
order that alternates from repeat to repeat; figures are medians over the repeats, ratios divide
medians. The clock is the wall clock, or with --clock cpu this process's CPU time, which other
jobs on a shared machine disturb less (every side runs on this one thread either way). Read the
ratios, not the absolute figures.

    python benchmarks/bench_jpeg_decode.py                        # 300 images x 3 repeats: under a minute
    python benchmarks/bench_jpeg_decode.py --clock cpu            # on a busy machine
    python benchmarks/bench_jpeg_decode.py --out results/jpeg_decode.json
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_images import CROP, HEIGHT, WIDTH, make_images
from common import load_seen, machine, method, spread


def load_images(count: int, quality: int, noise: float) -> list[bytes]:
    with tempfile.TemporaryDirectory() as folder:
        make_images(Path(folder), count, quality, workers=2, noise=noise)
        return [p.read_bytes() for p in sorted(Path(folder).glob("class*/*.jpg"))]


def draw_boxes(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    import torch
    from torchvision.transforms import RandomResizedCrop

    torch.manual_seed(seed)
    image = torch.empty(3, HEIGHT, WIDTH, dtype=torch.uint8)
    boxes = [RandomResizedCrop.get_params(image, scale=[0.08, 1.0], ratio=[3 / 4, 4 / 3]) for _ in range(count)]
    flips = np.random.default_rng(seed).random(count) < 0.5
    return np.array(boxes, dtype=np.int32), flips


def pillow_side(encoded, boxes, flips, out) -> None:
    from PIL import Image

    for i, data in enumerate(encoded):
        top, left, h, w = boxes[i].tolist()
        image = Image.open(io.BytesIO(data)).convert("RGB")
        image = image.resize((CROP, CROP), Image.BILINEAR, box=(left, top, left + w, top + h))
        if flips[i]:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        out[i] = np.asarray(image).transpose(2, 0, 1)


def torchvision_side(encoded, boxes, flips, out) -> None:
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2 import functional as F

    tensors = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in encoded]
    for i, tensor in enumerate(tensors):
        top, left, h, w = boxes[i].tolist()
        image = F.resized_crop(
            decode_jpeg(tensor, mode=ImageReadMode.RGB), top, left, h, w, [CROP, CROP], antialias=True
        )
        if flips[i]:
            image = F.horizontal_flip(image)
        out[i] = image.numpy()


def native_side(encoded, boxes, flips, out) -> None:
    from sparkgpu.data.augment import _jpeg

    _jpeg.decode_crops(encoded, boxes, flips, (CROP, CROP), out, threads=1)


def fallback_side(encoded, boxes, flips, out) -> None:
    from sparkgpu.data.augment import _jpeg

    previous = _jpeg.set_native_enabled(False)
    try:
        _jpeg.decode_crops(encoded, boxes, flips, (CROP, CROP), out, threads=1)
    finally:
        _jpeg.set_native_enabled(previous)


SIDES = {"pillow": pillow_side, "torchvision": torchvision_side, "native": native_side, "fallback": fallback_side}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--noise", type=float, default=24.0, help="noise added to the smooth content (24: ~110 KB)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: this process's CPU time")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()

    import warnings

    import torch

    from sparkgpu.data.augment import _jpeg

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*TorchVision are deprecated.*")  # decode_jpeg's notice
    sides = dict(SIDES)
    if not _jpeg.native_available():
        print(f"native path skipped: {_jpeg.native_unavailable_reason()}")
        del sides["native"]
    facts = machine()
    encoded = load_images(args.images, args.quality, args.noise)
    boxes, flips = draw_boxes(len(encoded), args.seed)
    out = np.empty((len(encoded), 3, CROP, CROP), dtype=np.uint8)
    for side in sides.values():  # warm-up: imports, first-call costs
        side(encoded[:8], boxes[:8], flips[:8], out[:8])
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for repeat in range(args.repeats):
        order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
        for name in order:
            start = clock()
            sides[name](encoded, boxes, flips, out)
            rates[name].append(len(encoded) / (clock() - start))
    facts = load_seen(facts)

    medians = {name: spread(values, higher_is_better=True) for name, values in rates.items()}
    base = medians["pillow"]["median"]
    mean_kb = sum(map(len, encoded)) / len(encoded) / 1024
    print(
        f"{len(encoded)} JPEGs of {WIDTH}x{HEIGHT}, {mean_kb:.0f} KB on average; one thread; "
        f"{args.repeats} repeats; {args.clock} clock"
    )
    print(f"{'side':<12} {'images/s':>10} {'vs pillow':>10}   runs")
    for name, stats in medians.items():
        runs = " ".join(f"{v:.0f}" for v in stats["runs"])
        print(f"{name:<12} {stats['median']:>10.0f} {stats['median'] / base:>9.2f}x   {runs}")
    if args.out:
        result = {
            "machine": facts,
            "images": len(encoded),
            "mean_kb": round(mean_kb, 1),
            "size": [CROP, CROP],
            "clock": args.clock,
            "images_per_s": medians,
            "ratio_to_pillow": {name: stats["median"] / base for name, stats in medians.items()},
            "method": method(
                "every image of the set decoded, cropped, resized and flipped into one batch buffer",
                startup="excluded: one warm-up call per side on 8 images before timing",
                repeats=args.repeats,
                threads=1,
                order="sides alternate from repeat to repeat",
            ),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
