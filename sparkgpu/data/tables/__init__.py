"""Delta tables and Parquet files read in place as pyarrow datasets, with no Spark.

- :mod:`~sparkgpu.data.tables.paths`: a table's path as a pyarrow filesystem; Delta or Parquet;
- :mod:`~sparkgpu.data.tables.delta`: one version of a Delta table, deletion vectors included;
- :mod:`~sparkgpu.data.tables.filter`: a SQL predicate string as a pyarrow expression;
- :mod:`~sparkgpu.data.tables.plan`: which Spark DataFrames are plain scans of such files;
- :mod:`~sparkgpu.data.tables.source`: a table dataset's row groups and surviving-row counts.

Both the conversion of files to MDS and the table dataset read tables through here.
"""
