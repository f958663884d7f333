import pytest

from sparkgpu import ConfigurationError, distributed, runtime
from sparkgpu.launch.backends.local.backend import LocalBackend
from sparkgpu.launch.node.hardware import HostGPUs


def test_bare_decorator_and_num_gpus_alias():
    @distributed
    def a():
        return 1

    @distributed(num_gpus=3, gpu_type="cpu")
    def b():
        return 2

    assert a.resources.gpus == 1 and b.resources.gpus == 3
    assert a.__name__ == "a" and "gpus=3" in repr(b)


def test_positional_settings_are_databricks_airs_four():
    job = distributed(8, "GPU_8xH100", True, "2h")(lambda: 0)
    assert (job.num_accelerators, job.accelerator_type, job.resources.remote, job.policy.timeout) == (
        8,
        "GPU_8xH100",
        True,
        7200.0,
    )
    with pytest.raises(ConfigurationError, match="positive integer"):
        distributed("H100")


def test_bad_settings_fail_at_decoration_time():
    with pytest.raises(ConfigurationError, match="unknown gpu_type 'T4'"):
        distributed(gpus=1, gpu_type="T4")
    with pytest.raises(ConfigurationError, match="disagree"):
        distributed(gpus=1, num_gpus=2)
    with pytest.raises(ConfigurationError, match="log_ranks"):
        distributed(gpus=1, log_ranks="some")


def test_plain_call_is_rank_zero_of_a_world_of_one():
    @distributed(gpus=4, gpu_type="cpu")
    def step(x):
        import torch
        import torch.distributed as dist

        t = torch.tensor([x * (runtime.get_global_rank() + 1)])
        dist.all_reduce(t)
        return t.item(), runtime.get_world_size(), runtime.is_main_process()

    assert step(10) == (10, 1, True)
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_dryrun_validates_and_prints_the_plan_without_starting_anything(_isolated_sparkgpu_home):
    @distributed(gpus=2, gpu_type="A10", backend=LocalBackend(host_gpus=HostGPUs(("NVIDIA A10G",) * 2, ("0", "1"))))
    def train(lr):
        return lr

    plan = train.dryrun(1e-3)
    text = str(plan)
    assert "ranks_per_node=2" in text and "devices=['0', '1']" in text
    assert "sparkgpu.launch.node.agent" in text
    assert not (_isolated_sparkgpu_home / "runs").exists()


def _rank_results():
    return {"rank": runtime.get_global_rank(), "loss": 0.25}


def _rank_models():
    import torch

    return torch.nn.Linear(2, 1) if runtime.is_main_process() else runtime.get_global_rank()


@pytest.mark.integration  # real ranks
def test_a_failed_registration_keeps_the_jobs_results_reachable():
    # Real ranks: the job succeeds, only registering rank 0's value (not a module) fails.
    job = distributed(gpus=2, gpu_type="cpu", register_as="main.ml.ctr")(_rank_results)
    with pytest.raises(ConfigurationError, match="must be a torch.nn.Module") as err:
        job.distributed()
    expected = [{"rank": 0, "loss": 0.25}, {"rank": 1, "loss": 0.25}]
    assert err.value.results == expected
    assert job.last_results == expected and job.last_model_version is None
    assert any(job.last_job_id in note and ".last_results" in note for note in err.value.__notes__)


@pytest.mark.integration  # real ranks
def test_a_registry_that_fails_keeps_the_jobs_results_reachable(monkeypatch, tmp_path):
    (tmp_path / "not-a-dir").write_text("a file where the registry's folder should be")
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", f"sqlite:///{tmp_path}/not-a-dir/registry.db")
    job = distributed(gpus=2, gpu_type="cpu", register_as="main.ml.ctr")(_rank_models)
    with pytest.raises(OSError) as err:
        job.distributed()
    import torch

    assert err.value.results[1] == 1 and isinstance(err.value.results[0], torch.nn.Linear)
    assert job.last_results is err.value.results


def test_detach_true_with_a_backend_no_other_process_can_rebuild_is_refused_before_anything_is_written(
    _isolated_sparkgpu_home,
):
    from sparkgpu.config import settings
    from sparkgpu.launch.backends.spark.backend import SparkBackend

    with pytest.raises(ConfigurationError, match=r"cannot be: .*backend=.local."):
        distributed(gpus=1, gpu_type="cpu", backend=LocalBackend(), detach=True)(sum).submit([1])
    classic = SparkBackend(object())  # a classic SparkSession: its driver is this process
    with pytest.raises(ConfigurationError, match=r"classic SparkSession .*SparkSession.builder.remote"):
        distributed(gpus=1, gpu_type="A10", remote=True, backend=classic, detach=True)(sum).submit([1])
    # submit() without detach= keeps such jobs supervised here, as before
    assert not distributed(gpus=1, gpu_type="A10", remote=True, backend=classic)(sum).submit_detaches
    assert not list(settings().staging_root.glob("*"))  # nothing was written for the refused ones
