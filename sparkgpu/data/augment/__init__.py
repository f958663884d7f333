"""Batch augmentation of images: fused JPEG decode + crop + resize + flip, and its peers.

```python
from sparkgpu import data
ds = data.dataset(remote="s3://bucket/imagenet-mds", batch_size=256, shuffle=True, num_workers=8,
                  decode={"image": data.RandomResizedCrop(224)}, device="cuda")
for batch in ds:                                  # batch["image"]: (256, 3, 224, 224) uint8 on the GPU
    x = data.normalize(batch["image"])            # float32, normalised on the GPU
```

The usual recipe decodes each JPEG whole into a tensor, crops a part of it, resizes the part
and flips it, one Python object per step and per sample. The fused path decides the crop
before decoding: each image's size comes from its JPEG header, the crop box and flip from
:meth:`~sparkgpu.data.augment.crops.RandomResizedCrop.params` (torchvision's distribution),
and the native decoder (``sparkgpu._jpeg``) then decodes only the rows and columns the box
covers, at 1/2, 1/4 or 1/8 scale in the inverse DCT when the box is large enough, and resizes
and mirrors it straight into one preallocated ``(n, 3, H, W)`` ``uint8`` batch. No per-sample
tensors are made on the way; the loader hands the column's encoded bytes over without
decoding them (:mod:`sparkgpu.data.mds.decode`).

- :mod:`sparkgpu.data.augment.crops`: the crops (:class:`~sparkgpu.data.augment.crops.RandomResizedCrop`,
  :class:`~sparkgpu.data.augment.crops.CenterCrop`), their counter-based seeding per
  ``(seed, epoch, sample index)``, the GPU path (nvJPEG) and
  :func:`~sparkgpu.data.augment.crops.normalize`;
- :mod:`sparkgpu.data.augment.columns`: the loaders' ``decode=`` option: its checks and the
  step that turns a batch's encoded column into the cropped tensor;
- ``_jpeg``: the native decoder's Python side, falling back to torchvision where the
  extension is not built.
"""
