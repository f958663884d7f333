"""The worker's end of a preempted attempt, on real processes: a save still in flight when the
training function calls ``runtime.stop_for_restart()`` is committed before the rank reports
itself preempted, so the next attempt resumes from it."""

from __future__ import annotations

import pytest

from sparkgpu import distributed, runtime

pytestmark = pytest.mark.integration


def save_asynchronously_then_stop(megabytes: int):
    import torch

    from sparkgpu.train import Checkpointer

    # Large enough that the background write is still running when the rank stops.
    model = torch.nn.Linear(megabytes * 1024 * 256 // 64, 64, bias=False)
    ckpt = Checkpointer(keep_last=None)
    start = ckpt.restore(model=model)
    if runtime.attempt() == 0:
        with torch.no_grad():
            model.weight.fill_(7.0)
        ckpt.save(41, model=model)  # asynchronous: returns once the state is staged
        runtime.stop_for_restart()
    return start, runtime.attempt(), model.weight[0, 0].item()


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_save_in_flight_at_stop_for_restart_is_resumed_from(ranks):
    job = distributed(gpus=ranks, gpu_type="cpu", timeout=300)(save_asynchronously_then_stop)
    assert job.distributed(64) == [(42, 1, 7.0)] * ranks
