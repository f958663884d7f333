"""The rate card: dollars per GPU-hour for each GPU type, and per-second billing.

Billing is per second of an attempt's running time: an attempt that ran 61.2 s on 8 GPUs
is billed ``8 * 62`` GPU-seconds (each attempt is rounded up to the next whole second,
as per-second cloud billing does). Idle time between attempts and before a job starts is
never billed, because only attempts produce rows.

The defaults are public on-demand list prices of one GPU of each type (an 8-GPU instance
divided by 8), rounded; replace them with your contract's prices through
``SPARKGPU_USAGE_RATES`` or an explicit :class:`RateCard`. CPU ranks (``gpu_type="cpu"``,
the laptop and CI path) are rated 0: they use no accelerator.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Mapping

from sparkgpu.spec.catalog import lookup_gpu_type
from sparkgpu.errors import ConfigurationError

__all__ = ["DEFAULT_RATES", "RateCard", "billed_seconds"]

DEFAULT_RATES: dict[str, float] = {
    "A10": 1.10,
    "L4": 0.80,
    "A100-40GB": 4.10,
    "A100-80GB": 5.12,
    "H100": 6.88,
    "H200": 7.91,
    "B200": 11.25,
    "B300": 14.10,
    "cpu": 0.0,
}


def billed_seconds(started_at: float, ended_at: float) -> int:
    """Whole seconds billed for one attempt: its running time rounded up, never negative."""
    return max(0, math.ceil(round(ended_at - started_at, 6)))


@dataclasses.dataclass(frozen=True)
class RateCard:
    """Dollars per GPU-hour for each GPU type.

    Attributes:
        rates: Canonical GPU type name -> $ per GPU-hour.
        default: Rate of a type missing from ``rates`` (e.g. ``"gpu"``, an unrecognised local
            card); 0 unless set, and every ledger row records the rate it was priced at.
    """

    rates: Mapping[str, float] = dataclasses.field(default_factory=lambda: dict(DEFAULT_RATES))
    default: float = 0.0

    def __post_init__(self):
        clean: dict[str, float] = {}
        for name, rate in dict(self.rates).items():
            clean[_canonical(name)] = _rate(rate, name)
        object.__setattr__(self, "rates", clean)
        object.__setattr__(self, "default", _rate(self.default, "default"))

    def rate(self, gpu_type: str | None) -> float:
        """$ per GPU-hour of ``gpu_type``."""
        return self.rates.get(_canonical(gpu_type or ""), self.default)

    def cost(self, gpu_type: str | None, gpu_seconds: float) -> float:
        """Dollars for ``gpu_seconds`` of ``gpu_type``, rounded to a hundredth of a cent."""
        return round(self.rate(gpu_type) * gpu_seconds / 3600.0, 4)

    def to_dict(self) -> dict:
        return {"rates": dict(self.rates), "default": self.default}

    @classmethod
    def parse(cls, value: str | os.PathLike | Mapping | None) -> "RateCard":
        """Builds a card from ``None`` (defaults), a mapping, a TOML/YAML/JSON file or ``"H100=6.5,A10=1.2"``.

        Types the value leaves out keep their default rate. A file may hold the rates at its
        top level or under a ``rates`` key, with an optional ``default``.

        Raises:
            ConfigurationError: unreadable file, unknown key or a rate that is not a number >= 0.
        """
        if value is None:
            return cls()
        if isinstance(value, RateCard):
            return value
        if isinstance(value, Mapping):
            data = dict(value)
        elif isinstance(value, os.PathLike) or (isinstance(value, str) and "=" not in value):
            data = _read_file(Path(value))
        elif isinstance(value, str):
            data = {}
            for item in filter(None, (part.strip() for part in value.split(","))):
                name, sep, rate = item.partition("=")
                if not sep:
                    raise ConfigurationError(
                        f"rate card entry {item!r} is not TYPE=DOLLARS_PER_GPU_HOUR, e.g. 'H100=6.5,A10=1.2'"
                    )
                data[name.strip()] = rate.strip()
        else:
            raise ConfigurationError(f"a rate card is a mapping, a file path or 'H100=6.5,A10=1.2', got {value!r}")
        default = data.pop("default", 0.0)
        rates = data.pop("rates", None)
        if rates is not None:
            if data:
                raise ConfigurationError(f"rate card has unknown keys {sorted(data)}; put every rate under 'rates'")
            data = dict(rates)
        return cls({**DEFAULT_RATES, **data}, default=default)


def _canonical(name: str) -> str:
    try:
        return lookup_gpu_type(name).name
    except ConfigurationError:
        return name  # types outside the catalog ("gpu") may still be priced explicitly


def _rate(value, name) -> float:
    try:
        rate = float(value)
    except (TypeError, ValueError):
        rate = -1.0
    if isinstance(value, bool) or not math.isfinite(rate) or rate < 0:
        raise ConfigurationError(f"rate for {name!r} must be dollars per GPU-hour (a number >= 0), got {value!r}")
    return rate


def _read_file(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read rate card {str(path)!r} ({exc.strerror}); set SPARKGPU_USAGE_RATES to a TOML/YAML file "
            f"or to an inline card such as 'H100=6.5,A10=1.2'"
        ) from None
    from sparkgpu._util.documents import parse_document

    return parse_document(text, path, what="rate card")
