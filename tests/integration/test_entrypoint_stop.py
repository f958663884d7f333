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


def test_a_rank_leaves_its_objects_to_the_os_once_its_outcome_is_written(tmp_path):
    # The interpreter's exit collections would walk every object of a rank that trained; they
    # are frozen out of the collector's sight, so the rank ends (and its node hears so) sooner.
    seen = tmp_path / "at-exit"

    @distributed(gpus=2, gpu_type="cpu")
    def train_then_return(path: str):
        import atexit
        import gc
        import os
        import weakref

        import torch

        class Cycle:
            pass

        model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(32, 4, batch_first=True), 2)
        model(torch.randn(2, 8, 32)).sum().backward()
        garbage = Cycle()
        garbage.itself = garbage
        gone = weakref.ref(garbage)
        del garbage
        gc.collect()
        where = f"{path}-{os.environ['RANK']}"
        atexit.register(lambda: open(where, "w").write(str(gc.get_freeze_count())))
        # A forked rank starts with its agent's import-time objects frozen (never the user's).
        return gc.get_freeze_count(), gone() is None, sum(1 for o in gc.get_objects() if o is model)

    results = train_then_return.distributed(str(seen))
    assert len(results) == 2, results  # one answer per rank
    for rank, (frozen_while_running, cycle_collected, model_tracked) in enumerate(results):
        assert cycle_collected and model_tracked == 1  # the user's objects are the collector's while it runs
        # By exit, the model's and everything else the rank made are frozen too.
        assert int(open(f"{seen}-{rank}").read()) > frozen_while_running
