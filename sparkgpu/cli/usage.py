"""``sparkgpu usage``: GPU-hours and cost by team, user, GPU type or day; budgets; plots."""

from __future__ import annotations

import json

__all__ = ["register", "cmd_usage"]


def register(subparsers) -> None:
    """Adds ``sparkgpu usage`` (see :data:`sparkgpu.cli.COMMANDS`)."""
    p = subparsers.add_parser(
        "usage",
        help="GPU-hours and cost, grouped (e.g. --by team --since 30d)",
        description="Reads the usage ledger (SPARKGPU_USAGE_LEDGER) and prints GPU-hours and cost per group. "
        "Attempts across the window's edge count for their share inside it.",
    )
    p.add_argument(
        "--by",
        default="team",
        help="grouping keys, comma-separated: a tag (team, project, ...), user, gpu_type, backend, "
        "job_id, job_name, status, host, day, week, month (default: team)",
    )
    p.add_argument(
        "--since", default="30d", help="window start: a duration back from now (30d, 12h) or a date (default 30d)"
    )
    p.add_argument("--until", help="window end (default now)")
    p.add_argument("--plot", metavar="PNG", help="also write a chart of GPU-hours per day, stacked by --by")
    p.add_argument("--budgets", action="store_true", help="show each budget of the usage policy with its spend")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    p.add_argument("--ledger", help="ledger URI (default: SPARKGPU_USAGE_LEDGER)")
    p.add_argument("--compact", action="store_true", help="merge the ledger's small files first (faster reads)")
    p.set_defaults(handler=cmd_usage)


def cmd_usage(args) -> int:
    from sparkgpu.cli import console as make_console
    from sparkgpu.config import settings
    from sparkgpu.usage.ledger import UsageLedger
    from sparkgpu.usage.meter import UsageMeter
    from sparkgpu.usage.report import parse_since, plot_usage, render_usage_table, usage_table

    ledger = UsageLedger(args.ledger or settings().usage_ledger_uri)
    console, err = make_console(), make_console(stderr=True)
    parse_since(args.since), parse_since(args.until)  # bad input fails before any read
    with err.status(f"reading {ledger.uri}"):
        recovered = UsageMeter(ledger, policy=False).recover()
        if args.compact:
            ledger.compact()
        table = usage_table(ledger, since=args.since, until=args.until, by=args.by)
    if recovered:
        err.print(f"recorded {len(recovered)} attempt(s) whose client stopped before writing its usage")
    if args.json:
        for row in table.to_pylist():
            print(json.dumps(row, default=str))
    else:
        window = f"since {args.since}" + (f" until {args.until}" if args.until else "")
        render_usage_table(table, title=f"GPU usage by {args.by}, {window}", console=console)
    if args.budgets:
        _print_budgets(ledger, console)
    if args.plot:
        with err.status(f"plotting {args.plot}"):
            path = plot_usage(args.plot, ledger, since=args.since, until=args.until, by=args.by)
        err.print(f"wrote {path}")
    return 0


def _print_budgets(ledger, console) -> None:
    import time

    from rich.table import Table

    from sparkgpu.usage.policy import UsagePolicy, format_duration

    policy = UsagePolicy.load(None)
    if policy is None or not policy.budgets:
        console.print("no budgets: set SPARKGPU_USAGE_POLICY to a policy file with a 'budgets' section")
        return
    now = time.time()
    rows = ledger.read(since=now - max(b.window for b in policy.budgets))
    view = Table(title=f"budgets of {policy.name!r}")
    for name in ("budget", "window", "spent", "limit", "used"):
        view.add_column(name, justify="left" if name == "budget" else "right")
    for budget in policy.budgets:
        spent = budget.spent(rows, now)
        share = spent / budget.limit if budget.limit else float("inf")
        style = "red" if share >= 1 else "yellow" if share >= 0.8 else "green"
        view.add_row(
            budget.label.split(":")[0],
            format_duration(budget.window),
            budget.format_amount(spent),
            budget.format_amount(budget.limit),
            f"[{style}]{share:.0%}[/]",
        )
    console.print(view)
