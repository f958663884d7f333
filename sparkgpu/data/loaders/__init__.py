"""What training iterates: datasets that turn shards, tables or files into batches, resumably.

- :mod:`~sparkgpu.data.loaders.dataset`: ``data.dataset``, one MDS dataset or a mixture;
- :mod:`~sparkgpu.data.loaders.mds_loader`: the MDS loader (with ``_pipeline``: where its
  batches are made, in this process, in DataLoader workers, on a thread, onto the GPU);
- :mod:`~sparkgpu.data.loaders.mixture`: several MDS datasets mixed by proportion or repeat;
- :mod:`~sparkgpu.data.loaders.tokens`: ``data.token_dataset``, token arrays packed into blocks
  (with ``_token_shards``: where each shard's documents lie);
- :mod:`~sparkgpu.data.loaders.table`: ``data.table_dataset``, batches straight from a table's
  files (with :mod:`~sparkgpu.data.loaders.table_tensors`: Arrow rows as batch tensors);
- :mod:`~sparkgpu.data.loaders.files`: ``data.files_dataset``, the files of a volume folder;
- :mod:`~sparkgpu.data.loaders.order`: the epoch's sample order and its split over ranks,
  batches and workers, and the resumable position every loader keeps;
- :mod:`~sparkgpu.data.loaders.positioned`: the exact position of the table and files datasets
  under DataLoader workers;
- :mod:`~sparkgpu.data.loaders.metrics`: what a loader costs the training step;
- ``_base``: what the loaders share (read options, resume state, the split over DataLoader
  workers), and ``_shards``: the shard cache each opens and the mapping of one shard.
"""
