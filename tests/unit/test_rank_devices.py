"""The device variables each rank gets: torchrun's, where LOCAL_RANK indexes the node's devices."""

import os

import pytest

from sparkgpu.launch.rank.entrypoint import rank_device_env


def _spec(devices=(), simulated=False, gpu_type="H100"):
    return {"devices": list(devices), "simulated": simulated, "resources": {"gpu_type": gpu_type}}


@pytest.mark.parametrize("local_rank", [0, 1, 2, 3])
def test_every_rank_sees_the_nodes_devices_and_local_rank_indexes_them(local_rank):
    env = rank_device_env(_spec(["2", "3", "5", "7"]), local_rank, None)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3,5,7" == env["SPARKGPU_NODE_DEVICES"]
    # torch.cuda.set_device(int(os.environ["LOCAL_RANK"])) selects the rank's own device:
    assert env["CUDA_VISIBLE_DEVICES"].split(",")[local_rank] == env["SPARKGPU_GPU_ADDRESS"]
    assert env["SPARKGPU_GPU_ADDRESS"] == ["2", "3", "5", "7"][local_rank]


def test_a_spark_tasks_addresses_take_precedence_over_the_spec():
    env = rank_device_env(_spec(["0", "1"]), 1, "4,6")
    assert env["CUDA_VISIBLE_DEVICES"] == "4,6" and env["SPARKGPU_GPU_ADDRESS"] == "6"


def test_simulated_gpus_hide_real_ones_but_keep_the_addresses():
    env = rank_device_env(_spec(["0", "1"], simulated=True), 1, None)
    assert env == {
        "SPARKGPU_NODE_DEVICES": "0,1",
        "SPARKGPU_GPU_ADDRESS": "1",
        "SPARKGPU_SIMULATED_GPUS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "ACCELERATE_USE_CPU": "true",
    }


def test_cpu_ranks_see_no_gpu_and_accelerate_joins_them_on_cpu():
    # Without ACCELERATE_USE_CPU, Accelerate (and a Trainer) on a CPU rank is process 0 of a world of one.
    assert rank_device_env(_spec(gpu_type="cpu"), 1, None) == {"CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "true"}


def test_gpu_ranks_leave_accelerate_to_pick_cuda_local_rank():
    assert "ACCELERATE_USE_CPU" not in rank_device_env(_spec(["0", "1"]), 1, None)


def test_a_users_own_accelerate_setting_wins(monkeypatch):
    from sparkgpu.launch.rank import entrypoint

    monkeypatch.setenv("ACCELERATE_USE_CPU", "false")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    entrypoint._set_device_env(rank_device_env(_spec(gpu_type="cpu"), 0, None))
    assert (os.environ["ACCELERATE_USE_CPU"], os.environ["CUDA_VISIBLE_DEVICES"]) == ("false", "")


def test_accelerate_sees_the_job_world_on_cpu_ranks(monkeypatch):
    """What Accelerate 1.x makes of a CPU rank's variables (no process group is started)."""
    from accelerate.state import PartialState

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name, value in rank_device_env(_spec(gpu_type="cpu"), 1, None).items():
        monkeypatch.setenv(name, value)
    from accelerate.utils import DistributedType, parse_flag_from_env

    cpu = parse_flag_from_env("ACCELERATE_USE_CPU")  # what Accelerator() and TrainingArguments read
    backend, kind = PartialState._prepare_backend(PartialState.__new__(PartialState), cpu)
    assert cpu and (backend, kind) == ("gloo", DistributedType.MULTI_CPU)
