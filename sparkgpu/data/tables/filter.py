"""Row filters of the table dataset: a SQL predicate string turned into a pyarrow expression.

The string is parsed by ``sqlglot`` (the SQL dialect of deltalake's ``predicate=``: comparisons,
``AND``/``OR``/``NOT``, ``IN``, ``BETWEEN``, ``IS [NOT] NULL``, literals, ``"quoted"``
identifiers); the expression it becomes lets pyarrow prune partitions and row groups by their
statistics and evaluate the rest on the rows read.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from sparkgpu.errors import ConfigurationError, MissingDependencyError

__all__ = ["to_expression", "KEEP"]

# The column a filter's verdict is projected into beside the rows, where the filter cannot go to
# the scanner (rows it dropped would shift the positions a deletion vector counts).
KEEP = "__sparkgpu_keep"


def to_expression(filter, schema: pa.Schema) -> pc.Expression | None:
    """Returns ``filter`` (``None``, a SQL predicate string or a pyarrow expression) as an expression.

    Raises:
        ConfigurationError: The string is not a predicate this reader understands, or names
            a column the table does not have.
    """
    if filter is None or isinstance(filter, pc.Expression):
        return filter
    if not isinstance(filter, str):
        raise ConfigurationError(
            f"filter={filter!r} must be a SQL predicate string such as \"day >= '2026-11-01'\" or a pyarrow.compute expression"
        )
    try:
        import sqlglot
        from sqlglot import exp
    except ImportError:
        raise MissingDependencyError("filter= as a SQL string", "pip install sqlglot") from None
    try:
        tree = sqlglot.parse_one(filter)
    except sqlglot.errors.ParseError as exc:
        raise ConfigurationError(
            f"filter={filter!r} is not a SQL predicate ({exc}); write e.g. \"day >= '2026-11-01' AND label = 1\""
        ) from None
    return _Translator(exp, schema, filter).expression(tree)


class _Translator:
    def __init__(self, exp, schema: pa.Schema, text: str):
        self.exp, self.schema, self.text = exp, schema, text
        self.comparisons = {
            exp.EQ: "__eq__",
            exp.NEQ: "__ne__",
            exp.GT: "__gt__",
            exp.GTE: "__ge__",
            exp.LT: "__lt__",
            exp.LTE: "__le__",
        }

    def fail(self, node, why: str):
        raise ConfigurationError(
            f"filter={self.text!r}: {why} (at {node.sql()!r}); use comparisons, AND/OR/NOT, IN, BETWEEN and IS NULL on columns"
        )

    def expression(self, node) -> pc.Expression:
        exp = self.exp
        if isinstance(node, exp.Paren):
            return self.expression(node.this)
        if isinstance(node, exp.And):
            return self.expression(node.left) & self.expression(node.right)
        if isinstance(node, exp.Or):
            return self.expression(node.left) | self.expression(node.right)
        if isinstance(node, exp.Not):
            return ~self.expression(node.this)
        if type(node) in self.comparisons:
            left, right = self.operand(node.left), self.operand(node.right)
            left, right = self.align(left, right), self.align(right, left)
            return getattr(left, self.comparisons[type(node)])(right)
        if isinstance(node, exp.In):
            column = self.operand(node.this)
            values = [self.align(self.operand(v), column) for v in node.expressions]
            if not all(isinstance(v, pa.Scalar) for v in values):
                self.fail(node, "IN takes a list of literals")
            return column.isin(pa.array([v.as_py() for v in values], type=values[0].type if values else None))
        if isinstance(node, exp.Between):
            column = self.operand(node.this)
            return (column >= self.align(self.operand(node.args["low"]), column)) & (
                column <= self.align(self.operand(node.args["high"]), column)
            )
        if isinstance(node, exp.Is) and isinstance(node.expression, exp.Null):
            return self.operand(node.this).is_null()
        if isinstance(node, exp.Column) or isinstance(node, exp.Boolean):
            return self.operand(node)
        self.fail(node, f"{type(node).__name__} is not supported")

    def operand(self, node):
        exp = self.exp
        if isinstance(node, exp.Paren):
            return self.operand(node.this)
        if isinstance(node, exp.Column):
            name = node.name
            if name not in self.schema.names:
                self.fail(node, f"the table has no column {name!r} (columns: {', '.join(self.schema.names)})")
            return pc.field(name)
        if isinstance(node, exp.Literal):
            if node.is_string:
                return pa.scalar(node.this)
            text = node.this
            return pa.scalar(int(text)) if text.lstrip("-").isdigit() else pa.scalar(float(text))
        if isinstance(node, exp.Neg) and isinstance(node.this, exp.Literal):
            return pa.scalar(-self.operand(node.this).as_py())
        if isinstance(node, exp.Boolean):
            return pa.scalar(node.this)
        if isinstance(node, exp.Null):
            return pa.scalar(None)
        self.fail(node, f"{type(node).__name__} is not a column or literal")

    def align(self, value, other):
        # A literal compared with a column takes the column's type ('2026-11-01' against a
        # date column is a date), so pyarrow can compare it with row-group statistics.
        if isinstance(value, pa.Scalar) and isinstance(other, pc.Expression):
            name = str(other)
            if name in self.schema.names:
                try:
                    return value.cast(self.schema.field(name).type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    return value
        return value
