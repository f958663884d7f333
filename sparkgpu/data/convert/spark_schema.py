"""Spark schemas as Arrow: what the executors' conversion writes and what a plain scan must match.

Shared by the conversion on the executors (:mod:`sparkgpu.data.convert.spark`) and the check
that a DataFrame's files read with Spark's own types (:mod:`sparkgpu.data.convert.scan`).
pyspark is imported when a schema is converted, not with this module.
"""

from __future__ import annotations

import pyarrow as pa

from sparkgpu.errors import DataError

__all__ = ["arrow_schema"]


def arrow_schema(spark_schema) -> pa.Schema:
    """A Spark ``StructType`` as the Arrow schema ``mapInArrow`` and pyarrow use (timestamps in UTC).

    Raises:
        DataError: A column has a Spark type Arrow (and so MDS) cannot hold; names the cast to make.
    """
    from pyspark.sql.pandas.types import to_arrow_type

    fields = []
    for field in spark_schema.fields:
        try:
            arrow_type = to_arrow_type(field.dataType, timezone="UTC")
        except Exception as exc:  # pyspark raises several types for types Arrow lacks
            raise DataError(
                f"column {field.name!r} has Spark type {field.dataType.simpleString()}, which MDS "
                f"cannot store ({exc}); cast it to numbers, strings, binary or arrays of numbers "
                "first (for Spark ML vectors: pyspark.ml.functions.vector_to_array)"
            ) from None
        fields.append(pa.field(field.name, arrow_type))
    return pa.schema(fields)
