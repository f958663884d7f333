"""Without any tracking code, a job gets one MLflow run and can register its model."""

import pytest

from sparkgpu import distributed, runtime

pytestmark = pytest.mark.integration


def test_every_job_is_tracked_and_registers_its_model_by_default(monkeypatch, _isolated_sparkgpu_home):
    import mlflow
    import torch

    from sparkgpu import registry
    from sparkgpu.config import reset_settings
    from sparkgpu.tracking import resolve_target

    monkeypatch.setenv("SPARKGPU_TRACKING", "1")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    reset_settings()

    @distributed(gpus=2, gpu_type="cpu", experiment="/team/default-tracking", register_as="main.ml.tiny")
    def train():
        import sparkgpu

        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            loss = model(torch.ones(2, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sparkgpu.log({"loss": loss.item()}, step=step)
        return model if runtime.is_main_process() else None

    trained = train.distributed()[0]
    # A client of its own: mlflow.set_tracking_uri would leak into later tests of this process.
    client = mlflow.MlflowClient(resolve_target().tracking_uri)
    experiment = client.get_experiment_by_name("/team/default-tracking")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 3
    assert train.last_model_version.run_id == run.info.run_id
    loaded = registry.load("main.ml.tiny/1")
    x = torch.randn(5, 4)
    assert torch.allclose(loaded(x), trained(x))
