"""Per-sample transforms: reproducible randomness, the same in the caller and in workers, collation, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparkgpu import data
from sparkgpu.data.transforms import collate
from sparkgpu.errors import ConfigurationError, DataError
from tests.unit.test_data_loader_support import write_tabular


@pytest.fixture(scope="module")
def tabular(tmp_path_factory):
    return write_tabular(tmp_path_factory.mktemp("mds") / "tabular", 203)


def jitter(sample, rng):
    """numpy and torch randomness both, plus a ragged value and a number."""
    i = int(sample["id"])
    return {
        "x": sample["f00"] + torch.rand(3) + float(rng.random()),
        "ragged": torch.arange(i % 3 + 1),
        "id": i,
    }


def gather(loader):
    return [(b["id"].clone(), b["x"].clone(), b["ragged"]) for b in loader]


def test_transforms_give_the_same_tensors_in_the_caller_and_in_workers_and_every_run(tabular):
    kwargs = dict(local=tabular, batch_size=16, shuffle=True, seed=3, transform=jitter)
    in_caller = gather(data.dataset(**kwargs))
    again = gather(data.dataset(**kwargs))
    in_workers = gather(data.dataset(**kwargs, num_workers=2))
    assert len(in_caller) == 13
    for one, two, three in zip(in_caller, again, in_workers):
        assert one[0].equal(two[0]) and one[0].equal(three[0])
        assert one[1].equal(two[1]) and one[1].equal(three[1])
    ids = torch.cat([b[0] for b in in_caller])
    assert sorted(ids.tolist()) == list(range(203))
    # Randomness differs per sample and per epoch, and collation follows the shapes.
    x = torch.cat([b[1] for b in in_caller])
    assert x.shape == (203, 3) and len(torch.unique(x[:, 0])) == 203
    assert isinstance(in_caller[0][2], list) and all(
        len(r) == int(i) % 3 + 1 for r, i in zip(in_caller[0][2], in_caller[0][0])
    )
    second_epoch = data.dataset(**kwargs)
    second_epoch.set_epoch(1)
    assert not next(iter(second_epoch))["x"].equal(in_caller[0][1])


def test_augmentations_do_not_depend_on_world_size_or_resume(tabular):
    kwargs = dict(local=tabular, shuffle=True, seed=5, transform=jitter)
    whole = {}
    for batch in data.dataset(**kwargs, batch_size=10):
        whole.update(zip(batch["id"].tolist(), batch["x"]))
    for rank in range(2):
        loader = data.dataset(**kwargs, batch_size=7, rank=rank, world_size=2)
        first = iter(loader)
        next(first)
        state = loader.state_dict()
        first.close()
        resumed = data.dataset(**kwargs, batch_size=7, rank=rank, world_size=2)
        resumed.load_state_dict(state)
        after = 0
        for batch in resumed:
            for i, x in zip(batch["id"].tolist(), batch["x"]):
                assert x.equal(whole[i]), f"sample {i} was augmented differently on rank {rank} after resume"
                after += 1
        share = sum(len(b["id"]) for b in data.dataset(**kwargs, batch_size=7, rank=rank, world_size=2))
        assert after == share - 7 > 0  # the rank's samples but its first batch


def test_torch_generator_is_restored_and_torchvision_random_resized_crop_repeats(tabular):
    from torchvision.transforms import v2

    crop = v2.Compose([v2.RandomResizedCrop(8, antialias=True), v2.RandomHorizontalFlip()])
    image = torch.arange(3 * 32 * 32, dtype=torch.float32).reshape(3, 32, 32)

    def augment(sample, rng):
        return {"image": crop(image), "id": sample["id"]}

    torch.manual_seed(123)
    before = torch.get_rng_state()
    runs = [
        torch.cat([b["image"] for b in data.dataset(local=tabular, batch_size=50, seed=1, transform=augment)])
        for _ in range(2)
    ]
    assert torch.get_rng_state().equal(before), "the caller's torch generator must be left as it was"
    assert runs[0].equal(runs[1])
    assert runs[0].shape == (203, 3, 8, 8)
    assert len({tuple(img.flatten()[:4].tolist()) for img in runs[0]}) > 100, "each sample gets its own crop"


def test_batch_transform_runs_after_collation_in_workers_too(tabular):
    def scale(batch):
        return {**batch, "noise": torch.rand(len(batch["id"])), "twice": batch["id"] * 2}

    batches = [
        list(data.dataset(local=tabular, batch_size=32, shuffle=True, batch_transform=scale, num_workers=w))
        for w in (0, 2)
    ]
    assert len(batches[0]) == len(batches[1]) == 7  # 203 rows, 32 a batch
    for a, b in zip(*batches):
        assert a["twice"].equal(a["id"] * 2) and a["noise"].equal(b["noise"]) and a["id"].equal(b["id"])


@pytest.mark.parametrize("workers", [0, 1])
def test_a_raising_transform_names_its_sample_and_shard(tabular, workers):
    def fail_on_42(sample, rng):
        if int(sample["id"]) == 42:
            raise ValueError("cannot augment this one")
        return sample

    with pytest.raises(data.TransformError) as caught:
        for _ in data.dataset(local=tabular, batch_size=16, transform=fail_on_42, num_workers=workers):
            pass
    message = str(caught.value)
    assert "sample 42" in message and "shard.00000.mds" in message and "cannot augment this one" in message
    assert isinstance(caught.value, DataError)
    if workers == 0:
        assert isinstance(caught.value.__cause__, ValueError)
    else:  # from a worker process the original traceback travels in the message
        assert "fail_on_42" in message


def test_bad_transforms_are_refused_before_reading(tabular):
    with pytest.raises(ConfigurationError, match="transform=.*not callable"):
        data.dataset(local=tabular, batch_size=4, transform="resize")

    with pytest.raises(data.TransformError, match="returned list for sample 0"):
        next(iter(data.dataset(local=tabular, batch_size=4, transform=lambda s, rng: [s])))


def test_collate_stacks_what_agrees_and_lists_the_rest():
    batch = collate(
        [
            {"a": np.ones(2, np.float32), "b": 1, "c": 0.5, "d": "x", "e": True},
            {"a": np.zeros(2, np.float32), "b": 2, "c": 1, "d": "y", "e": False},
        ]
    )
    assert batch["a"].shape == (2, 2) and batch["b"].dtype == torch.int64 and batch["c"].dtype == torch.float64
    assert batch["d"] == ["x", "y"] and batch["e"].dtype == torch.bool
    with pytest.raises(data.TransformError, match="same keys"):
        collate([{"a": 1}, {"b": 2}])
