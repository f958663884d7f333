"""Train an image classifier from a folder of JPEGs: Spark lists them, ``spark.gpu.train`` trains.

    python examples/train_images.py                      # in-process Connect server, 2 CPU ranks
    python examples/train_images.py --simulated-cluster  # local standalone cluster, simulated A10s
    python examples/train_images.py --remote sc://host:15002 --gpus 8 --gpu-type A10

The example first writes a small labelled image folder (``<class>/<n>.jpg``: two classes of
noisy pictures, stripes or blobs). Spark reads it with ``binaryFile`` and takes each label from
the path; ``spark.gpu.train(data=...)`` turns the DataFrame into MDS shards, storing the JPEG
bytes as they are (``columns={"image": "jpeg"}``), and each rank trains a torchvision ResNet-18
(random initialisation, nothing downloaded) on its share. Decoding and augmentation run per
sample in DataLoader worker processes (``transform=``), seeded so they repeat after a resume.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spark_connect_train import session  # noqa: E402  (the same three ways to get a session)

CLASSES = ("stripes", "blobs")
SIDE, CROP = 72, 64


def make_images(folder: str, per_class: int) -> None:
    """Writes ``per_class`` JPEGs of each class under ``folder/<class>/``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:SIDE, 0:SIDE]
    for name in CLASSES:
        os.makedirs(os.path.join(folder, name), exist_ok=True)
        for n in range(per_class):
            if name == "stripes":
                period = rng.uniform(6, 14)
                signal = np.sin((x * np.cos(n) + y * np.sin(n)) / period * 2 * np.pi)
            else:
                cy, cx = rng.uniform(10, SIDE - 10, 2)
                signal = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / rng.uniform(40, 200)) * 2 - 1
            tint = rng.uniform(0.3, 1.0, 3)
            pixels = 127 + 100 * signal[..., None] * tint + rng.normal(0, 12, (SIDE, SIDE, 3))
            Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(
                os.path.join(folder, name, f"{n}.jpg"), quality=90
            )


def prepare(sample, rng):
    """Runs in the loader's worker processes, once per sample: decode, augment, normalise."""
    from torchvision.transforms import v2

    from sparkgpu import data

    augment = v2.Compose([v2.RandomResizedCrop(CROP, scale=(0.6, 1.0), antialias=True), v2.RandomHorizontalFlip()])
    image = augment(data.decode_image(sample["image"], mode="rgb"))
    return {"image": (image.float() / 127.5 - 1).contiguous(), "label": int(sample["label"])}


def train(epochs: int, workers: int, data_url: str):
    import torch
    import torchvision
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparkgpu import data, runtime

    torch.manual_seed(0)
    device = runtime.device()
    model = torchvision.models.resnet18(weights=None, num_classes=len(CLASSES)).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loader = data.dataset(remote=data_url, batch_size=32, shuffle=True, transform=prepare, num_workers=workers)
    for epoch in range(epochs):
        correct = seen = 0
        for batch in loader:
            images, labels = batch["image"].to(device), batch["label"].to(device)
            logits = model(images)
            loss = torch.nn.functional.cross_entropy(logits, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            correct += int((logits.argmax(1) == labels).sum())
            seen += len(labels)
        if runtime.is_main_process():
            print(f"epoch {epoch}: loss {loss.item():.3f}, train accuracy {correct / seen:.2f}", flush=True)
    loader.close()
    return {"rank": runtime.get_global_rank(), "accuracy": correct / seen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--remote", help="Spark Connect URL, e.g. sc://host:15002")
    parser.add_argument("--simulated-cluster", action="store_true", help="start a local cluster with simulated GPUs")
    parser.add_argument("--gpus", type=int, default=None)
    parser.add_argument("--gpu-type", default=None, help="GPU type of the remote cluster, e.g. A10")
    parser.add_argument("--images", type=int, default=200, help="images per class")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="loader worker processes per rank")
    parser.add_argument("--folder", help="where to write the images (default: a temporary folder)")
    args = parser.parse_args()
    if args.remote and not (args.gpus and args.gpu_type):
        parser.error("--remote needs --gpus and --gpu-type")

    import sparkgpu  # noqa: F401  (adds spark.gpu)
    from pyspark.sql import functions as F

    with tempfile.TemporaryDirectory(prefix="sparkgpu-images-") as tmp:
        folder = args.folder or os.path.join(tmp, "images")
        make_images(folder, args.images)
        with session(args) as (spark, gpus, gpu_type):
            files = (
                spark.read.format("binaryFile")
                .option("pathGlobFilter", "*.jpg")
                .option("recursiveFileLookup", "true")
                .load(folder)
            )
            class_name = F.regexp_extract("path", r"/([^/]+)/[^/]+\.jpg$", 1)
            frame = files.select(
                F.col("content").alias("image"), (class_name == CLASSES[1]).cast("long").alias("label")
            )
            results = spark.gpu.train(
                train,
                gpus=gpus,
                gpu_type=gpu_type,
                args=(args.epochs, args.workers),
                data=frame,
                data_options={"columns": {"image": "jpeg", "label": None}},
            )
            print(results)


if __name__ == "__main__":
    main()
