"""The catalog-style registry on a real SQLite MLflow store: register, load, versions, aliases, lineage."""

from __future__ import annotations

import time

import pytest
import torch

from sparkgpu.errors import CheckpointError, ConfigurationError
from sparkgpu.tracking import registry
from sparkgpu.train import latest_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


class OtherNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.body(x)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    root = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{root}/mlflow.db"
    SqlAlchemyStore(uri, (root / "artifacts").as_uri())
    return uri


@pytest.fixture(autouse=True)
def tracking(store, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.delenv("SPARKGPU_TRACKING_SPOOL", raising=False)
    return store


def unique(prefix: str) -> str:
    return f"main.ml.{prefix}_{time.time_ns()}"


def trained(seed: int) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def test_register_and_load_by_alias_version_and_latest(tmp_path):
    name = unique("ctr")
    x = torch.randn(3, 4)
    first, second = trained(1), trained(2)
    v1 = registry.register(first, name, alias="champion", input_example=x, tags={"team": "ads"})
    v2 = registry.register(second, name, input_example=x)
    assert (v1.version, v2.version, v1.name) == (1, 2, name)
    assert v1.aliases == ("champion",) and v1.tags["team"] == "ads" and v1.tags["sparkgpu.run_id"] == v1.run_id
    assert v2.uri == f"models:/{name}/2"
    assert torch.allclose(registry.load(f"{name}@champion")(x), first(x), atol=1e-6)
    assert torch.allclose(registry.load(f"{name}/2")(x), second(x), atol=1e-6)
    assert torch.allclose(registry.load(name)(x), second(x), atol=1e-6)  # latest
    assert [v.version for v in registry.versions(name)] == [1, 2]
    assert registry.aliases(name) == {"champion": 1}


def test_signature_is_inferred_from_the_input_example(tmp_path):
    import mlflow.artifacts
    from mlflow import MlflowClient
    from mlflow.models import Model

    name = unique("sig")
    version = registry.register(trained(3), name, input_example=torch.randn(5, 4))
    uri = MlflowClient().get_model_version_download_uri(name, version.version)
    signature = Model.load(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path))).signature
    assert signature.inputs.inputs[0].shape == (-1, 4)
    assert signature.outputs.inputs[0].shape == (-1, 2)


def test_a_model_wrapped_for_training_registers_as_the_plain_module(tmp_path):
    """Accelerate's bf16 forward (a Trainer's model with mixed precision) inside DDP registers as the module."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.nn.parallel import DistributedDataParallel as DDP

    name, x, model = unique("wrapped"), torch.randn(3, 4), trained(3)
    expected = model(x).detach()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wrapped = DDP(Accelerator(mixed_precision="bf16", cpu=True).prepare(model))
        version = registry.register(wrapped, name)
    finally:
        dist.destroy_process_group()
        AcceleratorState._reset_state(reset_partial_state=True)
    loaded = registry.load(f"{name}/{version.version}")
    assert type(loaded) is TinyNet and "_original_forward" not in vars(loaded)
    assert torch.equal(loaded(x), expected)


def test_aliases_move_and_tags_are_set(tmp_path):
    name = unique("alias")
    registry.register(trained(1), name, alias="champion")
    registry.register(trained(2), name)
    registry.set_alias(name, "champion", 2)
    registry.set_alias(name, "challenger", 1)
    assert registry.aliases(name) == {"champion": 2, "challenger": 1}
    registry.delete_alias(name, "challenger")
    assert registry.aliases(name) == {"champion": 2}
    registry.set_tags(f"{name}@champion", {"validated": "yes"})
    registry.set_tags(name, {"owner": "ads"})
    assert registry.get_version(f"{name}/2").tags["validated"] == "yes"
    from mlflow import MlflowClient

    assert MlflowClient().get_registered_model(name).tags["owner"] == "ads"


def _save_checkpoint(model, path, key="model"):
    """A plain DCP save: data and ``.metadata``, but no completion marker."""
    import torch.distributed.checkpoint as dcp

    dcp.save({key: model.state_dict()} if key else model.state_dict(), checkpoint_id=str(path))


def _committed_checkpoint(model, directory, step: int) -> str:
    """A checkpoint as a training function leaves it: saved and committed by the Checkpointer."""
    from sparkgpu.train import Checkpointer

    with Checkpointer(directory, async_save=False, handle_sigterm=False) as ckpt:
        ckpt.save(step, model=model, wait=True)
    return latest_checkpoint(directory).path


def test_register_from_a_checkpoint_takes_its_step_from_the_checkpoint_and_lineage_from_the_run(tmp_path):
    from mlflow import MlflowClient

    source = trained(7)
    checkpoint = _committed_checkpoint(source, tmp_path / "checkpoints", step=500)
    client = MlflowClient()
    experiment_id = client.create_experiment(f"lineage-{time.time_ns()}", artifact_location=(tmp_path / "a").as_uri())
    # The run has not heard of the checkpoint yet: its lineage reaches the run a moment later.
    run = client.create_run(experiment_id, tags={"sparkgpu.job_id": "train-42", "sparkgpu.data.version": "12"})
    name = unique("from_ckpt")
    version = registry.register(checkpoint, name, model=TinyNet(), run_id=run.info.run_id)
    x = torch.randn(2, 4)
    assert torch.allclose(registry.load(f"{name}/{version.version}")(x), source(x))
    assert {k: version.tags[k] for k in ("sparkgpu.job_id", "sparkgpu.data.version", "sparkgpu.checkpoint.step")} == {
        "sparkgpu.job_id": "train-42",
        "sparkgpu.data.version": "12",
        "sparkgpu.checkpoint.step": "500",
    }
    assert version.tags["sparkgpu.checkpoint.path"] == checkpoint and version.run_id == run.info.run_id


def test_a_checkpoint_whose_save_did_not_finish_is_refused_before_loading(tmp_path):
    from mlflow import MlflowClient

    name = unique("unfinished")
    partial = tmp_path / "checkpoints" / "step-0000000900"
    _save_checkpoint(trained(3), partial)  # DCP's .metadata is there, the completion marker is not
    with pytest.raises(CheckpointError, match=rf"{partial} has no completion marker.*did not finish"):
        registry.register(str(partial), name, model=TinyNet())
    assert MlflowClient().search_registered_models(f"name='{name}'") == []


def test_a_top_level_checkpoint_loads_too(tmp_path):
    source = trained(8)
    _save_checkpoint(source, tmp_path / "flat", key=None)
    loaded = registry.load_checkpoint_into(TinyNet(), tmp_path / "flat")
    assert torch.equal(loaded.fc.weight, source.fc.weight)


def test_checkpoint_problems_are_clear_and_register_nothing(tmp_path):
    from mlflow import MlflowClient

    name = unique("bad_ckpt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no completion marker"):
        registry.register(str(tmp_path / "empty"), name, model=TinyNet())
    checkpoint = _committed_checkpoint(trained(1), tmp_path / "ckpt", step=3)
    with pytest.raises(CheckpointError, match="model.body.weight"):
        registry.register(checkpoint, name, model=OtherNet())
    with pytest.raises(ConfigurationError, match="model=YourModel()"):
        registry.register(checkpoint, name)
    assert MlflowClient().search_registered_models(f"name='{name}'") == []


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient()
    before = len(client.search_experiments())
    with pytest.raises(ConfigurationError, match="uppercase"):
        registry.register(trained(1), "Main.ML.ctr")
    with pytest.raises(ConfigurationError, match="alias 'latest' is reserved"):
        registry.register(trained(1), unique("x"), alias="latest")
    with pytest.raises(ConfigurationError, match="input_example could not be passed"):
        registry.register(trained(1), unique("x"), input_example=torch.randn(2, 9))
    with pytest.raises(ConfigurationError, match="torch.nn.Module or a checkpoint"):
        registry.register(42, unique("x"))
    assert len(client.search_experiments()) == before


def test_names_with_characters_mlflow_refuses_round_trip(tmp_path):
    name = f"main.ml.ctr:eu_{time.time_ns()}"
    version = registry.register(trained(1), name)
    assert version.name == name
    assert [v.name for v in registry.versions(name)] == [name]


def test_short_names_are_completed_from_settings(tmp_path, monkeypatch):
    import sparkgpu.tracking.names as names

    monkeypatch.setattr(names, "_active_spark_session", lambda: None)  # other tests' sessions stay out
    version = registry.register(trained(1), f"short_{time.time_ns()}")
    assert version.name.startswith("main.default.short_")


def test_unknown_model_says_so(tmp_path):
    with pytest.raises(ConfigurationError, match="has no versions"):
        registry.load(unique("missing"))


def test_inside_a_job_the_model_goes_into_the_jobs_run(tmp_path, store, monkeypatch):
    from mlflow import MlflowClient

    from sparkgpu.tracking.spool import JobRunInfo, SpoolDir

    client = MlflowClient(store)
    experiment_id = client.create_experiment(f"job-{time.time_ns()}", artifact_location=(tmp_path / "a").as_uri())
    run = client.create_run(experiment_id, tags={"sparkgpu.job_id": "job-7"})
    spool = SpoolDir(tmp_path / "tracking")
    spool.write_run_info(
        JobRunInfo(
            run.info.run_id,
            experiment_id,
            "job",
            store,
            store,
            run.info.artifact_uri,
            "job",
            "job-7",
            "me",
            time.time(),
        )
    )
    # What a worker sees: MLflow pointed at the spool, the real store named beside it.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", spool.uri)
    monkeypatch.setenv("SPARKGPU_MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("SPARKGPU_TRACKING_SPOOL", str(spool.path))
    version = registry.register(trained(1), unique("in_job"))
    assert version.run_id == run.info.run_id and version.tags["sparkgpu.job_id"] == "job-7"


@pytest.mark.spark
def test_short_names_are_completed_from_the_active_spark_session(spark):
    from sparkgpu.tracking.names import parse_model_name

    spark.sql("CREATE DATABASE IF NOT EXISTS registry_feats")
    spark.catalog.setCurrentDatabase("registry_feats")
    try:
        name = parse_model_name("ctr")
        assert str(name) == f"{spark.catalog.currentCatalog()}.registry_feats.ctr"
        assert name.completed_from == "spark session"
    finally:
        spark.catalog.setCurrentDatabase("default")
