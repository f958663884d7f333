"""The kind of a conversion's source, decided once (:mod:`sparkgpu.data.tables.resolve`).

Spark DataFrames are stand-ins here: an object of a ``pyspark.sql`` module with the client plan
Spark Connect would send (the resolver reads that plan on the client, with no server).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import sparkgpu
from sparkgpu import data
from sparkgpu.data.tables.plan import TableRef
from sparkgpu.data.tables.resolve import ResolvedSource, SourceKind, resolve_source
from sparkgpu.errors import ConfigurationError, DataError

PACKAGE = Path(sparkgpu.__file__).resolve().parent


class _Plan:
    def __init__(self, relation):
        self._relation = relation

    def to_proto(self, _client):
        return type("ProtoPlan", (), {"root": self._relation})()


def spark_frame(relation=None):
    """A stand-in Spark Connect DataFrame whose client plan is ``relation``."""
    frame = type("DataFrame", (), {"__module__": "pyspark.sql.connect.dataframe", "mapInArrow": None})()
    frame._session = type("Session", (), {"client": None})()
    if relation is not None:
        frame._plan = _Plan(relation)
    return frame


def parquet_scan(path: str):
    from pyspark.sql.connect.proto import relations_pb2 as r

    read = r.Relation(read=r.Read(data_source=r.Read.DataSource(format="parquet", paths=[path])))
    return r.Relation(project=r.Project(input=read, expressions=[_column("id")]))


def _column(name: str):
    from pyspark.sql.connect.proto import expressions_pb2 as e

    return e.Expression(unresolved_attribute=e.Expression.UnresolvedAttribute(unparsed_identifier=name))


@pytest.fixture
def parquet(tmp_path) -> str:
    path = tmp_path / "f.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3]}), path)
    return str(path)


@pytest.fixture
def delta(tmp_path) -> str:
    from deltalake import write_deltalake

    uri = str(tmp_path / "delta")
    write_deltalake(uri, pa.table({"id": [1, 2]}))
    write_deltalake(uri, pa.table({"id": [3]}), mode="append")
    return uri


def test_paths_are_delta_or_parquet_and_keep_their_time_travel(parquet, delta, tmp_path):
    for given in (parquet, Path(parquet), str(tmp_path)):  # a file, a PathLike, a folder
        resolved = resolve_source(given)
        assert resolved.kind is SourceKind.PARQUET and resolved.path == str(given) == resolved.data
    resolved = resolve_source(delta, version=0, storage_options={"k": "v"})
    assert (resolved.kind, resolved.path, resolved.version, resolved.storage_options) == (
        SourceKind.DELTA,
        delta,
        0,
        {"k": "v"},
    )
    assert resolve_source("file://" + delta).kind is SourceKind.DELTA


def test_a_delta_table_object_is_delta_without_a_path(delta):
    from deltalake import DeltaTable

    table = DeltaTable(delta)
    resolved = resolve_source(table, version=1)
    assert resolved.kind is SourceKind.DELTA and resolved.data is table and resolved.path is None


def test_arrow_and_pandas_data_in_memory():
    table = pa.table({"id": [1, 2]})
    assert resolve_source(table).kind is SourceKind.ARROW and resolve_source(table).data is table
    batch = resolve_source(table.to_batches()[0])
    assert batch.kind is SourceKind.ARROW and batch.data.equals(table)  # a batch resolves as a Table
    reader = pa.RecordBatchReader.from_batches(table.schema, table.to_batches())
    assert resolve_source(reader).kind is SourceKind.ARROW_STREAM
    assert resolve_source(pd.DataFrame({"id": [1]})).kind is SourceKind.PANDAS


def test_a_dataframe_scanning_files_is_a_plain_scan_with_its_files_resolved(parquet):
    frame = spark_frame(parquet_scan(parquet))
    resolved = resolve_source(frame)
    assert resolved.kind is SourceKind.SPARK_SCAN and resolved.data is frame
    assert resolved.scan == TableRef(parquet, ("id",))
    assert resolved.files is not None and resolved.files.kind is SourceKind.PARQUET and resolved.files.path == parquet


def test_a_scan_of_files_this_machine_cannot_see_keeps_its_reference(tmp_path):
    missing = str(tmp_path / "elsewhere")
    resolved = resolve_source(spark_frame(parquet_scan(missing)))
    assert resolved.kind is SourceKind.SPARK_SCAN and resolved.scan == TableRef(missing, ("id",))
    assert resolved.files is None and "not visible on this machine" in resolved.why


def test_other_dataframes_are_spark_s_to_compute_and_say_why():
    from pyspark.sql.connect.proto import relations_pb2 as r

    resolved = resolve_source(spark_frame(r.Relation(range=r.Range(start=0, end=10, step=1))))
    assert resolved.kind is SourceKind.SPARK and resolved.scan is None and "range" in resolved.why
    assert resolve_source(spark_frame()).kind is SourceKind.SPARK  # a classic DataFrame: no client plan


def test_a_table_name_reads_through_the_session_and_is_a_path_without_one():
    tables = []
    session = type("Session", (), {"table": lambda self, name: tables.append(name) or spark_frame()})()
    resolved = resolve_source("main.ml.clicks", spark=session)
    assert resolved.kind is SourceKind.SPARK and tables == ["main.ml.clicks"] and "catalog table name" in resolved.why
    with pytest.raises(DataError, match="cannot read main.ml.clicks: there is no such file or folder"):
        resolve_source("main.ml.clicks")


def test_a_resolved_source_resolves_to_itself():
    resolved = resolve_source(pa.table({"id": [1]}))
    assert isinstance(resolved, ResolvedSource) and resolve_source(resolved) is resolved
    with pytest.raises(ConfigurationError, match="resolved with"):
        resolve_source(resolved, version=3)


def test_bad_sources_and_time_travel_fail_naming_the_fix(parquet):
    with pytest.raises(ConfigurationError, match="cannot convert a list; give a Spark DataFrame, a path"):
        resolve_source([1, 2, 3])
    with pytest.raises(ConfigurationError, match="not a Delta table \\(no _delta_log\\)"):
        resolve_source(parquet, version=3)
    with pytest.raises(ConfigurationError, match="option\\('versionAsOf', 12\\)"):
        resolve_source(spark_frame(parquet_scan(parquet)), timestamp="2026-01-01")
    with pytest.raises(ConfigurationError, match="only Delta tables have versions"):
        resolve_source(pa.table({"id": [1]}), version=1)


def test_conversion_and_table_reader_take_a_resolved_source(delta, tmp_path):
    resolved = resolve_source(delta, version=0)
    result = data.to_mds(resolved, str(tmp_path / "out"), progress=False)
    assert result.samples == 2 and result.source["version"] == 0
    assert data.data_fingerprint(resolved) == data.data_fingerprint(delta, version=0)
    with pytest.raises(ConfigurationError, match="not a table's files"):
        data.table_dataset(pa.table({"id": [1]}), batch_size=8, rank=0, world_size=1)


# Where a source's kind may be told: the resolver alone. Kind checks are its predicates and
# isinstance tests against the types a source can have.
KIND_PREDICATES = {
    "is_spark_dataframe",
    "is_delta_table",
    "is_delta_table_object",
    "_is_delta_table_object",
    "table_ref_of",
}
SOURCE_TYPES = {"DeltaTable", "Table", "RecordBatch", "RecordBatchReader", "PathLike"}
RESOLVER = "data/tables/resolve.py"
# open_delta's own argument is a path or an opened deltalake table, as deltalake's is.
ALLOWED = {("data/tables/delta.py", "DeltaTable")}


def _name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def kind_checks(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        if name in KIND_PREDICATES:
            found.append((node.lineno, name))
        elif name == "isinstance" and len(node.args) == 2:
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            found += [(node.lineno, c) for c in map(_name, classes) if c in SOURCE_TYPES]
    return found


def test_only_the_resolver_tells_a_source_s_kind():
    """The conversion path (convert/, tables/, the entry points, tokenize) and every other module
    call no kind predicate; those on the conversion path test no source type either."""
    on_path = ("data/convert/", "data/tables/", "api/", "data/text/tokenize.py")
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == RESOLVER:
            continue
        for line, check in kind_checks(path):
            if (relative, check) in ALLOWED:
                continue
            if check in KIND_PREDICATES or relative.startswith(on_path):
                offenders.append(f"{relative}:{line} {check}")
    assert offenders == [], offenders
    assert kind_checks(PACKAGE / RESOLVER)  # the check sees the resolver's own
