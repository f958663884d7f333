"""examples/finetune_llm.py end to end, as a user runs it: the whole fine-tuning journey in one process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "finetune_llm.py"


def test_the_finetuning_example_resumes_by_itself_registers_and_answers_held_out_questions(tmp_path):
    env = {**os.environ, "SPARKGPU_TRACKING": "1", "PYTHONUNBUFFERED": "1"}
    run = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    # Rank 1 died at step 24; the sealed step-20 checkpoint and the loader's position were used.
    assert "attempt 0 failed (killed: the process was killed by SIGKILL); restarting from step 20" in out, out[-6000:]
    assert "the Trainer resumes from step 20" in out
    assert "the loader resumes at its saved position: no batch is replayed" in out
    assert re.search(r"registered main\.demo\.chat version \d+ \(PeftModel\), alias champion", out)
    # The adapter, loaded back by alias on the executors, learned the colors it was taught.
    correct, asked = map(int, re.search(r"right color: (\d+) of (\d+)", out).groups())
    assert asked == 8 and correct >= 6, out[-3000:]
