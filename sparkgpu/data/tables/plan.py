"""Which DataFrames the ranks can read in place: a plain scan (+ projection/filter) of files.

``spark.gpu.train(fn, data=df, data_format="table")`` hands the ranks a :class:`TableRef`
instead of converting ``df`` to MDS, when ``df``'s Spark Connect plan is a read of a Parquet
or Delta source, under any number of column selections and filters. That is decided on the
client's own unresolved plan (the protobuf Spark Connect sends), which names the source
format, paths and options, the selected columns and the filter conditions as written; any
other step (a join, a computed column, an aggregate, a table name the client cannot locate)
means the rows are Spark's to compute, and the DataFrame is converted as usual.
"""

from __future__ import annotations

import dataclasses
import os

__all__ = ["TableRef", "table_ref_of"]

_COMPARISONS = {"==": "=", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}


@dataclasses.dataclass(frozen=True)
class TableRef:
    """A table the ranks read with :func:`sparkgpu.data.table_dataset` (pass it as ``path_or_url``).

    Attributes:
        path: The Delta table root or Parquet folder/file.
        columns: Columns to read, or ``None`` for all.
        filter: SQL predicate on the rows, or ``None``.
        version: Delta version, or ``None``.
        timestamp: Delta timestamp, or ``None``.
    """

    path: str
    columns: tuple | None = None
    filter: str | None = None
    version: int | None = None
    timestamp: str | None = None

    def __str__(self) -> str:
        return self.path


def table_ref_of(df) -> tuple[TableRef | None, str]:
    """Returns ``(TableRef, "")`` for a plain file scan, or ``(None, why not)``."""
    try:
        relation = df._plan.to_proto(df._session.client).root
    except Exception as exc:  # not a Spark Connect DataFrame, or a plan the client cannot serialise
        return None, f"its plan cannot be inspected ({type(exc).__name__})"
    columns, filters = None, []
    while True:
        kind = relation.WhichOneof("rel_type")
        if kind == "project":
            names = [_column_name(e) for e in relation.project.expressions]
            if None in names:
                return None, "it selects computed columns"
            if columns is None:  # the outermost selection is what the ranks get
                columns = tuple(names)
            relation = relation.project.input
        elif kind == "filter":
            condition = _sql(relation.filter.condition)
            if condition is None:
                return None, "its filter uses expressions the table reader does not evaluate"
            filters.append(condition)
            relation = relation.filter.input
        elif kind == "read":
            break
        else:
            return None, f"its plan has a {kind} step (only a scan with column selections and filters is read in place)"
    read = relation.read
    if read.WhichOneof("read_type") != "data_source":
        return None, "it reads a catalog table, whose files the client cannot locate; pass the table's path instead"
    source = read.data_source
    fmt = (source.format or "").lower()
    if fmt not in ("parquet", "delta") or len(source.paths) != 1:
        return (
            None,
            f"it reads {fmt or 'an unknown format'} from {len(source.paths)} paths (only one Parquet or Delta path is read in place)",
        )
    options = {k.lower(): v for k, v in source.options.items()}
    version = options.pop("versionasof", None)
    timestamp = options.pop("timestampasof", None)
    if options:
        return None, f"its read options {sorted(options)} are Spark's to apply"
    path = source.paths[0]
    if "://" not in path:
        path = os.path.abspath(path)
    where = " AND ".join(f"({f})" for f in reversed(filters)) or None
    return TableRef(path, columns, where, int(version) if version is not None else None, timestamp), ""


def _column_name(expression) -> str | None:
    kind = expression.WhichOneof("expr_type")
    if kind == "unresolved_attribute":
        name = expression.unresolved_attribute.unparsed_identifier
        return name if "." not in name and "`" not in name else None
    if kind == "alias" and _column_name(expression.alias.expr) == expression.alias.name[0]:
        return expression.alias.name[0]
    return None


def _sql(expression) -> str | None:
    kind = expression.WhichOneof("expr_type")
    if kind == "expression_string":
        return expression.expression_string.expression
    if kind == "unresolved_attribute":
        name = _column_name(expression)
        return f'"{name}"' if name else None
    if kind == "literal":
        return _literal(expression.literal)
    if kind != "unresolved_function":
        return None
    function = expression.unresolved_function
    parts = [_sql(a) for a in function.arguments]
    args = [part for part in parts if part is not None]
    if len(args) != len(parts):
        return None
    name = function.function_name
    if name in _COMPARISONS and len(args) == 2:
        return f"{args[0]} {_COMPARISONS[name]} {args[1]}"
    if name in ("and", "or") and len(args) == 2:
        return f"({args[0]}) {name.upper()} ({args[1]})"
    if name == "not" and len(args) == 1:
        return f"NOT ({args[0]})"
    if name in ("isnull", "isNull") and len(args) == 1:
        return f"{args[0]} IS NULL"
    if name in ("isnotnull", "isNotNull") and len(args) == 1:
        return f"{args[0]} IS NOT NULL"
    if name == "in" and len(args) >= 2:
        return f"{args[0]} IN ({', '.join(args[1:])})"
    return None


def _literal(literal) -> str | None:
    kind = literal.WhichOneof("literal_type")
    if kind in ("byte", "short", "integer", "long", "float", "double"):
        return repr(getattr(literal, kind))
    if kind == "boolean":
        return "TRUE" if literal.boolean else "FALSE"
    if kind == "string":
        return "'" + literal.string.replace("'", "''") + "'"
    return None
