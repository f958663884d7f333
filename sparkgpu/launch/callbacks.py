"""The callback interface, importable under the name it had before it left the launcher.

It lives in :mod:`sparkgpu.callbacks`, below both the launcher that calls it and the
integrations that implement it (tracking, metering), so neither imports the other.
"""

from __future__ import annotations

from sparkgpu.callbacks import AttemptOutcome, JobCallback, WorkerContext

__all__ = ["JobCallback", "WorkerContext", "AttemptOutcome"]
