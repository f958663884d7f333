"""Images: decode_image, MDS jpeg/png/pil columns read as tensors, encoded files written verbatim."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pyarrow as pa
import pytest
import torch

from sparkgpu import data
from sparkgpu.errors import ConfigurationError, DataError
from tests.mosaic import streaming_dataset

SIDE = 32


def picture(i: int, mode: str = "RGB"):
    from PIL import Image

    rng = np.random.default_rng(i)
    pixels = rng.integers(0, 256, (SIDE, SIDE // 2 + i % 3, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB").convert(mode)


def encoded(image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def pil_tensor(image) -> torch.Tensor:
    from torchvision.transforms.v2.functional import pil_to_tensor

    return pil_to_tensor(image)


def test_decode_image_reads_jpeg_png_webp_in_the_mode_asked():
    image = picture(0)
    png = data.decode_image(encoded(image, "PNG"))
    assert png.dtype == torch.uint8 and png.equal(pil_tensor(image))
    assert data.decode_image(encoded(image, "WEBP", lossless=True)).equal(png)
    jpeg_bytes = encoded(image, "JPEG")
    jpeg = data.decode_image(np.frombuffer(jpeg_bytes, np.uint8))
    assert jpeg.shape == png.shape and (jpeg.int() - pil_tensor(picture_from(jpeg_bytes)).int()).abs().max() <= 2
    gray = picture(1, "L")
    assert data.decode_image(encoded(gray, "PNG")).shape == (3, SIDE, SIDE // 2 + 1)  # rgb is the default
    assert data.decode_image(encoded(gray, "PNG"), mode="unchanged").equal(pil_tensor(gray))
    # A decoded tensor only gets its channels converted, as torchvision would decode it.
    rgba = pil_tensor(picture(2, "RGBA"))
    assert data.decode_image(rgba).equal(rgba[:3])
    assert data.decode_image(pil_tensor(gray), mode="rgb").equal(pil_tensor(gray).expand(3, -1, -1))
    gray_of_decoded = data.decode_image(pil_tensor(image), mode="gray").int()
    assert (gray_of_decoded - data.decode_image(encoded(image, "PNG"), mode="gray").int()).abs().max() <= 1
    assert [t.shape for t in data.decode_image([encoded(image, "PNG"), encoded(gray, "PNG")])] == [
        png.shape,
        (3, SIDE, SIDE // 2 + 1),
    ]


def test_decode_image_rejects_what_it_cannot_decode():
    with pytest.raises(DataError, match="cannot decode an image of 9 bytes"):
        data.decode_image(b"not a jpg")
    with pytest.raises(ConfigurationError, match="mode='RGB' is not an image mode"):
        data.decode_image(b"", mode="RGB")
    with pytest.raises(DataError, match="from a str"):
        data.decode_image("photo.jpg")


def test_jpeg_png_pil_columns_read_as_image_tensors_in_workers_too(tmp_path):
    from streaming import MDSWriter

    from PIL import Image

    images = [picture(i) for i in range(12)]
    jpeg_bytes = [encoded(img, "JPEG") for img in images]
    for i, jpeg in enumerate(jpeg_bytes):
        (tmp_path / f"{i}.jpg").write_bytes(jpeg)  # an opened file: streaming stores its bytes as they are
    out = tmp_path / "mds"
    with MDSWriter(
        out=str(out), columns={"jpg": "jpeg", "png": "png", "pil": "pil", "label": "int64"}, size_limit=4096
    ) as writer:
        for i, img in enumerate(images):
            writer.write(
                {
                    "jpg": Image.open(tmp_path / f"{i}.jpg"),
                    "png": img,
                    "pil": img.convert("L") if i % 2 else img,
                    "label": i,
                }
            )
    for workers in (0, 2):
        seen = 0
        for batch in data.dataset(local=str(out), batch_size=5, num_workers=workers):
            for i, jpg, png, pil in zip(batch["label"].tolist(), batch["jpg"], batch["png"], batch["pil"]):
                assert png.equal(pil_tensor(images[i]))
                assert jpg.equal(data.decode_image(jpeg_bytes[i]))
                assert pil.equal(pil_tensor(images[i].convert("L") if i % 2 else images[i]))
                seen += 1
        assert seen == 12


def test_to_mds_stores_encoded_images_verbatim_for_streaming_and_the_loader(tmp_path):
    files = [encoded(picture(i), "JPEG") for i in range(6)]
    table = pa.table({"image": pa.array(files, pa.binary()), "label": np.arange(6, dtype=np.int64)})
    out = tmp_path / "mds"
    data.to_mds(table, str(out), columns={"image": "jpeg", "label": None})
    index = json.loads((out / "index.json").read_text())
    assert index["shards"][0]["column_encodings"] == ["jpeg", "int64"]
    shards = b"".join((out / shard["raw_data"]["basename"]).read_bytes() for shard in index["shards"])
    assert all(f in shards for f in files), "the files' bytes are stored as they are, not re-encoded"
    theirs = streaming_dataset(local=str(out), batch_size=2)
    assert [theirs[i]["image"].format for i in range(6)] == ["JPEG"] * 6
    assert np.array_equal(np.asarray(theirs[3]["image"]), np.asarray(picture_from(files[3])))
    ours = next(iter(data.dataset(local=str(out), batch_size=6)))
    assert all(img.equal(data.decode_image(f)) for img, f in zip(ours["image"], files))


def test_to_mds_with_an_encoding_for_the_image_keeps_the_other_columns(tmp_path):
    # The docs' line: naming the image's encoding must not drop the labels beside it.
    files = [encoded(picture(i), "JPEG") for i in range(5)]
    table = pa.table(
        {"image": pa.array(files, pa.binary()), "label": np.arange(5, dtype=np.int64) * 3, "name": list("abcde")}
    )
    out = tmp_path / "mds"
    result = data.to_mds(table, str(out), columns={"image": "jpeg"})
    assert result.columns == {"image": "jpeg", "label": "int64", "name": "str"}
    batch = next(iter(data.dataset(local=str(out), batch_size=5)))
    assert batch["label"].tolist() == [0, 3, 6, 9, 12] and batch["name"] == list("abcde")
    assert all(img.equal(data.decode_image(f)) for img, f in zip(batch["image"], files))
    # a list still selects
    only = data.to_mds(table, str(tmp_path / "only"), columns=["image"])
    assert list(only.columns) == ["image"]


def picture_from(jpeg: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(jpeg))


def test_to_mds_refuses_bytes_that_are_not_the_declared_format_and_writes_nothing(tmp_path):
    table = pa.table({"image": pa.array([encoded(picture(0), "JPEG"), encoded(picture(1), "PNG"), b"x"], pa.binary())})
    out = tmp_path / "mds"
    with pytest.raises(DataError, match=r"'image' is written as 'jpeg', but \d of its values are not JPEG files"):
        data.to_mds(table, str(out), columns={"image": "jpeg"})
    assert not (out / "index.json").exists()
    with pytest.raises(DataError, match="cannot be written with encoding 'png'"):
        data.to_mds(pa.table({"image": [1, 2]}), str(tmp_path / "other"), columns={"image": "png"})


@pytest.mark.integration
def test_binary_files_from_spark_convert_without_reencoding(spark, tmp_path):
    folder = tmp_path / "photos"
    for label in ("cat", "dog"):
        os.makedirs(folder / label)
        for i in range(3):
            (folder / label / f"{i}.jpg").write_bytes(encoded(picture(i + (label == "dog") * 3), "JPEG"))
    from pyspark.sql import functions as F

    frame = (
        spark.read.format("binaryFile")
        .option("pathGlobFilter", "*.jpg")
        .option("recursiveFileLookup", "true")
        .load(str(folder))
        .select(
            F.col("content").alias("image"),
            (F.regexp_extract("path", r"/(\w+)/\d+\.jpg$", 1) == "dog").cast("int").alias("label"),
        )
    )
    out = tmp_path / "mds"
    data.to_mds(frame, str(out), columns={"image": "jpeg", "label": None})
    seen = sorted(
        (int(label), image.flatten().tolist())
        for batch in data.dataset(local=str(out), batch_size=4)
        for image, label in zip(batch["image"], batch["label"])
    )
    expected = sorted(
        (int(label == "dog"), data.decode_image((folder / label / f"{i}.jpg").read_bytes()).flatten().tolist())
        for label in ("cat", "dog")
        for i in range(3)
    )
    assert seen == expected
