"""Signed checkpoints through a real 2-rank job and a real S3-protocol server.

A writer of the job's checkpoint directory plants checkpoints between attempts: one with a
higher step and a marker whose MAC does not match, one with an unsigned marker, and it changes
a file of the newest genuine checkpoint. Each carries a payload that creates a file when
unpickled. The restarted attempt resumes from the newest genuine checkpoint, and the file
never appears.
"""

from __future__ import annotations

import json
import pickle

import blake3
import pytest
import torch

from sparkgpu.errors import CheckpointError
from sparkgpu.train.checkpoint_directory import MARKER_NAME
from tests.unit.test_checkpoint_signing import JOB, _Planted, rank_of_job, restore, save_steps

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

STEPS, KILL_AT = 8, 5


def _plant(directory: str, sentinel: str) -> None:
    """What a writer of the checkpoint directory can do: the job saved steps 1, 3 and 5."""
    import shutil
    from pathlib import Path

    root = Path(directory)
    payload = pickle.dumps(_Planted(sentinel))
    (root / "step-0000000005" / ".metadata").write_bytes(payload)  # a genuine marker, a changed file
    for step, keep_mac in ((99, True), (98, False)):
        planted = root / f"step-{step:010d}"
        shutil.copytree(root / "step-0000000003", planted)
        marker = json.loads((planted / MARKER_NAME).read_text())
        marker["step"] = step  # its MAC no longer matches
        if not keep_mac:
            marker.pop("mac")
            marker.pop("signed")
        (planted / MARKER_NAME).write_text(json.dumps(marker))
        (planted / ".metadata").write_bytes(payload)


def _train_and_plant(sentinel: str):
    import os
    import signal

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparkgpu import runtime
    from sparkgpu.train import Checkpointer

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = Checkpointer(every_steps=2, keep_last=None)  # the job's checkpoint directory
    step = start = ckpt.restore(model=model, optimizer=opt)
    while step < STEPS:
        loss = (model(torch.ones(3, 4) / (step + 1)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.maybe_save(step, model=model, optimizer=opt)
        if runtime.attempt() == 0 and step == KILL_AT:
            ckpt.wait()  # steps 1, 3 and 5 are committed
            if runtime.get_global_rank() == 0:
                marker = json.loads(open(f"{runtime.checkpoint_dir()}/step-0000000005/{MARKER_NAME}").read())
                assert "mac" in marker, "a rank of a job signs its checkpoints"
                _plant(runtime.checkpoint_dir(), sentinel)
            dist.barrier()
            if runtime.get_global_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        step += 1
    ckpt.close()
    return start


def test_a_restarted_job_resumes_from_its_newest_genuine_checkpoint_and_runs_no_planted_code(tmp_path):
    from sparkgpu import distributed
    from sparkgpu.config import settings

    sentinel = tmp_path / "pwned"
    job = distributed(gpus=2, gpu_type="cpu", max_restarts=1)(_train_and_plant)
    starts = job.distributed(str(sentinel))
    assert starts == [4, 4], "both ranks resume after step 3: 99 and 98 are forged, 5 was changed"
    assert not sentinel.exists(), "a planted checkpoint's code ran"
    state = json.loads((settings().staging_root / job.last_job_id / "state.json").read_text())
    assert [a["status"] for a in state["attempts"]] == ["failed", "succeeded"]


def test_signed_checkpoints_on_s3(s3_bucket, tmp_path):
    import fsspec

    directory = f"{s3_bucket}/{JOB}/checkpoints"
    sentinel = tmp_path / "pwned"
    fs, root = fsspec.core.url_to_fs(directory)
    with rank_of_job(directory):
        save_steps(directory, [1, 3])
        marker = json.loads(fs.cat_file(f"{root}/step-0000000003/{MARKER_NAME}"))
        assert marker["signed"]["files"], marker  # the step's files are signed, and each is checked below
        for name, entry in marker["signed"]["files"].items():
            assert (
                "blake3:" + blake3.blake3(fs.cat_file(f"{root}/step-0000000003/{name}")).hexdigest() == entry["digest"]
            )

        fs.pipe_file(f"{root}/step-0000000003/.metadata", pickle.dumps(_Planted(sentinel)))
        assert restore(directory)[0] == 2
        with pytest.raises(CheckpointError, match=r"\.metadata differs from its signed hash"):
            restore(directory, step=3)
    assert not sentinel.exists()
