"""The rank's patch of transformers' Trainer: applied on import, and only then; a missing stack names the extra."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sparkgpu.errors import MissingDependencyError

CHECK = """
import sys
{install}
from transformers import Trainer
from trl import SFTTrainer
print(
    getattr(Trainer.train, "_sparkgpu_resumes", False),
    getattr(SFTTrainer.train, "_sparkgpu_resumes", False),
    getattr(SFTTrainer.__init__, "_sparkgpu_takes_loaders", False),
)
"""


def _run(install: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", CHECK.format(install=install)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[-3:]


def test_the_trainer_is_patched_when_the_users_code_imports_it():
    # Installing imports nothing of transformers; the import of transformers.trainer then patches it.
    install = "from sparkgpu.hf import autopatch; autopatch.install(); assert 'transformers' not in sys.modules"
    assert _run(install) == ["True", "True", "True"]  # SFTTrainer also takes a loader as it is


def test_without_the_hook_the_trainer_is_plain_transformers():
    assert _run("") == ["False", "False", "False"]


def test_a_missing_transformers_names_the_extra(monkeypatch):
    from sparkgpu.hf._requirements import require_transformers

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'sparkgpu\[hf\]'"):
        require_transformers("sparkgpu.hf")


ARGUMENTS = """
from sparkgpu.hf import autopatch
autopatch.install()
from transformers import TrainingArguments
args = TrainingArguments(output_dir="out", bf16=True, report_to="none")
print(args.use_cpu)
"""


def test_arguments_written_for_gpus_use_the_cpu_on_a_cpu_rank(tmp_path):
    # TRL's configs turn bf16 on; without use_cpu, TrainingArguments refuses that on a host without a GPU.
    env = {**os.environ, "SPARKGPU_JOB_ID": "job-1", "ACCELERATE_USE_CPU": "true", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-c", ARGUMENTS], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "True"


GPU_WORLD_ARGUMENTS = """
import logging
logging.basicConfig(level=logging.WARNING)
from sparkgpu.hf import autopatch
autopatch.install()
from transformers import TrainingArguments
zero3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}
args = TrainingArguments(output_dir="out", report_to="none", fsdp="full_shard", deepspeed=zero3)
print(args.deepspeed, args.use_cpu)
"""


def test_fsdp_and_deepspeed_written_for_gpus_are_said_to_be_ignored_on_a_cpu_rank(tmp_path):
    # Accelerate trains CPU ranks as DDP whatever these say; a DeepSpeed configuration would
    # also need DeepSpeed installed (it is not here) only to be unused.
    env = {**os.environ, "SPARKGPU_JOB_ID": "job-1", "ACCELERATE_USE_CPU": "true", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-c", GPU_WORLD_ARGUMENTS], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["None", "True"]
    assert "fsdp='full_shard' is ignored on CPU ranks" in out.stderr
    assert "deepspeed= is ignored on CPU ranks: Accelerate trains them as plain DDP" in out.stderr
