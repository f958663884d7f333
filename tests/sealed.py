"""Reading the control files a job sealed under its key (sparkgpu.rundir.control), as the client does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout


def sealed_json(path: str | Path) -> Any:
    """The JSON body of a sealed control file of a job staged on this machine, verified with the
    job's key from this user's keyring; fails the test when it does not verify."""
    path = Path(path)
    run_dir = next(p for p in path.parents if (p / RunLayout.SPEC).exists())
    body = RunDir(run_dir).read_control(path)
    assert body is not None, f"{path} is not sealed with its job's key"
    return json.loads(body)
