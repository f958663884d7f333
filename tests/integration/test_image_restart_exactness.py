"""Augmented images resume exactly: a job killed mid-epoch trains on the same augmented tensors.

The image model of ``examples/train_images.py`` (a torchvision ResNet-18 with batch norm,
AdamW) on its JPEGs with its augmentation (``prepare``: decode, ``RandomResizedCrop``, flip,
normalise) running in DataLoader worker processes, on 2 gloo ranks. One run is uninterrupted;
in the others rank 1 is killed with SIGKILL at a random step and the job restarts from its
last checkpoint cold, through the job's standby, or through the warm pool. Each step's
augmented batch (its bytes, hashed) and loss, the final weights, batch-norm statistics and
optimizer state must be identical, and every image is trained on once per epoch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import sys
from pathlib import Path

import cloudpickle
import pytest

from sparkgpu import distributed
from sparkgpu.launch.backends.local.backend import LocalBackend
from tests.integration.homes import home_of_its_own

# One worker runs the module: its module-scoped fixtures (a reference run, built data) are built
# once, not once on every worker a test of it lands on.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("image-restart")]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_images.py"
PER_CLASS, BATCH, WORLD, EPOCHS = 16, 4, 2, 2
SAMPLES = 2 * PER_CLASS
STEPS_PER_EPOCH = SAMPLES // (BATCH * WORLD)
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH


def _example():
    """examples/train_images.py as a module, pickled by value: the ranks cannot import it by name."""
    spec = importlib.util.spec_from_file_location("train_images_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module


example = _example()


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    import pyarrow as pa

    from sparkgpu.data import to_mds

    folder = tmp_path_factory.mktemp("images")
    example.make_images(str(folder), PER_CLASS)
    files = sorted(folder.rglob("*.jpg"))
    table = pa.table(
        {
            "image": pa.array([f.read_bytes() for f in files], pa.binary()),
            "label": [int(f.parent.name == example.CLASSES[1]) for f in files],
            "id": list(range(len(files))),
        }
    )
    out = tmp_path_factory.mktemp("mds") / "images"
    to_mds(table, str(out), columns={"image": "jpeg", "label": None, "id": None}, size_limit=1 << 15)  # several shards
    return str(out)


def augment(sample, rng):
    """The example's decode and augmentation, keeping the sample's id for the record."""
    prepared = example.prepare(sample, rng)
    return {**prepared, "id": int(sample["id"])}


def train_images(data_dir, record_file, kill_step=None):
    import os
    import signal

    import torch
    import torchvision
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparkgpu import data, runtime
    from sparkgpu.train import Checkpointer

    torch.manual_seed(0)
    model = DDP(torchvision.models.resnet18(weights=None, num_classes=len(example.CLASSES)))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ds = data.dataset(local=data_dir, batch_size=BATCH, shuffle=True, seed=11, transform=augment, num_workers=1)
    ckpt = Checkpointer(every_steps=2, keep_last=2)
    step = ckpt.restore(model=model, optimizer=opt, loader=ds)
    rank = runtime.get_global_rank()
    with open(f"{record_file}.{rank}", "a") as record:
        while step < TOTAL_STEPS:
            for batch in ds:
                loss = torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                digest = hashlib.sha256(batch["image"].numpy().tobytes()).hexdigest()
                record.write(json.dumps([step, digest, batch["id"].tolist(), loss.item().hex()]) + "\n")
                record.flush()
                if runtime.attempt() == 0 and rank == 1 and step == kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                ckpt.maybe_save(step, model=model, optimizer=opt, loader=ds)
                if step >= TOTAL_STEPS:
                    break
    ckpt.close()
    optim = opt.state_dict()["state"]
    return {
        "model": {name: t.clone() for name, t in model.module.state_dict().items()},  # batch-norm statistics too
        "optimizer": {f"{p}.{k}": v.clone() for p, s in optim.items() for k, v in s.items()},
    }


def run(image_dir, tmp_path, tag, backend, **options):
    from sparkgpu.config import settings

    record = tmp_path / f"{tag}.jsonl"
    job = distributed(gpus=WORLD, gpu_type="cpu", max_restarts=1, backend=backend)(train_images)
    states = job.distributed(image_dir, str(record), **options)
    state = json.loads((settings().staging_root / job.last_job_id / "state.json").read_text())
    steps = {}
    for rank in range(WORLD):
        for line in open(f"{record}.{rank}"):
            step, digest, ids, loss = json.loads(line)
            steps[(rank, step)] = (digest, ids, loss)  # the attempt that counted writes last
    return states, state, steps


@pytest.fixture(scope="module")
def uninterrupted(image_dir, tmp_path_factory):
    with home_of_its_own(tmp_path_factory):
        states, state, steps = run(image_dir, tmp_path_factory.mktemp("plain"), "plain", LocalBackend(standby=False))
    assert len(state["attempts"]) == 1
    assert len(steps) == WORLD * TOTAL_STEPS
    assert len({digest for digest, _, _ in steps.values()}) == len(steps)  # augmentations differ per step
    for epoch in range(EPOCHS):
        ids = sorted(
            i for (_, step), (_, batch, _) in steps.items() if (step - 1) // STEPS_PER_EPOCH == epoch for i in batch
        )
        assert ids == list(range(SAMPLES)), f"epoch {epoch} skipped or repeated images"
    return states, steps


RESTART_PATHS = {
    "cold": lambda: LocalBackend(standby=False),
    "standby": lambda: LocalBackend(),
    "warm_pool": lambda: "warm_pool",
}


@pytest.mark.parametrize("path", sorted(RESTART_PATHS))
def test_sigkill_mid_epoch_resumes_with_the_same_augmented_images(path, uninterrupted, image_dir, tmp_path):
    plain, plain_steps = uninterrupted
    seed = random.randrange(1 << 30)
    kill_step = random.Random(seed).randrange(2, TOTAL_STEPS - 1)
    note = f"({path}: rank 1 killed after step {kill_step}, seed {seed})"
    states, state, steps = run(image_dir, tmp_path, path, RESTART_PATHS[path](), kill_step=kill_step)
    assert [a["status"] for a in state["attempts"]] == ["failed", "succeeded"], note
    assert steps == plain_steps, f"after the restart the ranks saw other augmented images or losses {note}"
    assert len(states) == len(plain) == WORLD  # a state per rank, in both runs
    for rank, (rank_state, plain_state) in enumerate(zip(states, plain)):  # batch-norm statistics are per rank
        for part in ("model", "optimizer"):
            assert rank_state[part].keys() == plain_state[part].keys()
            for name, tensor in rank_state[part].items():
                assert tensor.equal(plain_state[part][name]), f"rank {rank}: {part} {name} differs {note}"
