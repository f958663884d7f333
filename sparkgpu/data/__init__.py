"""Data path: DataFrame / Delta / Parquet -> MDS shards on a volume -> local cache -> batches.

```python
from sparkgpu import data
data.to_mds(spark_df, "s3://bucket/feats/v1")
ds = data.dataset(remote="s3://bucket/feats/v1", local="/local_disk0/cache", batch_size=1024)
```

Where things are, following the data from source to batch:

- :mod:`sparkgpu.data.convert`: DataFrames, Delta tables, Parquet and Arrow -> MDS on a volume;
- :mod:`sparkgpu.data.text`: text, prompt/completion and chat rows -> token ids and a loss mask;
- :mod:`sparkgpu.data.tables`: Delta tables and Parquet files read in place (no Spark);
- :mod:`sparkgpu.data.mds`: the MDS format itself: columns, encoding, writer, reader, batch decoding;
- :mod:`sparkgpu.data.storage`: volumes, object stores and the local NVMe cache;
- :mod:`sparkgpu.data.loaders`: the datasets training iterates (MDS, mixtures, tokens, tables,
  files), their sample order, resumable position and metrics;
- :mod:`sparkgpu.data.images` and :mod:`sparkgpu.data.transforms`: image decoding and
  reproducible per-sample transforms;
- :mod:`sparkgpu.data.augment`: JPEG decoding fused with the crop, resize and flip
  (``decode=`` of :func:`~sparkgpu.data.loaders.dataset.dataset`), seeded per sample, on the CPU
  or the GPU, and ``normalize`` on the device;
- ``_gather``: the native (or numpy) row and span copies that batches are made of;
- :mod:`sparkgpu.data.report` and ``cli``: ``sparkgpu data bench|convert`` and ``sparkgpu cache``.
"""

from __future__ import annotations

from sparkgpu._util.modules import lazy_attributes

# Public name -> the module that defines it; imported on first use, so `import sparkgpu.data`
# stays cheap.
_NAMES = {
    "to_mds": "sparkgpu.data.convert.conversion",
    "ensure_mds": "sparkgpu.data.convert.conversion",
    "data_fingerprint": "sparkgpu.data.convert.conversion",
    "read_conversion": "sparkgpu.data.convert.conversion",
    "dataset": "sparkgpu.data.loaders.dataset",
    "Stream": "sparkgpu.data.loaders.mixture",
    "token_dataset": "sparkgpu.data.loaders.tokens",
    "tokenize": "sparkgpu.data.text.tokenize",
    "sft_dataset": "sparkgpu.data.loaders.sft",
    "table_dataset": "sparkgpu.data.loaders.table",
    "files_dataset": "sparkgpu.data.loaders.files",
    "decode_image": "sparkgpu.data.images",
    "TransformError": "sparkgpu.data.transforms",
    "RandomResizedCrop": "sparkgpu.data.augment.crops",
    "CenterCrop": "sparkgpu.data.augment.crops",
    "normalize": "sparkgpu.data.augment.crops",
}

__all__ = list(_NAMES)


__getattr__ = lazy_attributes(__name__, {name: (module, name) for name, module in _NAMES.items()})
