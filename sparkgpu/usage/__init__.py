"""Usage metering, cost attribution and usage policies.

Every attempt of a job becomes a row in a Delta table (the ledger) with its GPU-seconds and
cost; policies limit GPU types, GPU counts, runtime, tags and budgets, before launch and
while the job runs; reports group the ledger by team, user, GPU type or day.

Names are imported lazily so ``import sparkgpu.usage`` costs nothing until used.
"""

from __future__ import annotations

from sparkgpu._util.modules import lazy_attributes

__all__ = [
    "UsageMeter",
    "enforce_policy",
    "enforce_pool_policy",
    "UsagePolicy",
    "Budget",
    "RateCard",
    "DEFAULT_RATES",
    "UsageLedger",
    "UsageRecord",
    "usage_table",
    "usage_dataframe",
]

_LAZY = {
    "UsageMeter": "sparkgpu.usage.meter",
    "enforce_policy": "sparkgpu.usage.meter",
    "enforce_pool_policy": "sparkgpu.usage.meter",
    "UsagePolicy": "sparkgpu.usage.policy",
    "Budget": "sparkgpu.usage.policy",
    "RateCard": "sparkgpu.usage.rates",
    "DEFAULT_RATES": "sparkgpu.usage.rates",
    "UsageLedger": "sparkgpu.usage.ledger",
    "UsageRecord": "sparkgpu.usage.ledger",
    "usage_table": "sparkgpu.usage.report",
    "usage_dataframe": "sparkgpu.usage.report",
}


__getattr__ = lazy_attributes(__name__, {name: (module, name) for name, module in _LAZY.items()})
