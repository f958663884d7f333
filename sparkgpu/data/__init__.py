"""Data path: DataFrame / Delta / Parquet -> MDS shards on a volume -> local cache -> batches.

```python
from sparkgpu import data
data.to_mds(spark_df, "s3://bucket/feats/v1")
ds = data.dataset(remote="s3://bucket/feats/v1", local="/local_disk0/cache", batch_size=1024)
```
"""

from __future__ import annotations

__all__ = ["to_mds", "ensure_mds", "data_fingerprint", "read_conversion", "dataset"]
# Token packing and mixtures.
__all__ += ["token_dataset", "Stream"]
_MIXES = {"token_dataset": "sparkgpu.data.tokens", "Stream": "sparkgpu.data.mixture"}


def __getattr__(name):
    if name in ("to_mds", "ensure_mds", "data_fingerprint", "read_conversion"):
        from sparkgpu.data import convert

        return getattr(convert, name)
    if name == "dataset":
        from sparkgpu.data.loader import dataset

        return dataset
    if name in _MIXES:
        import importlib

        return getattr(importlib.import_module(_MIXES[name]), name)
    raise AttributeError(f"module 'sparkgpu.data' has no attribute {name!r}")
