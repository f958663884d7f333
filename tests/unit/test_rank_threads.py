"""A rank's thread counts: set by its launcher, applied by the rank, the user's own values kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sparkgpu.launch.rank.threads import rank_thread_env, threads_per_rank


def test_the_hosts_cores_are_shared_out_between_its_ranks():
    assert threads_per_rank(2, cpus=2) == 1
    assert threads_per_rank(4, cpus=16) == 4
    assert threads_per_rank(3, cpus=2) == 1  # at least one
    assert threads_per_rank(1, cpus=8) == 8


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"}),
        ({"OMP_NUM_THREADS": "5"}, {"OMP_NUM_THREADS": "5", "MKL_NUM_THREADS": "5"}),
        ({"OMP_NUM_THREADS": "5", "MKL_NUM_THREADS": "2"}, {"OMP_NUM_THREADS": "5", "MKL_NUM_THREADS": "2"}),
    ],
    ids=["launcher", "user-omp", "user-both"],
)
def test_what_the_user_set_is_what_every_attempt_gets(environ, expected):
    assert rank_thread_env(environ, 3) == expected


# As a zygote does: torch imported with no thread variables, the job's set afterwards, then pinned.
_FORKED_RANK = """
import json, os, sys
import torch
before = torch.get_num_threads()
os.environ.update(json.loads(sys.argv[1]))
from sparkgpu.launch.rank.threads import pin_rank_threads
pinned = pin_rank_threads()
print(json.dumps([before, pinned, torch.get_num_threads(), torch.get_num_interop_threads()]))
"""


def _rank(variables: dict) -> list:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", _FORKED_RANK, json.dumps(variables)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_rank_whose_torch_was_imported_first_still_runs_with_the_jobs_threads():
    before, pinned, intra, interop = _rank({"OMP_NUM_THREADS": "1"})
    assert pinned == [1, 1] and (intra, interop) == (1, 1)
    if (os.cpu_count() or 1) > 1:  # what the zygote's ranks ran with before they pinned: torch's default
        assert before > 1


def test_a_rank_started_by_hand_keeps_torchs_defaults():
    before, pinned, intra, _ = _rank({})
    assert pinned is None and intra == before
