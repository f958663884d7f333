"""Usage reports: GPU-hours and cost grouped by team, user, GPU type, job or day.

Every figure counts the share of each attempt that falls inside the window, so a report
``--since 30d`` and a budget "per 30d" agree, and per-day bars sum to the total.
"""

from __future__ import annotations

import datetime as _dt
import time
from typing import Sequence

from sparkgpu.errors import ConfigurationError
from sparkgpu.spec.units import parse_duration

__all__ = ["parse_since", "usage_rows", "usage_table", "render_usage_table", "plot_usage", "usage_dataframe"]

_COLUMN_KEYS = ("user", "gpu_type", "backend", "job_id", "job_name", "status", "host")
_TIME_KEYS = ("day", "week", "month")


def parse_since(value, now: float | None = None) -> float | None:
    """Unix time from ``None``, a duration back from now (``"30d"``, ``"12h"``), an ISO date or a datetime.

    Raises:
        ConfigurationError: the value is neither; the message shows both forms.
    """
    now = time.time() if now is None else now
    if value is None:
        return None
    if isinstance(value, _dt.datetime):
        return (value if value.tzinfo else value.replace(tzinfo=_dt.timezone.utc)).timestamp()
    if isinstance(value, _dt.date):
        return _dt.datetime(value.year, value.month, value.day, tzinfo=_dt.timezone.utc).timestamp()
    if isinstance(value, str):
        try:
            return parse_since(_dt.datetime.fromisoformat(value), now)
        except ValueError:
            pass  # not a date: try a duration
    try:
        return now - parse_duration(value, name="since")
    except ConfigurationError:
        raise ConfigurationError(
            f"since={value!r} is neither a duration back from now ('30d', '12h') nor a date ('2026-01-31')"
        ) from None


def _normalize_by(by) -> list[str]:
    if by is None:
        return []
    keys = [k.strip() for k in (by.split(",") if isinstance(by, str) else by)]
    if any(not k for k in keys):
        raise ConfigurationError(f"by={by!r} has an empty key; write e.g. 'team' or 'team,gpu_type'")
    return keys


def usage_rows(ledger=None, since=None, until=None):
    """The ledger rows inside ``[since, until]``, each clipped to the window (a pyarrow table).

    Args:
        ledger: A :class:`~sparkgpu.usage.ledger.UsageLedger` or URI; the default ledger when ``None``.
        since: Window start: ``"30d"``, an ISO date, a datetime, or ``None`` for all time.
        until: Window end, same forms; ``None`` for now.
    """
    from sparkgpu.usage.ledger import UsageLedger, clip_to_window

    if ledger is None or isinstance(ledger, str):
        from sparkgpu.config import settings

        ledger = UsageLedger(ledger or settings().usage_ledger_uri)
    now = time.time()
    start, end = parse_since(since, now), parse_since(until, now)
    return clip_to_window(ledger.read(since=start, until=end), start, end)


def _split_by_day(frame):
    """One piece per attempt and UTC day it ran in, with usage split in proportion."""
    import numpy as np
    import pandas as pd

    pieces = []
    for i, (s, e) in enumerate(zip(frame["started_at"], frame["ended_at"])):
        s_ts, e_ts = s.timestamp(), e.timestamp()
        day = _dt.datetime.fromtimestamp(s_ts, _dt.timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
        span = max(e_ts - s_ts, 0.0)
        while True:
            next_day = day + _dt.timedelta(days=1)
            lo, hi = max(s_ts, day.timestamp()), min(e_ts, next_day.timestamp())
            share = (hi - lo) / span if span > 0 else 1.0
            pieces.append((i, day.date(), share))
            if e_ts <= next_day.timestamp():
                break
            day = next_day
    index = np.array([p[0] for p in pieces], dtype=int)
    out = frame.iloc[index].reset_index(drop=True)
    share = np.array([p[2] for p in pieces])
    for name in ("gpu_seconds", "cost_usd", "duration_s"):
        out[name] = out[name].to_numpy() * share
    out["day"] = pd.to_datetime([p[1] for p in pieces])
    return out


def _frame(rows, keys: Sequence[str]):
    """A pandas frame of ``rows`` with one column per grouping key."""
    import pandas as pd

    frame = rows.to_pandas()
    if any(k in _TIME_KEYS for k in keys):
        frame = _split_by_day(frame)
        frame["week"] = frame["day"] - pd.to_timedelta(frame["day"].dt.weekday, unit="D")  # ISO weeks start Monday
        frame["month"] = frame["day"].dt.to_period("M").astype(str)
        frame["day"] = frame["day"].dt.date.astype(str)
        frame["week"] = frame["week"].dt.date.astype(str)
    for key in keys:
        if key in _COLUMN_KEYS or key in _TIME_KEYS:
            continue
        frame[key] = [dict(tags or ()).get(key) or "(untagged)" for tags in frame["tags"]]
    return frame


def usage_table(ledger=None, since="30d", until=None, by="team"):
    """GPU-hours and cost per group over a window.

    Args:
        ledger: Ledger or URI; the default ledger when ``None``.
        since: Window start (``"30d"``, an ISO date, ``None`` for all time).
        until: Window end (``None`` for now).
        by: Grouping keys, a list or ``"team,gpu_type"``: tag names, ``user``, ``gpu_type``,
            ``backend``, ``job_id``, ``job_name``, ``status``, ``host``, or ``day`` / ``week`` /
            ``month`` (UTC). Jobs without a tag show as ``(untagged)``.

    Returns:
        A pyarrow table: the keys, then ``jobs``, ``attempts``, ``gpus_max``, ``gpu_hours``,
        ``cost_usd``; largest GPU-hours first (time keys sort by time).
    """
    import pandas as pd
    import pyarrow as pa

    keys = _normalize_by(by)
    rows = usage_rows(ledger, since, until)
    frame = _frame(rows, keys)
    if frame.empty:
        frame = pd.DataFrame(
            {k: pd.Series(dtype="object") for k in keys}
            | {
                "job_id": pd.Series(dtype="object"),
                "attempt": pd.Series(dtype="int32"),
                "gpus": pd.Series(dtype="int32"),
                "gpu_seconds": pd.Series(dtype="float64"),
                "cost_usd": pd.Series(dtype="float64"),
            }
        )
    frame = frame.assign(_attempt_key=frame["job_id"].astype(str) + "#" + frame["attempt"].astype(str))
    aggregations = dict(
        jobs=("job_id", "nunique"),
        attempts=("_attempt_key", "nunique"),
        gpus_max=("gpus", "max"),
        gpu_hours=("gpu_seconds", lambda s: float(s.sum()) / 3600.0),
        cost_usd=("cost_usd", "sum"),
    )
    if keys:
        grouped = frame.groupby(keys, dropna=False, sort=False).agg(**aggregations).reset_index()
    else:
        grouped = frame.groupby(lambda _: "all").agg(**aggregations).reset_index(drop=True)
    time_keys = [k for k in keys if k in _TIME_KEYS]
    if time_keys:
        grouped = grouped.sort_values(time_keys + ["gpu_hours"], ascending=[True] * len(time_keys) + [False])
    else:
        grouped = grouped.sort_values("gpu_hours", ascending=False, kind="stable")
    grouped["cost_usd"] = grouped["cost_usd"].round(4)
    table = pa.Table.from_pandas(grouped.reset_index(drop=True), preserve_index=False)
    for key in keys:  # an empty window leaves key columns untyped; Spark and polars want strings
        if pa.types.is_null(table.schema.field(key).type):
            table = table.set_column(table.schema.get_field_index(key), key, table[key].cast(pa.string()))
    return table


def render_usage_table(table, title: str = "GPU usage", console=None) -> None:
    """Prints ``usage_table``'s result as a rich table with a total line."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    view = Table(title=title, show_footer=table.num_rows > 1)
    data = table.to_pydict()
    numeric = {"jobs", "attempts", "gpus_max", "gpu_hours", "cost_usd"}
    totals = {
        "jobs": "",
        "attempts": sum(data.get("attempts", [])) if table.num_rows else 0,
        "gpus_max": "",
        "gpu_hours": f"{sum(data.get('gpu_hours', [])):,.2f}",
        "cost_usd": f"${sum(data.get('cost_usd', [])):,.2f}",
    }
    headers = {"gpus_max": "max GPUs", "gpu_hours": "GPU-hours", "cost_usd": "cost"}
    names = table.column_names
    for i, name in enumerate(names):
        footer = str(totals[name]) if name in totals else ("total" if i == 0 else "")
        view.add_column(headers.get(name, name), justify="right" if name in numeric else "left", footer=footer)
    for r in range(table.num_rows):
        cells = []
        for name in names:
            value = data[name][r]
            if name == "gpu_hours":
                cells.append(f"{value:,.2f}")
            elif name == "cost_usd":
                cells.append(f"${value:,.2f}")
            else:
                cells.append("" if value is None else str(value))
        view.add_row(*cells)
    if table.num_rows == 0:
        console.print(f"{title}: no usage recorded in this window")
        return
    console.print(view)


def plot_usage(path, ledger=None, since="30d", until=None, by="team") -> str:
    """Writes a PNG: GPU-hours per UTC day, stacked by ``by``.

    Returns:
        The path written.

    Raises:
        MissingDependencyError: matplotlib is not installed.
    """
    from sparkgpu._util.plotting import pyplot

    plt = pyplot("plotting usage")
    import pandas as pd

    keys = [k for k in _normalize_by(by) if k not in _TIME_KEYS]
    table = usage_table(ledger, since, until, by=["day", *keys]).to_pandas()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    if table.empty:
        ax.text(0.5, 0.5, "no usage recorded in this window", ha="center", va="center", transform=ax.transAxes)
    else:
        label = table[keys].astype(str).agg(",".join, axis=1) if keys else "all"
        pivot = (
            table.assign(group=label)
            .pivot_table(index="day", columns="group", values="gpu_hours", aggfunc="sum", fill_value=0.0)
            .sort_index()
        )
        days = pd.date_range(pivot.index.min(), pivot.index.max(), freq="D").strftime("%Y-%m-%d")
        pivot = pivot.reindex(days, fill_value=0.0)  # idle days show as gaps at zero, not as missing bars
        pivot = pivot[pivot.sum().sort_values(ascending=False).index]
        pivot.plot(kind="bar", stacked=True, ax=ax, width=0.8)
        ax.legend(title=",".join(keys) or None, fontsize="small")
        total, cost = table["gpu_hours"].sum(), table["cost_usd"].sum()
        ax.set_title(f"GPU-hours per day by {','.join(keys) or 'all'}: {total:,.1f} GPU-hours, ${cost:,.2f}")
    ax.set_xlabel("day (UTC)")
    ax.set_ylabel("GPU-hours")
    fig.autofmt_xdate()
    fig.tight_layout()
    path = str(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def usage_dataframe(spark, since="30d", by=None, until=None, ledger=None):
    """The ledger as a Spark DataFrame (works on Spark Connect and classic sessions).

    Args:
        spark: A SparkSession.
        since: Window start (``"30d"``, an ISO date, ``None`` for all time).
        by: ``None`` for one row per attempt (clipped to the window), or grouping keys as in
            :func:`usage_table` for one row per group.
        until: Window end (``None`` for now).
        ledger: Ledger or URI; the default ledger when ``None``.

    Returns:
        A ``pyspark.sql.DataFrame``.
    """
    table = usage_rows(ledger, since, until) if by is None else usage_table(ledger, since, until, by)
    if table.num_rows == 0:
        # Spark infers no schema from an empty table; a window without usage is still a frame with columns.
        from pyspark.sql.pandas.types import from_arrow_schema

        return spark.createDataFrame([], schema=from_arrow_schema(table.schema))
    return spark.createDataFrame(table)
