"""The fused JPEG path: torchvision's crop distribution, seeding per sample, exact resume in the
loader, pixel values against torchvision, the GPU path's code on the CPU, errors, normalize."""

from __future__ import annotations

import io
import math
import pickle

import numpy as np
import pyarrow as pa
import pytest
import torch

from sparkgpu import data
from sparkgpu.data.augment import _jpeg, crops
from sparkgpu.errors import ConfigurationError, DataError

DRAWS = 20_000
ALPHA = 0.001


# --- the crop distribution ---------------------------------------------------------------------


def torchvision_boxes(height: int, width: int, scale, ratio, n: int = DRAWS) -> np.ndarray:
    from torchvision.transforms import RandomResizedCrop as TorchvisionCrop

    image = torch.empty((1, height, width), dtype=torch.uint8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(height * 1000 + width)
        return np.array([TorchvisionCrop.get_params(image, list(scale), list(ratio)) for _ in range(n)])


def our_boxes(height: int, width: int, crop, seed: int = 11, n: int = DRAWS):
    sizes = np.tile([[height, width]], (n, 1))
    return crop.params(sizes, seed=seed, epoch=0, indices=np.arange(n))


def summaries(boxes: np.ndarray, height: int, width: int) -> dict[str, np.ndarray]:
    top, left, h, w = (boxes[:, k].astype(np.float64) for k in range(4))
    return {
        "area fraction": h * w / (height * width),
        "log aspect ratio": np.log(w / h),
        "centre row": (top + h / 2) / height,
        "centre column": (left + w / 2) / width,
    }


def ks_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import ks_2samp

    return float(ks_2samp(a, b).pvalue)


@pytest.mark.parametrize("height,width", [(375, 500), (500, 375)])
@pytest.mark.parametrize("scale,ratio", [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.25, 0.6), (0.5, 3.0))])
def test_crops_follow_torchvisions_distribution(height, width, scale, ratio):
    pytest.importorskip("scipy")
    crop = data.RandomResizedCrop(224, scale=scale, ratio=ratio)
    boxes, flips = our_boxes(height, width, crop)
    reference = torchvision_boxes(height, width, scale, ratio)
    ours, theirs = summaries(boxes, height, width), summaries(reference, height, width)
    for name in ours:
        assert ks_pvalue(ours[name], theirs[name]) > ALPHA, name
    # Every box lies inside its image.
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2:] >= 1).all()
    assert (boxes[:, 0] + boxes[:, 2] <= height).all() and (boxes[:, 1] + boxes[:, 3] <= width).all()
    # The flip rate is 0.5 within 4.5 standard deviations of a binomial.
    assert abs(flips.mean() - 0.5) < 4.5 * math.sqrt(0.25 / DRAWS)


def test_images_too_small_for_any_try_take_torchvisions_centre_fallback():
    crop = data.RandomResizedCrop(32)
    for height, width in [(4, 300), (300, 4)]:  # no try fits: the fallback every time, as torchvision's
        boxes, _ = our_boxes(height, width, crop, n=40)
        reference = torchvision_boxes(height, width, crop.scale, crop.ratio, n=40)
        assert np.array_equal(boxes, reference)
    assert our_boxes(4, 300, crop, n=1)[0].tolist() == [[0, 147, 4, 5]]
    # 40x300: about half the samples find a try that fits, the rest fall back, as many as torchvision's.
    pytest.importorskip("scipy")
    boxes, _ = our_boxes(40, 300, crop, n=3000)
    reference = torchvision_boxes(40, 300, crop.scale, crop.ratio, n=3000)
    fallback = [0, (300 - 53) // 2, 40, 53]  # the full height, at the widest ratio allowed
    ours, theirs = (np.all(b == fallback, axis=1).mean() for b in (boxes, reference))
    assert 0.2 < theirs < 0.8 and abs(ours - theirs) < 4.5 * math.sqrt(2 * theirs * (1 - theirs) / 3000)
    for name, values in summaries(boxes, 40, 300).items():
        assert ks_pvalue(values, summaries(reference, 40, 300)[name]) > ALPHA, name


def test_no_flip_and_flip_always():
    assert not our_boxes(100, 100, data.RandomResizedCrop(8, flip=0), n=500)[1].any()
    assert our_boxes(100, 100, data.RandomResizedCrop(8, flip=1), n=500)[1].all()


# --- seeding -----------------------------------------------------------------------------------


def test_a_samples_crop_depends_on_seed_epoch_and_index_only():
    crop = data.RandomResizedCrop(64)
    sizes = np.array([[375, 500], [500, 375], [300, 300]])
    boxes, flips = crop.params(sizes, seed=3, epoch=2, indices=[5, 9, 100])
    # The same samples in another batch, at other positions, beside other samples.
    other_sizes = np.array([[300, 300], [10, 10], [375, 500], [100, 100], [500, 375]])
    other, other_flips = crop.params(other_sizes, seed=3, epoch=2, indices=[100, 7, 5, 8, 9])
    assert np.array_equal(other[[2, 4, 0]], boxes) and np.array_equal(other_flips[[2, 4, 0]], flips)
    many = np.tile([[375, 500]], (64, 1))
    base = crop.params(many, seed=3, epoch=2, indices=np.arange(64))[0]
    assert not np.array_equal(crop.params(many, seed=3, epoch=3, indices=np.arange(64))[0], base)
    assert not np.array_equal(crop.params(many, seed=4, epoch=2, indices=np.arange(64))[0], base)
    assert np.array_equal(crop.params(many, seed=3, epoch=2, indices=np.arange(64))[0], base)


def test_uniforms_are_uniform_and_a_pure_function_of_their_key():
    u = crops.uniforms(0, 0, np.arange(10_000), 23)
    assert u.shape == (10_000, 23) and u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    assert np.array_equal(crops.uniforms(0, 0, [17, 3], 23), u[[17, 3]])
    assert abs(np.corrcoef(u[:, 0], u[:, 1])[0, 1]) < 0.05  # draws of one sample are not alike
    assert abs(np.corrcoef(u[:-1, 0], u[1:, 0])[0, 1]) < 0.05  # nor neighbouring samples'


def test_crops_pickle_and_compare_by_value():
    crop = data.RandomResizedCrop((64, 48), scale=(0.3, 1), flip=0.25)
    assert pickle.loads(pickle.dumps(crop)) == crop and crop.size == (64, 48) and crop.scale == (0.3, 1.0)
    centre = data.CenterCrop(224)
    assert centre.resize == 256 and pickle.loads(pickle.dumps(centre)) == centre
    with pytest.raises(AttributeError):
        crop.size = (1, 1)  # type: ignore[misc]


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: data.RandomResizedCrop(0), "size=0 must be a positive int"),
        (lambda: data.RandomResizedCrop((1, 2, 3)), r"size=\(1, 2, 3\)"),
        (lambda: data.RandomResizedCrop(8, scale=(0.9, 0.1)), r"scale=\(0.9, 0.1\) must be a \(min, max\) pair"),
        (lambda: data.RandomResizedCrop(8, ratio=(0, 1)), r"ratio=\(0, 1\)"),
        (lambda: data.RandomResizedCrop(8, flip=2), "flip=2 must be a probability"),
        (lambda: data.CenterCrop(224, resize=100), "resize=100 must be an integer >= the crop's size 224"),
    ],
)
def test_crop_arguments_are_checked(make, message):
    with pytest.raises(ConfigurationError, match=message):
        make()


def test_centre_crop_takes_the_region_of_resize_then_centre_crop():
    boxes, flips = data.CenterCrop(224).params(np.array([[375, 500], [500, 375], [100, 100]]))
    # Resize(256) then CenterCrop(224) of 375x500 keeps 224/256 of the shorter side, centred.
    assert boxes.tolist() == [[23, 86, 328, 328], [86, 23, 328, 328], [6, 6, 88, 88]] and not flips.any()


# --- real JPEGs --------------------------------------------------------------------------------

SIZES = [(48, 64), (64, 48), (33, 57), (90, 41), (17, 23), (72, 72)]


def jpeg(i: int) -> bytes:
    from PIL import Image

    height, width = SIZES[i % len(SIZES)]
    rng = np.random.default_rng(i)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    phase = rng.uniform(0, 2 * np.pi, 3)
    pixels = np.stack([127 + 100 * np.sin(3 * x + 2 * y + p) for p in phase], axis=-1)
    pixels += rng.normal(0, 6, pixels.shape)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    if i == 7:
        image = image.convert("L")  # one grayscale JPEG: it comes out as RGB
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=92)
    return out.getvalue()


N_IMAGES = 200
FILES = [jpeg(i) for i in range(N_IMAGES)]


@pytest.fixture(scope="module")
def jpeg_dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("crops") / "mds"
    table = pa.table({"image": pa.array(FILES, pa.binary()), "label": np.arange(N_IMAGES, dtype=np.int64)})
    data.to_mds(table, str(out), columns={"image": "jpeg"}, size_limit=8_000)  # several shards
    return str(out)


def open_crops(path, **options):
    options = {"batch_size": 16, "shuffle": True, "seed": 5, "decode": {"image": data.RandomResizedCrop(40)}, **options}
    return data.dataset(local=path, **options)


def assert_same_batches(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a["label"].equal(b["label"]) and a["image"].equal(b["image"])


def test_the_loader_resumes_with_the_same_pixels(jpeg_dataset):
    whole = list(open_crops(jpeg_dataset))
    assert whole[0]["image"].shape == (16, 3, 40, 40) and whole[0]["image"].dtype == torch.uint8
    assert sorted(int(i) for b in whole for i in b["label"]) == list(range(N_IMAGES))
    stopped = open_crops(jpeg_dataset)
    for number, _ in enumerate(stopped, 1):
        if number == 6:
            break
    state = stopped.state_dict()
    resumed = open_crops(jpeg_dataset)
    resumed.load_state_dict(state)
    assert_same_batches(list(resumed), whole[6:])
    # The next epoch: another order and other crops of the same samples.
    epoch1 = list(resumed)
    first = {int(label): image for b in whole for label, image in zip(b["label"], b["image"])}
    second = {int(label): image for b in epoch1 for label, image in zip(b["label"], b["image"])}
    assert sum(first[i].equal(second[i]) for i in range(N_IMAGES)) < N_IMAGES // 10


def test_the_loader_resumes_with_the_same_pixels_in_workers(jpeg_dataset):
    whole = list(open_crops(jpeg_dataset))
    in_workers = open_crops(jpeg_dataset, num_workers=2)
    assert_same_batches(list(in_workers), whole)  # the workers crop what the caller would
    stopped = open_crops(jpeg_dataset, num_workers=2)
    for number, _ in enumerate(stopped, 1):
        if number == 5:
            break
    resumed = open_crops(jpeg_dataset, num_workers=2)
    resumed.load_state_dict(stopped.state_dict())
    assert_same_batches(list(resumed), whole[5:])


def test_the_loaders_images_are_the_crops_of_their_bytes_close_to_torchvision(jpeg_dataset):
    from torchvision.transforms.v2 import functional as F

    crop = data.RandomResizedCrop(40)
    batch = next(iter(data.dataset(local=jpeg_dataset, batch_size=N_IMAGES, seed=9, decode={"image": crop})))
    indices = np.arange(N_IMAGES)  # no shuffle: sample i is row i
    assert batch["image"].equal(crop.batch(FILES, seed=9, epoch=0, indices=indices))
    boxes, flips = crop.params(_jpeg.jpeg_sizes(FILES), seed=9, epoch=0, indices=indices)
    for i in range(N_IMAGES):
        top, left, height, width = boxes[i].tolist()
        image = data.decode_image(FILES[i])
        expected = F.resized_crop(image, top, left, height, width, [40, 40], antialias=True)
        expected = expected.flip(-1) if flips[i] else expected
        assert psnr(batch["image"][i], expected) >= 30, i
    # The GPU path's code, run on the CPU: the same boxes and flips, resampled by torch.
    on_device = crops._device_path(FILES, boxes, flips, (40, 40), "cpu")
    assert min(psnr(a, b) for a, b in zip(on_device, batch["image"])) >= 30
    out = torch.zeros((N_IMAGES, 3, 40, 40), dtype=torch.uint8)
    assert crop.batch(FILES, seed=9, epoch=0, indices=indices, out=out) is out and out.equal(batch["image"])


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = ((a.double() - b.double()) ** 2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def test_transforms_see_the_cropped_images(jpeg_dataset):
    seen = []

    def prepare(sample, rng):
        seen.append(tuple(sample["image"].shape))
        return {"image": sample["image"].flip(-2), "label": sample["label"]}

    decode = {"image": data.CenterCrop(24)}
    plain = next(iter(data.dataset(local=jpeg_dataset, batch_size=8, decode=decode)))
    flipped = next(iter(data.dataset(local=jpeg_dataset, batch_size=8, decode=decode, transform=prepare)))
    assert seen == [(3, 24, 24)] * 8 and flipped["image"].equal(plain["image"].flip(-2))


def test_decode_is_checked_when_the_dataset_opens(jpeg_dataset, tmp_path):
    crop = data.RandomResizedCrop(32)
    with pytest.raises(ConfigurationError, match="names the column 'photo', which the dataset does not have"):
        data.dataset(local=jpeg_dataset, batch_size=4, decode={"photo": crop})
    with pytest.raises(ConfigurationError, match="'label' is stored as 'int64', not as JPEG files"):
        data.dataset(local=jpeg_dataset, batch_size=4, decode={"label": crop})
    with pytest.raises(ConfigurationError, match="features= .* drop features="):
        data.dataset(local=jpeg_dataset, batch_size=4, features=["label"], decode={"image": crop})
    from torchvision.transforms import v2

    with pytest.raises(ConfigurationError, match=r"decode\['image'\]=RandomResizedCrop.* is not a crop"):
        data.dataset(local=jpeg_dataset, batch_size=4, decode={"image": v2.RandomResizedCrop(32)})
    with pytest.raises(ConfigurationError, match="must map image column names to crops"):
        data.dataset(local=jpeg_dataset, batch_size=4, decode=crop)
    with pytest.raises(ConfigurationError, match="decode= work on one dataset, not yet on streams="):
        data.dataset(streams=[data.Stream(local=jpeg_dataset)], batch_size=4, decode={"image": crop})
    png = tmp_path / "png"
    data.to_mds(pa.table({"image": pa.array([png_bytes()], pa.binary())}), str(png), columns={"image": "png"})
    with pytest.raises(ConfigurationError, match="'image' is stored as 'png'; decode= crops JPEG columns only"):
        data.dataset(local=str(png), batch_size=4, decode={"image": crop})


def test_a_crop_on_the_gpu_decodes_in_the_training_process_through_the_device_path(jpeg_dataset, monkeypatch):
    from sparkgpu.data.augment import crops
    from sparkgpu.data.loaders import mds_loader

    gpu = data.RandomResizedCrop(32, device="cuda")
    with pytest.raises(ConfigurationError, match="CUDA is not available on this machine; leave device= out"):
        data.dataset(local=jpeg_dataset, batch_size=4, decode={"image": gpu})
    # No GPU here: the device path runs on CPU tensors (the same torch code; nvJPEG is what differs).
    monkeypatch.setattr(mds_loader, "_cuda_available", lambda: True)
    with pytest.raises(ConfigurationError, match="num_workers=2: pass num_workers=0"):
        data.dataset(local=jpeg_dataset, batch_size=4, decode={"image": gpu}, num_workers=2)
    devices = []

    def on_cpu(encoded, boxes, flips, size, device, out=None):
        devices.append(str(device))
        return real(encoded, boxes, flips, size, "cpu", out=out)

    real = crops._device_path
    monkeypatch.setattr(crops, "_device_path", on_cpu)
    options = dict(local=jpeg_dataset, batch_size=8, shuffle=True, seed=4)
    on_gpu = [b["image"] for b in data.dataset(**options, decode={"image": gpu})]
    on_host = [b["image"] for b in data.dataset(**options, decode={"image": data.RandomResizedCrop(32)})]
    assert devices and set(devices) == {"cuda"} and len(on_gpu) == len(on_host)
    for a, b in zip(on_gpu, on_host):  # the same boxes and flips; only the resampling differs
        assert a.shape == b.shape and psnr(a, b) >= 30


def png_bytes() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, format="PNG")
    return out.getvalue()


def test_without_the_native_decoder_torchvision_crops_the_same_boxes():
    crop = data.RandomResizedCrop((40, 32))
    indices = np.arange(40, 80)
    native = crop.batch(FILES[:40], seed=1, epoch=2, indices=indices)
    previous = _jpeg.set_native_enabled(False)
    try:
        fallback = crop.batch(FILES[:40], seed=1, epoch=2, indices=indices)
    finally:
        _jpeg.set_native_enabled(previous)
    assert fallback.shape == native.shape == (40, 3, 40, 32)
    assert min(psnr(a, b) for a, b in zip(fallback, native)) >= 30


def test_random_crops_need_the_sample_indices():
    with pytest.raises(ConfigurationError, match="needs indices="):
        data.RandomResizedCrop(8).batch(FILES[:2], seed=0, epoch=0, indices=None)
    assert data.CenterCrop(8).batch(FILES[:2], seed=0, epoch=0, indices=None).shape == (2, 3, 8, 8)


def test_a_value_that_is_not_a_jpeg_is_a_data_error():
    with pytest.raises(DataError, match="encoded image 1 of the batch"):
        data.RandomResizedCrop(8).batch([FILES[0], png_bytes()], seed=0, epoch=0, indices=[0, 1])


# --- normalize ---------------------------------------------------------------------------------


def test_normalize_is_x_over_255_minus_mean_over_std():
    images = torch.randint(0, 256, (4, 3, 5, 6), dtype=torch.uint8)
    mean = torch.tensor(crops.IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(crops.IMAGENET_STD).view(3, 1, 1)
    x = data.normalize(images)
    assert x.dtype == torch.float32 and x.equal((images.float() / 255 - mean) / std)
    last = data.normalize(images, channels_last=True)
    assert last.is_contiguous(memory_format=torch.channels_last) and last.equal(x)
    assert data.normalize(images[0], mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)).equal(images[0].float() / 127.5 - 1)
    assert data.normalize(images, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ConfigurationError, match="normalize takes uint8"):
        data.normalize(images.float())
    with pytest.raises(ConfigurationError, match="one per channel"):
        data.normalize(images, mean=(0.5,), std=(0.5,))
