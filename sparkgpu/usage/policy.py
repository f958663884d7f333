"""Usage policies: which GPUs a job may use, how many, how long, with which tags, within which budgets.

A policy is a TOML or YAML file (``SPARKGPU_USAGE_POLICY``) or a :class:`UsagePolicy`::

    name: ml-platform
    allowed_gpu_types: [A10, H100]
    max_gpus_per_job: 8
    max_runtime: 7d                  # running time of one job, summed over its attempts
    required_tags: [team]
    budgets:
      team=ml: 100 GPU-hours per 30d
      team=ml,project=ctr: ["$2000 per 30d", "20 GPU-hours per 1d"]
      user=alice: 10 GPU-hours per 7d
      "*": 5000 GPU-hours per 30d    # everything

A budget's selector is ``key=value`` pairs (all must match) over the job's tags and the
columns ``user``, ``gpu_type``, ``backend`` and ``job_name``; ``*`` matches every job. Its
spend is the ledger's usage of every job the selector matches, over a rolling window
(attempts across the window's edge count for their share inside it).

Everything is checked before launch (:meth:`UsagePolicy.check_launch`); budgets and the
runtime limit are checked again while the job runs (see :class:`~sparkgpu.usage.meter.UsageMeter`),
where a spent budget makes the ranks checkpoint and stop.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import Any, Mapping

from sparkgpu.spec.catalog import lookup_gpu_type
from sparkgpu.errors import ConfigurationError, PolicyViolationError
from sparkgpu.spec import JobSpec
from sparkgpu.spec.units import parse_duration

__all__ = ["Budget", "UsagePolicy", "job_attributes", "format_duration"]

_COLUMN_KEYS = ("user", "gpu_type", "backend", "job_name")
_BUDGET = re.compile(
    r"^\s*(?P<usd>\$)?\s*(?P<amount>\d+(?:\.\d+)?)\s*(?P<unit>gpu[- _]?hours?|gpu[- _]?h|usd|dollars?)?\s*"
    r"(?:per|/)\s*(?P<window>\S+)\s*$",
    re.IGNORECASE,
)
_POLICY_KEYS = ("name", "allowed_gpu_types", "max_gpus_per_job", "max_runtime", "required_tags", "budgets")


def format_duration(seconds: float) -> str:
    """``"30d"``, ``"12h"``, ``"90s"``: the largest unit that divides evenly."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def job_attributes(job: JobSpec, user: str) -> dict[str, str]:
    """The values budget selectors match against: the job's tags plus ``user``, ``gpu_type``, ..."""
    return {
        **job.tags,
        "user": user,
        "gpu_type": job.resources.gpu_type or "",
        "backend": job.backend,
        "job_name": job.name,
    }


@dataclasses.dataclass(frozen=True)
class Budget:
    """A spending limit for the jobs a selector matches, over a rolling window.

    Attributes:
        selector: ``key -> value`` that a job must all match; empty matches every job.
        limit: The amount allowed per window.
        unit: ``"gpu_hours"`` or ``"usd"``.
        window: Window length in seconds.
    """

    selector: Mapping[str, str]
    limit: float
    unit: str = "gpu_hours"
    window: float = 30 * 86400.0

    def __post_init__(self):
        if self.unit not in ("gpu_hours", "usd"):
            raise ConfigurationError(f"budget unit must be 'gpu_hours' or 'usd', got {self.unit!r}")
        if not isinstance(self.limit, (int, float)) or isinstance(self.limit, bool) or self.limit < 0:
            raise ConfigurationError(f"budget limit must be a number >= 0, got {self.limit!r}")
        object.__setattr__(self, "selector", {str(k): str(v) for k, v in dict(self.selector).items()})
        object.__setattr__(self, "window", parse_duration(self.window, name="budget window"))

    @classmethod
    def parse(cls, selector: str, text: str) -> "Budget":
        """From ``"team=ml"`` and ``"100 GPU-hours per 30d"`` (or ``"$500 per 7d"``).

        Raises:
            ConfigurationError: the selector or the amount does not parse; names both.
        """
        match = _BUDGET.match(str(text))
        if not match:
            raise ConfigurationError(
                f"budget {selector!r}: {text!r} is not a budget; write e.g. '100 GPU-hours per 30d' or '$500 per 7d'"
            )
        unit = match.group("unit") or ""
        usd = bool(match.group("usd")) or unit.lower().startswith(("usd", "dollar"))
        if not usd and not unit:
            raise ConfigurationError(
                f"budget {selector!r}: {text!r} has no unit; write 'GPU-hours' or a '$' amount, e.g. '100 GPU-hours per 30d'"
            )
        return cls(
            parse_selector(selector),
            float(match.group("amount")),
            "usd" if usd else "gpu_hours",
            parse_duration(match.group("window"), name=f"budget {selector!r} window"),
        )

    @property
    def label(self) -> str:
        """How users wrote it: ``"team=ml: 100 GPU-hours per 30d"``."""
        who = ",".join(f"{k}={v}" for k, v in self.selector.items()) or "*"
        amount = f"${self.limit:g}" if self.unit == "usd" else f"{self.limit:g} GPU-hours"
        return f"{who}: {amount} per {format_duration(self.window)}"

    def matches(self, attributes: Mapping[str, str]) -> bool:
        return all(attributes.get(k) == v for k, v in self.selector.items())

    def amount(self, gpu_seconds: float, cost_usd: float) -> float:
        """Usage expressed in this budget's unit."""
        return cost_usd if self.unit == "usd" else gpu_seconds / 3600.0

    def format_amount(self, value: float) -> str:
        return f"${value:,.2f}" if self.unit == "usd" else f"{value:,.2f} GPU-hours"

    def spent(self, rows, now: float | None = None) -> float:
        """What the ledger ``rows`` (a pyarrow table) spent against this budget in its window."""
        from sparkgpu.usage.ledger import clip_to_window

        now = time.time() if now is None else now
        rows = clip_to_window(_select(rows, self.selector), now - self.window, now)
        if rows.num_rows == 0:
            return 0.0
        import pyarrow.compute as pc

        gpu_seconds = pc.sum(rows["gpu_seconds"]).as_py() or 0.0
        cost = pc.sum(rows["cost_usd"]).as_py() or 0.0
        return self.amount(gpu_seconds, cost)


def parse_selector(text: str) -> dict[str, str]:
    """``"team=ml,project=ctr"`` -> ``{"team": "ml", "project": "ctr"}``; ``"*"`` -> ``{}``."""
    text = str(text).strip()
    if text in ("*", ""):
        return {}
    selector = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigurationError(
                f"budget selector {text!r}: {part.strip()!r} is not key=value; write e.g. 'team=ml' or "
                f"'team=ml,project=ctr', or '*' for every job"
            )
        selector[key.strip()] = value.strip()
    return selector


def _select(rows, selector: Mapping[str, str]):
    import pyarrow.compute as pc

    if rows.num_rows == 0 or not selector:
        return rows
    mask = None
    for key, value in selector.items():
        if key in _COLUMN_KEYS:
            column = rows[key]
        else:
            column = pc.map_lookup(rows["tags"], key, "first")
        hit = pc.fill_null(pc.equal(column, value), False)
        mask = hit if mask is None else pc.and_(mask, hit)
    return rows.filter(mask)


@dataclasses.dataclass(frozen=True)
class UsagePolicy:
    """Limits checked before and during every job; ``None`` / empty means "no limit".

    Attributes:
        name: Shown in every refusal, so users know whose rule they hit.
        allowed_gpu_types: Catalog names jobs may use.
        max_gpus_per_job: Most GPUs (ranks) one job may ask for.
        max_runtime: Most running seconds of one job, summed over its attempts.
        required_tags: Tags every job must carry (for cost attribution).
        budgets: Spending limits per selector.
    """

    name: str = "usage policy"
    allowed_gpu_types: tuple[str, ...] | None = None
    max_gpus_per_job: int | None = None
    max_runtime: float | None = None
    required_tags: tuple[str, ...] = ()
    budgets: tuple[Budget, ...] = ()

    def __post_init__(self):
        if self.allowed_gpu_types is not None:
            types = (self.allowed_gpu_types,) if isinstance(self.allowed_gpu_types, str) else self.allowed_gpu_types
            object.__setattr__(self, "allowed_gpu_types", tuple(lookup_gpu_type(t).name for t in types))
        if self.max_gpus_per_job is not None and (
            isinstance(self.max_gpus_per_job, bool)
            or not isinstance(self.max_gpus_per_job, int)
            or self.max_gpus_per_job < 1
        ):
            raise ConfigurationError(f"max_gpus_per_job must be a positive integer, got {self.max_gpus_per_job!r}")
        object.__setattr__(self, "max_runtime", parse_duration(self.max_runtime, name="max_runtime"))
        tags = (self.required_tags,) if isinstance(self.required_tags, str) else tuple(self.required_tags)
        object.__setattr__(self, "required_tags", tuple(str(t) for t in tags))
        object.__setattr__(self, "budgets", tuple(self.budgets))

    # -- building --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "usage policy") -> "UsagePolicy":
        """Builds a policy from a parsed file.

        Raises:
            ConfigurationError: unknown key, or a value of the wrong kind; the message names the key.
        """
        unknown = sorted(set(data) - set(_POLICY_KEYS))
        if unknown:
            raise ConfigurationError(f"{source}: unknown key(s) {unknown}; a policy has {', '.join(_POLICY_KEYS)}")
        budgets = data.get("budgets") or {}
        if not isinstance(budgets, Mapping):
            raise ConfigurationError(
                f"{source}: 'budgets' must map a selector to a budget, e.g. {{'team=ml': '100 GPU-hours per 30d'}}"
            )
        parsed = []
        for selector, texts in budgets.items():
            for text in texts if isinstance(texts, (list, tuple)) else [texts]:
                parsed.append(Budget.parse(selector, text))
        try:
            return cls(
                name=str(data.get("name") or source),
                allowed_gpu_types=data.get("allowed_gpu_types"),
                max_gpus_per_job=data.get("max_gpus_per_job"),
                max_runtime=data.get("max_runtime"),
                required_tags=data.get("required_tags") or (),
                budgets=tuple(parsed),
            )
        except ConfigurationError as exc:
            raise ConfigurationError(f"{source}: {exc}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "UsagePolicy":
        """Reads a TOML (``.toml``) or YAML policy file.

        Raises:
            ConfigurationError: the file is missing or invalid; the message names it.
        """
        from sparkgpu._util.documents import parse_document

        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigurationError(
                f"cannot read usage policy {str(path)!r} ({exc.strerror}); fix SPARKGPU_USAGE_POLICY or unset it"
            ) from None
        return cls.from_dict(parse_document(text, path, what="usage policy"), source=f"usage policy {str(path)!r}")

    @classmethod
    def load(cls, value: "UsagePolicy | str | Path | Mapping | None") -> "UsagePolicy | None":
        """A policy from an object, a mapping, a file path, or ``None`` for ``SPARKGPU_USAGE_POLICY``."""
        if isinstance(value, UsagePolicy):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        if value is None:
            from sparkgpu.config import settings

            value = settings().usage_policy_path
            if value is None:
                return None
        return cls.from_file(value)

    # -- checking ----------------------------------------------------------------------------
    def budgets_for(self, job: JobSpec, user: str) -> list[Budget]:
        attributes = job_attributes(job, user)
        return [b for b in self.budgets if b.matches(attributes)]

    def launch_violations(self, job: JobSpec, user: str, ledger=None, now: float | None = None) -> list[str]:
        """Every rule ``job`` breaks before it starts, each as a sentence naming the numbers and the fix."""
        problems = []
        gpu_type = job.resources.gpu_type
        if self.allowed_gpu_types is not None and gpu_type not in self.allowed_gpu_types:
            problems.append(
                f"gpu_type {gpu_type!r} is not allowed (allowed: {', '.join(self.allowed_gpu_types)}); "
                f"ask for one of those"
            )
        if self.max_gpus_per_job is not None and job.resources.gpus > self.max_gpus_per_job:
            problems.append(
                f"{job.resources.gpus} GPUs asked for, at most {self.max_gpus_per_job} per job; ask for fewer"
            )
        asked = job.policy.max_runtime
        if self.max_runtime is not None and asked is not None and asked > self.max_runtime:
            problems.append(
                f"max_runtime {format_duration(asked)} exceeds the limit of {format_duration(self.max_runtime)} "
                f"per job; lower max_runtime"
            )
        missing = [t for t in self.required_tags if not job.tags.get(t)]
        if missing:
            example = ", ".join(f"'{t}': '...'" for t in missing)
            flags = " ".join(f"--tag {t}=..." for t in missing)
            problems.append(f"required tag(s) {', '.join(missing)} missing; pass tags={{{example}}} (CLI: {flags})")
        budgets = self.budgets_for(job, user)
        if budgets and ledger is not None:
            now = time.time() if now is None else now
            rows = ledger.read(since=now - max(b.window for b in budgets))
            for budget in budgets:
                spent = budget.spent(rows, now)
                if spent >= budget.limit:
                    problems.append(self.budget_message(budget, spent))
        return problems

    def check_launch(self, job: JobSpec, user: str, ledger=None, now: float | None = None) -> None:
        """Raises when ``job`` may not start.

        Args:
            job: The validated job (gpu_type resolved by the backend).
            user: Who launches it.
            ledger: :class:`~sparkgpu.usage.ledger.UsageLedger` to count budgets against;
                ``None`` skips budgets.
            now: Unix time (for tests).

        Raises:
            PolicyViolationError: naming the policy and every rule broken, with the numbers.
        """
        problems = self.launch_violations(job, user, ledger, now)
        if problems:
            lines = "\n".join(f"  - {p}" for p in problems)
            raise PolicyViolationError(f"job {job.name!r} refused by {self.name!r} before launch:\n{lines}")

    def budget_message(self, budget: Budget, spent: float) -> str:
        return (
            f"budget '{budget.label}' is spent: {budget.format_amount(spent)} of {budget.format_amount(budget.limit)} "
            f"used in the last {format_duration(budget.window)}; wait until older usage leaves the window or ask "
            f"the owner of {self.name!r} for a larger budget"
        )
