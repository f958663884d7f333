"""The MDS format (MosaicML Streaming's, byte for byte): columns, encoding, writer, reader.

- :mod:`~sparkgpu.data.mds.columns`: which MDS encoding stores each Arrow column;
- :mod:`~sparkgpu.data.mds.encoding`: whole Arrow record batches encoded as MDS samples;
- :mod:`~sparkgpu.data.mds.writer`: shard files and ``index.json``, cut as ``streaming.MDSWriter`` does;
- :mod:`~sparkgpu.data.mds.reader`: the index, its columns and memory-mapped shards;
- :mod:`~sparkgpu.data.mds.decode`: whole batches decoded at once from those shards;
- :mod:`~sparkgpu.data.mds.features`: fixed-width columns gathered straight into a feature matrix.

The encoding and the writer run on Spark executors, shipped by value: they import numpy,
pyarrow and the standard library only, so this package's ``__init__`` imports nothing.
"""
