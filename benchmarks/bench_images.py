"""Image loading with augmentation: sparkgpu.data.dataset against its peers, over the same JPEGs.

Question: how many images per second reach the training loop as batches of augmented tensors
(decode + RandomResizedCrop(224) + horizontal flip, batch 256), from a local copy of an
ImageNet-like set, with the same number of worker processes for every reader?

The set is made here: --images JPEGs of 500x375 (random smooth content plus noise of
--noise; the default 24 makes them about 110 KB at quality 90, as ImageNet's average; --noise 10
gives the 71 KB of earlier runs), in 10 class folders. Readers, each over the same files, each
decoding as its own docs show (the decoder is recorded per reader in the results):
  * sparkgpu.data.dataset over MDS written by to_mds (JPEG bytes stored as they are), with
    decode={"image": data.RandomResizedCrop(224)}: the fused path its docs recommend (the crop
    and flip decided from the JPEG header, only the crop's region decoded, resized and flipped
    into the batch's uint8 buffer, in its worker processes);
  * the same dataset through its generic path ("sparkgpu_transform"): the jpeg column decoded
    whole with sparkgpu.data.decode_image (torchvision.io), then transform= runs the v2
    augmentation every peer runs;
  * streaming.StreamingDataset (the same MDS shards, whose ``jpeg`` column it decodes to a PIL
    image) + torch DataLoader: PIL, converted to a tensor;
  * litdata StreamingDataLoader over litdata.optimize of ``PIL.Image.open(path)`` items, as its
    docs write images: it stores the file's bytes and decodes them with torchvision.io
    (decode_jpeg) (skipped when litdata is not installed: pip install litdata);
  * torchvision ImageFolder + DataLoader over the files themselves, with ImageFolder's default
    loader: PIL, converted to a tensor.
Ceilings in the same run, each in a process pool of the same size over the bytes already in
memory: torchvision.io decode + the augmentation ("ceiling", the full-decode path every peer
takes), and sparkgpu's fused decoder alone ("ceiling_fused"). Every peer augments the uint8
tensor with the same torchvision.transforms.v2 pipeline; the fused path draws its crops from the
same distribution (tested against torchvision's). Each row also gives images/s per core (the
rate over the cores the worker processes can use).

Each reader runs one epoch in a fresh process per repeat (--repeats for every reader, the
readers' order alternating from repeat to repeat). Two figures each: start-up (construction
to first batch) and the steady rate from the first batch on; ratios divide their medians.
Results: benchmarks/results/images.json and images.png.

    python benchmarks/bench_images.py             # 20,000 images x 3 repeats: about 20 minutes on 2 cores
    python benchmarks/bench_images.py --noise 10 --out benchmarks/results/images-71kb.json   # the 71 KB set
    python benchmarks/bench_images.py --small     # 768 images, to check it runs end to end
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import load_seen, machine, method, spread

RESULTS = Path(__file__).resolve().parent / "results"
WIDTH, HEIGHT, CLASSES, CROP = 500, 375, 10, 224


# The work every reader does per image.


def augment(image):
    """decode + RandomResizedCrop(224) + flip, the same for every reader."""
    from torchvision.transforms import v2

    global _AUGMENT
    if "_AUGMENT" not in globals():
        _AUGMENT = v2.Compose([v2.RandomResizedCrop(CROP, antialias=True), v2.RandomHorizontalFlip()])
    return _AUGMENT(image)


def decode_and_augment(encoded: bytes):
    from sparkgpu.data import decode_image

    return augment(decode_image(encoded))


def sparkgpu_transform(sample, rng):
    # The loader has decoded the jpeg column already (in this worker), as torchvision.io does.
    from sparkgpu.data import decode_image

    return {"image": augment(decode_image(sample["image"])), "label": sample["label"]}


# The data set.


def _make_one(args):
    index, folder, quality, noise = args
    from PIL import Image

    rng = np.random.default_rng(index)
    coarse = rng.integers(0, 256, (HEIGHT // 25, WIDTH // 25, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((WIDTH, HEIGHT), Image.BICUBIC), dtype=np.float32)
    pixels = (smooth + rng.normal(0, noise, smooth.shape)).clip(0, 255).astype(np.uint8)
    path = Path(folder) / f"class{index % CLASSES}" / f"{index:06d}.jpg"
    Image.fromarray(pixels).save(path, quality=quality)
    return path.stat().st_size


def make_images(folder: Path, count: int, quality: int, workers: int, noise: float) -> list[int]:
    for k in range(CLASSES):
        (folder / f"class{k}").mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_make_one, [(i, str(folder), quality, noise) for i in range(count)], chunksize=64))


def image_files(folder: Path) -> list[tuple[str, int]]:
    return sorted((str(p), int(p.parent.name[len("class") :])) for p in folder.glob("class*/*.jpg"))


def write_mds(files, out: Path) -> None:
    import pyarrow as pa

    from sparkgpu.data import to_mds

    table = pa.table(
        {
            "image": pa.array([Path(p).read_bytes() for p, _ in files], pa.binary()),
            "label": np.array([label for _, label in files], dtype=np.int64),
        }
    )
    to_mds(table, str(out), columns={"image": "jpeg", "label": None}, progress=False)


def _litdata_item(item):
    from PIL import Image

    path, label = item
    return {"image": Image.open(path), "label": label}  # litdata keeps a JPEG file's bytes


def write_litdata(files, out: Path, workers: int) -> None:
    import litdata

    litdata.optimize(fn=_litdata_item, inputs=files, output_dir=str(out), chunk_bytes="64MB", num_workers=workers)


# Readers: each yields batches of (images, labels).


def ours(work: Path, batch: int, workers: int):
    """The fused path: decode=, the crop decided from the header, only its region decoded."""
    from sparkgpu import data

    return data.dataset(
        local=str(work / "mds"),
        batch_size=batch,
        shuffle=True,
        decode={"image": data.RandomResizedCrop(CROP)},
        num_workers=workers,
    )


def ours_transform(work: Path, batch: int, workers: int):
    """The generic path: the jpeg column decoded whole, then the transform= every peer runs."""
    from sparkgpu import data

    return data.dataset(
        local=str(work / "mds"), batch_size=batch, shuffle=True, transform=sparkgpu_transform, num_workers=workers
    )


class _StreamingImages:
    def __new__(cls, local):
        from streaming import StreamingDataset

        class Images(StreamingDataset):
            def __getitem__(self, index):
                from torchvision.transforms.v2.functional import pil_to_tensor

                sample = super().__getitem__(index)  # its jpeg encoding decodes to a PIL image
                return augment(pil_to_tensor(sample["image"].convert("RGB"))), sample["label"]

        return Images(local=local, batch_size=256, shuffle=True)


def streaming_peer(work: Path, batch: int, workers: int):
    import torch

    # The PIL image its jpeg column decodes to is what its docs hand a StreamingDataset user.
    return torch.utils.data.DataLoader(_StreamingImages(str(work / "mds")), batch_size=batch, num_workers=workers)


def litdata_peer(work: Path, batch: int, workers: int):
    import litdata

    class Images(litdata.StreamingDataset):
        def __getitem__(self, index):
            sample = super().__getitem__(index)  # a uint8 tensor, decoded by its serializer (torchvision.io)
            return augment(sample["image"]), sample["label"]

    return litdata.StreamingDataLoader(
        Images(str(work / "litdata"), shuffle=True), batch_size=batch, num_workers=workers
    )


def imagefolder_peer(work: Path, batch: int, workers: int):
    import torch
    import torchvision

    from torchvision.transforms.v2.functional import pil_to_tensor

    # ImageFolder's default loader (PIL), as its docs use it.
    dataset = torchvision.datasets.ImageFolder(
        str(work / "images"), transform=lambda image: augment(pil_to_tensor(image))
    )
    return torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers)


def _one_torch_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _ceiling_chunk(encoded: list[bytes]) -> int:
    import torch

    return len(torch.stack([decode_and_augment(e) for e in encoded]))


def ceiling(work: Path, batch: int, workers: int) -> dict:
    """decode + augment alone, in a process pool over bytes in memory."""
    files = image_files(work / "images")
    chunks = [[Path(p).read_bytes() for p, _ in files[i : i + batch]] for i in range(0, len(files), batch)]
    # One intra-op thread per process, as DataLoader gives its workers: with torch's default
    # (one per core) the pool's processes fight over the cores and run at a third of the rate.
    with concurrent.futures.ProcessPoolExecutor(workers, initializer=_one_torch_thread) as pool:
        list(pool.map(_ceiling_chunk, chunks[:workers]))  # start the workers, import torchvision
        started = time.perf_counter()
        images = sum(pool.map(_ceiling_chunk, chunks))
        seconds = time.perf_counter() - started
    return {"images_per_s": images / seconds, "images": images, "seconds": seconds, "startup_s": None}


def _fused_chunk(args) -> int:
    from sparkgpu import data

    first, encoded = args
    crop = data.RandomResizedCrop(CROP)
    return len(crop.batch(encoded, seed=0, epoch=0, indices=np.arange(first, first + len(encoded))))


def ceiling_fused(work: Path, batch: int, workers: int) -> dict:
    """The fused decode-and-crop alone (sparkgpu's decoder), in a process pool over bytes in memory."""
    files = image_files(work / "images")
    chunks = [(i, [Path(p).read_bytes() for p, _ in files[i : i + batch]]) for i in range(0, len(files), batch)]
    with concurrent.futures.ProcessPoolExecutor(workers, initializer=_one_torch_thread) as pool:
        list(pool.map(_fused_chunk, chunks[:workers]))
        started = time.perf_counter()
        images = sum(pool.map(_fused_chunk, chunks))
        seconds = time.perf_counter() - started
    return {"images_per_s": images / seconds, "images": images, "seconds": seconds, "startup_s": None}


READERS = {
    "sparkgpu": ours,
    "sparkgpu_transform": ours_transform,
    "streaming": streaming_peer,
    "litdata": litdata_peer,
    "imagefolder": imagefolder_peer,
}
CEILINGS = {"ceiling": ceiling, "ceiling_fused": ceiling_fused}
DECODERS = {
    "ceiling": "torchvision.io.decode_image, then the v2 augmentation",
    "ceiling_fused": "sparkgpu's fused decoder (region of interest, resize and flip in one pass)",
    "sparkgpu": "sparkgpu's fused decoder (decode={'image': data.RandomResizedCrop(224)})",
    "sparkgpu_transform": "torchvision.io (sparkgpu.data.decode_image), then the v2 augmentation in transform=",
    "streaming": "PIL (its MDS jpeg encoding), then pil_to_tensor",
    "litdata": "torchvision.io.decode_jpeg (its JPEG serializer)",
    "imagefolder": "PIL (ImageFolder's default loader), then pil_to_tensor",
}


def measure(name: str, work: Path, batch: int, workers: int) -> dict:
    if name in CEILINGS:
        return CEILINGS[name](work, batch, workers)
    started = time.perf_counter()
    iterator = iter(READERS[name](work, batch, workers))
    first = next(iterator)
    startup = time.perf_counter() - started
    images, window = len(first["image"] if isinstance(first, dict) else first[0]), time.perf_counter()
    first_images = images
    for item in iterator:
        images_tensor = item["image"] if isinstance(item, dict) else item[0]
        assert images_tensor.shape[1:] == (3, CROP, CROP), images_tensor.shape
        images += len(images_tensor)
    seconds = time.perf_counter() - window
    del first
    return {
        "images_per_s": (images - first_images) / seconds if seconds else None,
        "images": images,
        "seconds": seconds,
        "startup_s": startup,
        "images_per_s_including_startup": images / (seconds + startup),
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = sorted(
        ((k, v["images_per_s"]) for k, v in results["readers"].items() if v.get("images_per_s")), key=lambda kv: kv[1]
    )
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(
        [k for k, _ in entries],
        [v for _, v in entries],
        color=[
            "tab:green" if k.startswith("sparkgpu") else "tab:gray" if k.startswith("ceiling") else "tab:blue"
            for k, _ in entries
        ],
    )
    for i, (_, v) in enumerate(entries):
        ax.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
    ax.set_xlabel("images/s")
    ax.set_title(
        f"JPEG decode + RandomResizedCrop(224) + flip, batch {results['batch_size']}, {results['workers']} workers"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--small", action="store_true", help="768 images: a quick end-to-end check")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality of the made images")
    parser.add_argument("--noise", type=float, default=24.0, help="pixel noise: 24 makes ~110 KB JPEGs, 10 about 71 KB")
    parser.add_argument("--repeats", type=int, default=3, help="epochs per reader, each in a fresh process")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    parser.add_argument("--work-dir", default=None, help="where the images and shards go (default: system temp)")
    parser.add_argument("--out", default=str(RESULTS / "images.json"))
    parser.add_argument("--reader", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reader:  # one reader, in a fresh process
        print(
            "RESULT " + json.dumps(measure(args.reader, Path(args.work_dir), args.batch_size, args.workers)), flush=True
        )
        return
    count = 768 if args.small else args.images
    try:
        import litdata  # noqa: F401

        readers = ["ceiling", "ceiling_fused", "sparkgpu", "sparkgpu_transform", "streaming", "litdata", "imagefolder"]
    except ImportError:
        print("litdata is not installed (pip install litdata): skipping that peer")
        readers = ["ceiling", "ceiling_fused", "sparkgpu", "sparkgpu_transform", "streaming", "imagefolder"]
    facts = machine()  # before making the images: that load is the benchmark's own
    with tempfile.TemporaryDirectory(prefix="sparkgpu-bench-images-", dir=args.work_dir) as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        sizes = make_images(work / "images", count, args.quality, args.workers, args.noise)
        files = image_files(work / "images")
        write_mds(files, work / "mds")
        if "litdata" in readers:
            write_litdata(files, work / "litdata", args.workers)
        print(
            f"made {count} JPEGs of {WIDTH}x{HEIGHT}, {np.mean(sizes) / 1e3:.0f} KB on average, "
            f"and their shards in {time.perf_counter() - started:.0f} s",
            flush=True,
        )
        results = {
            "images": count,
            "mean_jpeg_kb": float(np.mean(sizes) / 1e3),
            "noise": args.noise,
            "quality": args.quality,
            "batch_size": args.batch_size,
            "workers": args.workers,
            "repeats": args.repeats,
            "workers_per_reader": {name: args.workers for name in readers},
            "readers": {},
        }
        # Every reader's worker processes share the machine's cores: per core divides by those it can use.
        cores = min(args.workers, os.cpu_count() or 1)
        results["cores"] = cores
        runs: dict[str, list[dict]] = {name: [] for name in readers}
        for repeat in range(args.repeats):
            for name in readers if repeat % 2 == 0 else readers[::-1]:
                command = [
                    sys.executable,
                    __file__,
                    "--reader",
                    name,
                    "--work-dir",
                    str(work),
                    "--batch-size",
                    str(args.batch_size),
                    "--workers",
                    str(args.workers),
                ]
                done = subprocess.run(command, capture_output=True, text=True)
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode or not lines:
                    print(f"  {name}: failed\n{done.stderr[-3000:]}", flush=True)
                    runs[name].append({"error": done.stderr[-3000:]})
                    continue
                result = json.loads(lines[-1][len("RESULT ") :])
                runs[name].append(result)
                print(
                    f"  repeat {repeat} {name:18s} {result['images_per_s']:10,.0f} images/s  "
                    f"{result['images_per_s'] / cores:8,.0f} per core  (start-up {result['startup_s'] or 0:.1f} s)",
                    flush=True,
                )
        for name, attempts in runs.items():
            ok = [r for r in attempts if "error" not in r]
            if not ok:
                results["readers"][name] = {"error": attempts[-1]["error"], "decoder": DECODERS[name]}
                continue
            steady = spread([r["images_per_s"] for r in ok], higher_is_better=True)
            row = {
                "images_per_s": steady["median"],
                "images_per_s_per_core": steady["median"] / cores,
                "images_per_s_spread": steady,
                "images": ok[0]["images"],
                "decoder": DECODERS[name],
                "failed_runs": len(attempts) - len(ok),
            }
            if ok[0]["startup_s"] is not None:
                row["startup_s"] = spread([r["startup_s"] for r in ok])["median"]
                row["startup_s_spread"] = spread([r["startup_s"] for r in ok])
                row["images_per_s_including_startup"] = spread([r["images_per_s_including_startup"] for r in ok])[
                    "median"
                ]
            else:
                row["startup_s"] = None
            results["readers"][name] = row
        results["method"] = method(
            "one epoch per fresh process; the ceiling times its pool's map after the pool has started",
            startup="construction to first batch, apart as startup_s; images_per_s counts from the first batch on",
            repeats=args.repeats,
            statistic="median over repeats",
            order="readers alternate order per repeat",
            workers=f"{args.workers} worker processes for every reader and the ceiling",
        )
        results["machine"] = load_seen(facts)
    rates = {k: v.get("images_per_s") for k, v in results["readers"].items() if v.get("images_per_s")}
    peers = [v for k, v in rates.items() if not k.startswith(("sparkgpu", "ceiling"))]
    if "sparkgpu" in rates:
        results["vs_best_peer"] = rates["sparkgpu"] / max(peers) if peers else None
        results["best_peer"] = max((k for k in rates if rates[k] in peers), key=rates.get) if peers else None
        results["of_ceiling"] = rates["sparkgpu"] / rates["ceiling"] if "ceiling" in rates else None
        results["of_fused_ceiling"] = rates["sparkgpu"] / rates["ceiling_fused"] if "ceiling_fused" in rates else None
        results["fused_ceiling_over_ceiling"] = (
            rates["ceiling_fused"] / rates["ceiling"] if {"ceiling", "ceiling_fused"} <= set(rates) else None
        )
        results["ratios_method"] = (
            "medians of the steady rate (from the first batch on), the same repeats for every reader"
        )
        print(
            f"sparkgpu: {results['vs_best_peer'] or 0:.2f}x the best peer, {results['of_ceiling'] or 0:.0%} of the ceiling"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
