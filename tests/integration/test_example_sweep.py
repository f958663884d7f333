"""examples/sweep_lora.py end to end, as a user runs it: a LoRA fine-tune with a plain Trainer tuned
by a sweep, its reports from the Trainer's evaluations, the best adapter registered."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sweep_lora.py"


def test_the_lora_sweep_example_prunes_through_the_trainers_evaluations_and_registers_the_best_adapter(tmp_path):
    env = {**os.environ, "SPARKGPU_TRACKING": "1", "PYTHONUNBUFFERED": "1"}
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--trials", "2", "--concurrent", "2", "--steps", "4"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    trials = re.findall(r"trial (\d): (\w+)\s+lr=\S+ r=(\d) loss=(\S+)", out)
    assert [number for number, *_ in trials] == ["0", "1"], out[-3000:]
    # Both trials ran their 2 ranks to an evaluation: none failed, and each has a loss.
    assert {state for _, state, _, _ in trials} <= {"COMPLETE", "PRUNED"}, trials
    assert all(loss != "-" for *_, loss in trials), trials
    # Which trial successive halving prunes depends on which reaches a rung first; at least one
    # completes, and the best value is the best completed trial's.
    completed = [float(loss) for _, state, _, loss in trials if state == "COMPLETE"]
    assert completed, trials
    best = re.search(r"best: lr=\S+ r=(\d) eval_loss=(\S+)", out)
    assert best and float(best.group(2)) == pytest.approx(min(completed), abs=1e-3), out[-3000:]
    assert re.search(r"registered main\.demo\.lora_sweep version \d+ \(PeftModel\)", out), out[-3000:]
