"""A script written for ``databricks.air`` runs here with only its import lines changed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "scripts" / "air_ddp_train.py"
# What porting means: the package name in the import lines, nothing else.
IMPORTS = {
    "from databricks.air.runtime import": "from sparkgpu.runtime import",
    "from databricks.air.exceptions import": "from sparkgpu.errors import",
    "from databricks.air import": "from sparkgpu import",
}


def ported(tmp_path: Path) -> Path:
    original = SCRIPT.read_text().splitlines(keepends=True)
    lines = []
    for line in original:
        for old, new in IMPORTS.items():
            if line.startswith(old):
                line = new + line[len(old) :]
                break
        lines.append(line)
    changed = [new for old, new in zip(original, lines) if old != new]
    assert len(changed) == 3 and all(line.startswith("from sparkgpu") for line in changed)
    path = tmp_path / "train.py"
    path.write_text("".join(lines))
    return path


def test_a_databricks_air_ddp_script_runs_with_only_its_imports_changed_on_two_cpu_ranks(tmp_path):
    # No accelerator type given and no GPU here: num_accelerators=2 runs two CPU ranks with gloo.
    proc = subprocess.run(
        [sys.executable, str(ported(tmp_path))], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.split("REPORT ", 1)[1])

    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world_size"] for r in ranks} == {2}
    assert ranks[0]["weights"] == ranks[1]["weights"]  # DDP averaged the two ranks' gradients
    assert ranks[0]["loss"] != ranks[1]["loss"]  # each rank trained on its own data
    assert ranks[0]["loss"] < 1.0  # and learned y = sum(x)
    assert [r["rank"] for r in report["one_rank"]] == [0] and report["one_rank"][0]["world_size"] == 1
    assert report["num_accelerators"] == [2, 1] and report["func"] == "train"
    assert "timeout" in report["timeout"].lower()
