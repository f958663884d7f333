"""``sparkgpu sweeps`` and ``sparkgpu sweep``: the sweeps of this machine, one sweep's trials, and resuming one.

```
sparkgpu sweeps                      # every sweep: state, trials by state, best value
sparkgpu sweep SWEEP_ID              # its trials: state, value, last reported step, parameters, job
sparkgpu sweep resume SWEEP_ID       # goes on with a sweep whose driver died (runs here until it ends);
                                     # refused while a detached sweep's keeper lives (it restarts the driver)
```
"""

from __future__ import annotations

import json
import logging
import sys

from sparkgpu.errors import ConfigurationError

logger = logging.getLogger(__name__)

__all__ = ["register_sweeps", "cmd_sweeps", "cmd_sweep"]

EXIT_OK = 0


def register_sweeps(subparsers) -> None:
    p = subparsers.add_parser("sweeps", help="the sweeps of this machine (sparkgpu.sweep): state, trials, best value")
    p.add_argument("--json", action="store_true", help="one JSON object per sweep")
    p.set_defaults(handler=cmd_sweeps)
    p = subparsers.add_parser(
        "sweep", help="one sweep's trials (sparkgpu sweep SWEEP_ID), or resume one (sparkgpu sweep resume SWEEP_ID)"
    )
    p.add_argument("words", nargs="+", metavar="SWEEP_ID", help="a sweep id (or a unique prefix), or: resume SWEEP_ID")
    p.add_argument("--json", action="store_true", help="one JSON object per trial")
    p.set_defaults(handler=cmd_sweep)


def _value(value) -> str:
    return "" if value is None else f"{value:.6g}"


def _time(ts: float | None) -> str:
    import datetime

    return "" if ts is None else datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def cmd_sweeps(args) -> int:
    from sparkgpu.cli import console
    from sparkgpu.sweeps.folder import list_sweeps
    from sparkgpu.sweeps.summary import sweep_row

    rows = [sweep_row(folder) for folder in list_sweeps()]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return EXIT_OK
    out = console()
    if not rows:
        out.print("no sweeps")
        return EXIT_OK
    from rich.table import Table

    table = Table(title="sparkgpu sweeps")
    for name in ("sweep id", "state", "trials", "best value", "created"):
        table.add_column(name, no_wrap=name == "sweep id")
    for row in rows:
        done = sum(row["trials"].values())
        states = ", ".join(f"{n} {s.lower()}" for s, n in sorted(row["trials"].items()))
        table.add_row(
            row["sweep_id"],
            row["state"],
            f"{done}/{row['n_trials']}" + (f" ({states})" if states else ""),
            _value(row["best_value"]),
            _time(row["created_at"]),
        )
    out.print(table)
    return EXIT_OK


def cmd_sweep(args) -> int:
    words = args.words
    if words[0] == "resume":
        if len(words) != 2:
            raise ConfigurationError("usage: sparkgpu sweep resume SWEEP_ID")
        return _resume(words[1])
    if len(words) != 1:
        raise ConfigurationError("usage: sparkgpu sweep SWEEP_ID, or sparkgpu sweep resume SWEEP_ID")
    from sparkgpu.cli import console
    from sparkgpu.sweeps.folder import find_sweep
    from sparkgpu.sweeps.summary import sweep_row, trial_rows

    folder = find_sweep(words[0])
    rows = trial_rows(folder)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return EXIT_OK
    summary = sweep_row(folder)
    out = console()
    from rich.table import Table

    title = f"sweep {folder.sweep_id}: {summary['state']}"
    if summary["stopped_because"]:
        title += f" ({summary['stopped_because']})"
    table = Table(title=title)
    for name in ("trial", "state", "value", "last step", "params", "job id"):
        table.add_column(name, justify="right" if name in ("trial", "value", "last step") else "left")
    for row in rows:
        state = row["state"] + (f": {row['error'][0]}" if row["error"] else "")
        table.add_row(
            str(row["number"]),
            state,
            _value(row["value"]),
            "" if row["last_step"] is None else str(row["last_step"]),
            ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row["params"].items()),
            row["job_id"] or "",
        )
    out.print(table)
    if (folder.read().get("options") or {}).get("storage") != "journal":
        out.print("its study is the caller's own (study=...): its trials are in that study's storage")
    if summary["parent_run_id"]:
        out.print(f"MLflow parent run: {summary['parent_run_id']}")
    return EXIT_OK


def _resume(sweep_id: str) -> int:
    from sparkgpu.sweeps.api import resume_sweep

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(message)s")
    result = resume_sweep(sweep_id)
    best = result.study.best_trial if any(t.state.name == "COMPLETE" for t in result.study.trials) else None
    print(
        f"sweep {result.sweep_id} ended"
        + (f"; best trial {best.number}: {best.value:.6g} {best.params}" if best else "")
    )
    return EXIT_OK
