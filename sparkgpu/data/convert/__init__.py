"""DataFrames, Delta tables, Parquet files and Arrow data turned into MDS shards on a volume.

- :mod:`~sparkgpu.data.convert.conversion`: ``to_mds`` / ``ensure_mds``, the one call, and the
  data fingerprint that makes a conversion happen once per data version;
- :mod:`~sparkgpu.data.convert.spark`: Spark DataFrames written by the executors (``mapInArrow``),
  with :mod:`~sparkgpu.data.convert.spark_schema` for their types;
- :mod:`~sparkgpu.data.convert.scan`: DataFrames that only scan files, converted from the files;
- :mod:`~sparkgpu.data.convert.files`: Delta, Parquet and Arrow sources converted on this machine,
  in parallel groups that keep the row order;
- :mod:`~sparkgpu.data.convert.output`: the output folder, committed atomically by its ``index.json``;
- :mod:`~sparkgpu.data.convert.claim`: one conversion per folder at a time, the others waiting
  for it (a lease, taken over when its holder dies).
"""
