"""Data path: DataFrame / Delta / Parquet -> MDS shards on a volume -> local cache -> batches.

```python
from sparkgpu import data
data.to_mds(spark_df, "s3://bucket/feats/v1")
ds = data.dataset(remote="s3://bucket/feats/v1", local="/local_disk0/cache", batch_size=1024)
```
"""

from __future__ import annotations

__all__ = ["to_mds", "ensure_mds", "data_fingerprint", "read_conversion", "dataset", "decode_image", "TransformError"]


def __getattr__(name):
    if name in ("to_mds", "ensure_mds", "data_fingerprint", "read_conversion"):
        from sparkgpu.data import convert

        return getattr(convert, name)
    if name == "dataset":
        from sparkgpu.data.loader import dataset

        return dataset
    if name == "decode_image":
        from sparkgpu.data.images import decode_image

        return decode_image
    if name == "TransformError":
        from sparkgpu.data.transforms import TransformError

        return TransformError
    raise AttributeError(f"module 'sparkgpu.data' has no attribute {name!r}")
