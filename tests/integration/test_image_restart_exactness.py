"""Augmented images resume exactly: a job killed mid-epoch trains on the same augmented tensors.

An image dataset (JPEG column) is trained on 2 gloo ranks with a torchvision augmentation
running in DataLoader worker processes. One run is uninterrupted; in the other a rank is
killed with SIGKILL mid-epoch and the supervisor restarts the job from its last checkpoint.
Each step's augmented batch (its bytes, hashed) and the final weights must be identical.
"""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import pytest

from sparkgpu import distributed
from sparkgpu.config import settings

pytestmark = pytest.mark.integration

SAMPLES, SIDE, CROP, BATCH, WORLD, EPOCHS = 48, 24, 8, 4, 2, 2
STEPS_PER_EPOCH = SAMPLES // (BATCH * WORLD)
KILL_STEP = STEPS_PER_EPOCH + 2  # mid-way through the second epoch, between checkpoints


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    import pyarrow as pa
    from PIL import Image

    from sparkgpu.data import to_mds

    rng = np.random.default_rng(0)
    files = []
    for _ in range(SAMPLES):
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(out, format="JPEG")
        files.append(out.getvalue())
    table = pa.table({"image": pa.array(files, pa.binary()), "label": np.arange(SAMPLES, dtype=np.int64) % 4})
    out = tmp_path_factory.mktemp("images") / "mds"
    to_mds(table, str(out), columns={"image": "jpeg", "label": None}, size_limit=4096)  # several shards
    return str(out)


def augment(sample, rng):
    import torch
    from torchvision.transforms import v2

    crop = v2.Compose([v2.RandomResizedCrop(CROP, antialias=True), v2.RandomHorizontalFlip()])
    image = crop(sample["image"]).float() / 255 + torch.from_numpy(rng.normal(0, 0.01, (3, CROP, CROP)).astype(np.float32))
    return {"image": image, "label": sample["label"]}


def train_images(data_dir, record_file, kill_step=None):
    import os
    import signal

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparkgpu import data, runtime
    from sparkgpu.train import Checkpointer

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * CROP * CROP, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ds = data.dataset(local=data_dir, batch_size=BATCH, shuffle=True, seed=11, transform=augment, num_workers=1)
    ckpt = Checkpointer(every_steps=2, keep_last=2)
    step = ckpt.restore(model=model, optimizer=opt, loader=ds)
    rank = runtime.get_global_rank()
    with open(f"{record_file}.{rank}", "a") as record:
        while step < EPOCHS * STEPS_PER_EPOCH:
            for batch in ds:
                digest = hashlib.sha256(batch["image"].numpy().tobytes()).hexdigest()
                record.write(json.dumps([step, digest, batch["label"].tolist()]) + "\n")
                record.flush()
                loss = torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                if runtime.attempt() == 0 and rank == 1 and step == kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                ckpt.maybe_save(step, model=model, optimizer=opt, loader=ds)
                step += 1
                if step >= EPOCHS * STEPS_PER_EPOCH:
                    break
    ckpt.close()
    return {name: t.clone() for name, t in model.module.state_dict().items()}


def run(image_dir, tmp_path, tag, **options):
    record = tmp_path / f"{tag}.jsonl"
    job = distributed(gpus=WORLD, gpu_type="cpu", max_restarts=1)(train_images)
    weights = job.distributed(image_dir, str(record), **options)
    state = json.loads((settings().staging_root / job.last_job_id / "state.json").read_text())
    steps = {}
    for rank in range(WORLD):
        for line in open(f"{record}.{rank}"):
            step, digest, labels = json.loads(line)
            steps[(rank, step)] = (digest, labels)  # the attempt that counted writes last
    return weights, state, steps


def test_sigkill_mid_epoch_resumes_with_the_same_augmented_images(image_dir, tmp_path):
    plain_weights, plain_state, plain_steps = run(image_dir, tmp_path, "plain")
    weights, state, steps = run(image_dir, tmp_path, "killed", kill_step=KILL_STEP)
    assert len(plain_state["attempts"]) == 1
    assert [a["status"] for a in state["attempts"]] == ["failed", "succeeded"]
    assert len(plain_steps) == WORLD * EPOCHS * STEPS_PER_EPOCH
    assert steps == plain_steps, "after the restart the ranks saw other augmented images"
    assert len({digest for digest, _ in plain_steps.values()}) == len(plain_steps)
    for rank_weights in weights:
        for name, tensor in rank_weights.items():
            assert tensor.equal(plain_weights[0][name]), f"{name} differs from the uninterrupted run"
