"""A catalog-style model registry: ``catalog.schema.model`` names, versions, aliases, lineage.

Backed by MLflow's model registry: the embedded SQLite store by default, or whatever
``registry_uri`` / ``MLFLOW_REGISTRY_URI`` names. A Unity Catalog registry (``databricks-uc``,
``uc:...``) takes the three-level names as they are; MLflow's own registry stores the same
dotted name (see :func:`sparkgpu.tracking.names.encode_for_store`).

Example::

    from sparkgpu.tracking import registry
    v = registry.register(model, "main.ml.ctr", alias="champion", input_example=x[:4])
    model = registry.load("main.ml.ctr@champion")      # or "main.ml.ctr/3", or "ctr@champion"
    registry.register("/runs/job/checkpoints/step-900", "main.ml.ctr", model=CTRNet())

A Hugging Face model registers as MLflow's ``transformers`` flavour: give ``{"model": model,
"tokenizer": tokenizer}`` (a ``PeftModel`` registers its adapter with its base model named, or
merged with ``merge=True``); :func:`load` gives the same dict back::

    registry.register({"model": peft_model, "tokenizer": tok}, "main.ml.chat", alias="champion")
    loaded = registry.load("main.ml.chat@champion")
    loaded["model"].generate(**loaded["tokenizer"]("Hi", return_tensors="pt"))

Every model version carries lineage tags: ``sparkgpu.run_id``, ``sparkgpu.job_id``,
``sparkgpu.checkpoint.path`` and ``sparkgpu.checkpoint.step``, ``sparkgpu.data.source`` and
``sparkgpu.data.version`` (whichever are known).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import tempfile
from typing import TYPE_CHECKING

from sparkgpu._util.modules import imported
from sparkgpu.errors import ConfigurationError
from sparkgpu.train.trained_models import unwrap_model, unwrap_models
from sparkgpu.tracking._checkpoints import committed_checkpoint, load_checkpoint_into
from sparkgpu.tracking._permissions import translate_permission_errors
from sparkgpu.tracking._transformers import is_transformers_model
from sparkgpu.tracking.names import (
    ModelName,
    decode_from_store,
    encode_for_store,
    parse_model_name,
    parse_model_ref,
    validate_alias,
)
from sparkgpu.tracking.target import TrackingTarget, default_experiment_name, ensure_experiment, resolve_target

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion

__all__ = [
    "ModelVersionInfo",
    "is_transformers_model",
    "register",
    "load",
    "get_version",
    "versions",
    "aliases",
    "set_alias",
    "delete_alias",
    "set_tags",
    "load_checkpoint_into",
]

_logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelVersionInfo:
    """One registered model version.

    Attributes:
        name: Three-level name, ``catalog.schema.model``.
        version: Version number, from 1.
        aliases: Aliases pointing at this version.
        tags: The version's tags, lineage included.
        run_id: MLflow run that produced it, if any.
        source: Where its files are stored.
    """

    name: str
    version: int
    aliases: tuple[str, ...]
    tags: dict
    run_id: str | None
    source: str

    @property
    def uri(self) -> str:
        """``models:/<name>/<version>``, loadable with :func:`load`."""
        return f"models:/{self.name}/{self.version}"

    def __int__(self) -> int:
        return self.version


class _Registry:
    """An MLflow client on one registry, with the refusal messages that name permissions."""

    def __init__(self, tracking_uri=None, registry_uri=None):
        from mlflow import MlflowClient

        self.target: TrackingTarget = resolve_target(tracking_uri, registry_uri)
        self.client = MlflowClient(self.target.tracking_uri, self.target.registry_uri)

    def stored(self, name: ModelName) -> str:
        return encode_for_store(name, self.target.is_unity_catalog)

    def guard(self, doing: str, needs: str):
        return translate_permission_errors(doing, needs, self.target.registry_uri)

    def info(self, mv) -> ModelVersionInfo:
        return ModelVersionInfo(
            name=decode_from_store(mv.name) if not self.target.is_unity_catalog else mv.name,
            version=int(mv.version),
            aliases=tuple(getattr(mv, "aliases", ()) or ()),
            tags=dict(mv.tags or {}),
            run_id=mv.run_id or None,
            source=mv.source,
        )

    def resolve(self, ref) -> tuple[str, ModelVersion]:
        stored = self.stored(ref.name)
        label = f"registered model '{ref.name}'"
        with self.guard(f"read {label}", f"READ permission on {label}"):
            if ref.alias is not None:
                return stored, self.client.get_model_version_by_alias(stored, ref.alias)
            if ref.version is not None:
                return stored, self.client.get_model_version(stored, str(ref.version))
            found = self.client.search_model_versions(_name_filter(stored))
            if not found:
                raise ConfigurationError(f"registered model '{ref.name}' has no versions; register one first")
            return stored, max(found, key=lambda mv: int(mv.version))


def _name_filter(stored: str) -> str:
    quote = '"' if "'" in stored else "'"
    return f"name={quote}{stored}{quote}"


# -- registering ------------------------------------------------------------------------------


def _run_for_registration(reg: _Registry, run_id: str | None, name: ModelName) -> tuple[str, bool]:
    """The run that holds the model's files: given, the job's, the active one, or a new one."""
    from sparkgpu.tracking.spool import SpoolDir, spool_path_from_env

    if run_id:
        return run_id, False
    spool = spool_path_from_env()
    if spool and (info := SpoolDir(spool).read_run_info()) is not None:
        return info.run_id, False
    mlflow = imported("mlflow")
    if mlflow is not None and (active := mlflow.active_run()) is not None:
        return active.info.run_id, False
    experiment = default_experiment_name()
    with reg.guard(f"create a run in experiment '{experiment}'", f"EDIT permission on experiment '{experiment}'"):
        experiment_id = ensure_experiment(reg.client, experiment, reg.target)
        run = reg.client.create_run(experiment_id, run_name=f"register {name}")
    return run.info.run_id, True


def _as_array(example):
    import numpy as np

    if hasattr(example, "detach"):
        return example.detach().cpu().numpy()
    if isinstance(example, (np.ndarray, list, tuple)):
        return np.asarray(example)
    raise ConfigurationError(
        f"input_example must be a tensor, a numpy array or a list of numbers, got {type(example).__name__}"
    )


def _signature(model, example):
    import torch
    from mlflow.models import infer_signature

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            output = model(torch.as_tensor(example))
    except Exception as exc:
        raise ConfigurationError(
            f"input_example could not be passed through the model ({type(exc).__name__}: {exc}); "
            "give one batch shaped as the model's forward() expects"
        ) from exc
    finally:
        model.train(was_training)
    output = output.detach().cpu().numpy() if hasattr(output, "detach") else None
    return infer_signature(example, output)


def register(
    model_or_checkpoint,
    name: str,
    *,
    model=None,
    alias: str | None = None,
    input_example=None,
    tokenizer=None,
    merge: bool = False,
    base_model_path: str | None = None,
    task: str | None = None,
    tags: dict | None = None,
    description: str | None = None,
    run_id: str | None = None,
    checkpoint_step: int | None = None,
    checkpoint_key: str | None = None,
    data_version=None,
    pip_requirements: list[str] | None = None,
    code_paths: list[str] | None = None,
    serialization_format: str | None = None,
    spark=None,
    tracking_uri: str | None = None,
    registry_uri: str | None = None,
) -> ModelVersionInfo:
    """Registers a model (or a checkpoint loaded into one) as a new version of ``name``.

    Args:
        model_or_checkpoint: A ``torch.nn.Module``; a transformers or PEFT model, alone (with
            ``tokenizer``) or as ``{"model": ..., "tokenizer": ...}``; or the directory of one
            complete checkpoint of ``sparkgpu.train.Checkpointer`` to load into ``model``. A model
            that training wrapped (Accelerate's mixed precision, DDP, FSDP, DeepSpeed,
            ``torch.compile``) is registered as the plain module inside (a PEFT model stays one).
        name: ``catalog.schema.model``; shorter names are completed (see :mod:`.names`).
        model: The module a checkpoint is loaded into (required with a checkpoint).
        alias: Alias to point at the new version (``"champion"``).
        input_example: One batch of input; the signature is inferred from it and the output
            (``torch.nn.Module`` only).
        tokenizer: The tokenizer of a transformers model given alone.
        merge: Register a PEFT model's merged weights (a plain transformers model) instead of
            its adapter and base model.
        base_model_path: A PEFT model's base model folder, reachable wherever the model is
            loaded: only the adapter is stored, the base is loaded from there. By default the
            base model's weights are stored beside the adapter.
        task: The transformers pipeline task (``"text-generation"``); by default read from the
            model's class (causal and seq2seq LMs, sequence and token classification).
        tags: Extra version tags.
        description: Version description.
        run_id: Run holding the model's files; by default the job's run inside a job, the
            active MLflow run, or a new run in the default experiment.
        checkpoint_step: Step of the checkpoint; by default read from its completion marker.
        checkpoint_key: Entry of the checkpoint holding the model's state dict.
        data_version: Data version to record; by default the run's ``sparkgpu.data.version``.
        pip_requirements: Requirements stored with the model; by default torch, numpy and
            cloudpickle at their installed versions (the full lock is in the job's run).
        code_paths: Files or folders with the model's class, stored with it so ``load``
            works where that code is not installed (pickled models only).
        serialization_format: ``"pt2"`` (``torch.export``: no pickled code; the default with
            an ``input_example``, falling back to pickle for models it cannot trace) or
            ``"pickle"`` (the default without one).
        spark: Session completing short names (the active one by default).
        tracking_uri: Tracking store for the model's files (see :func:`.target.resolve_target`).
        registry_uri: Registry; by default MLflow's, derived from the tracking store.

    Returns:
        The new version.

    Raises:
        ConfigurationError: bad name, alias, tags, input example, a checkpoint without ``model``,
            a transformers model without its tokenizer, or ``merge`` / ``base_model_path``
            on a model without an adapter.
        CheckpointError: the checkpoint's save did not finish (no completion marker), or it
            does not fit the model.
        PermissionDeniedError: the registry refused; the message names the missing permission.
    """
    import torch

    parsed = parse_model_name(name, spark=spark)
    if parsed.completed_from != "name":
        _logger.info("sparkgpu: model name %r completed to %r from the %s", name, str(parsed), parsed.completed_from)
    if alias is not None:
        validate_alias(alias)
    if tags is not None and not isinstance(tags, dict):
        raise ConfigurationError(f"tags must be a dict of name -> value, got {type(tags).__name__}")
    # What training wrapped (Accelerate's mixed precision, DDP, FSDP, DeepSpeed, torch.compile)
    # is registered as the plain module: the wrappers cannot be saved, nor loaded elsewhere.
    model_or_checkpoint, model = unwrap_models(model_or_checkpoint), unwrap_model(model)
    checkpoint = None
    if is_transformers_model(model_or_checkpoint):
        save, extra_tags = _transformers_saver(
            model_or_checkpoint, tokenizer, merge, base_model_path, task, input_example, pip_requirements, code_paths
        )
        tags = {**extra_tags, **(tags or {})}
    else:
        if tokenizer is not None or merge or base_model_path is not None or task is not None:
            raise ConfigurationError(
                "tokenizer=, merge=, base_model_path= and task= are for transformers and PEFT models; "
                f"got {type(model_or_checkpoint).__name__}"
            )
        if isinstance(model_or_checkpoint, torch.nn.Module):
            module = model_or_checkpoint
        elif isinstance(model_or_checkpoint, (str, os.PathLike)):
            if not isinstance(model, torch.nn.Module):
                raise ConfigurationError(
                    f"registering checkpoint {model_or_checkpoint} needs the module to load it into: "
                    "register(path, name, model=YourModel())"
                )
            checkpoint = os.fspath(model_or_checkpoint)
            committed = committed_checkpoint(checkpoint)  # before loading: a partial save is refused at once
            module = load_checkpoint_into(model, checkpoint, checkpoint_key)
            if checkpoint_step is None:
                checkpoint_step = committed.step
        else:
            raise ConfigurationError(
                "register() takes a torch.nn.Module or a checkpoint directory (or a transformers model, "
                f"as {{'model': model, 'tokenizer': tokenizer}}), got {type(model_or_checkpoint).__name__}"
            )
        save = _torch_saver(module, input_example, pip_requirements, code_paths, serialization_format)

    reg = _Registry(tracking_uri, registry_uri)
    run_id, own_run = _run_for_registration(reg, run_id, parsed)
    label = f"registered model '{parsed}'"
    try:
        version = _register_files(
            reg,
            parsed,
            save,
            run_id,
            checkpoint,
            checkpoint_step,
            data_version,
            tags,
            description,
        )
    finally:
        if own_run:
            reg.client.set_terminated(run_id)
    if alias is not None:
        with reg.guard(f"set alias '{alias}' on {label}", f"EDIT permission on {label}"):
            reg.client.set_registered_model_alias(reg.stored(parsed), alias, str(version))
    return get_version(f"{parsed}/{version}", tracking_uri=tracking_uri, registry_uri=registry_uri)


def _save_model(module, path, signature, example, requirements, code_paths, serialization_format) -> None:
    """Saves with MLflow's PyTorch flavour: ``torch.export`` ("pt2") when an input example
    allows tracing (no pickled code, the class need not be importable where it is loaded),
    else pickled (the class must be importable there, or shipped with ``code_paths``)."""
    import mlflow.pytorch
    from mlflow.exceptions import MlflowException

    chosen = serialization_format or ("pt2" if example is not None else "pickle")
    kwargs = dict(signature=signature, input_example=example, pip_requirements=requirements, code_paths=code_paths)
    try:
        mlflow.pytorch.save_model(module, path, serialization_format=chosen, **kwargs)
    except (MlflowException, RuntimeError, ValueError, TypeError) as exc:
        if serialization_format is not None or chosen != "pt2":
            raise
        # torch.export cannot trace every model (data-dependent control flow, ...).
        _logger.warning("sparkgpu: torch.export could not trace the model (%s); saving it pickled instead", exc)
        shutil.rmtree(path, ignore_errors=True)
        mlflow.pytorch.save_model(module, path, serialization_format="pickle", **kwargs)


def _torch_saver(module, input_example, pip_requirements, code_paths, serialization_format):
    """Checks a torch module's input example now; returns what writes its MLflow model to a folder."""
    import cloudpickle
    import numpy
    import torch

    example = _as_array(input_example) if input_example is not None else None
    signature = _signature(module, example) if example is not None else None
    requirements = pip_requirements or [
        f"torch=={torch.__version__.split('+')[0]}",
        f"numpy=={numpy.__version__}",
        f"cloudpickle=={cloudpickle.__version__}",
    ]

    def save(path: str) -> None:
        _save_model(module, path, signature, example, requirements, code_paths, serialization_format)

    return save


def _transformers_saver(obj, tokenizer, merge, base_model_path, task, input_example, pip_requirements, code_paths):
    """Checks a transformers model's parts now; returns what writes it to a folder, and its tags."""
    from sparkgpu.tracking import _transformers as hf

    if input_example is not None:
        raise ConfigurationError("input_example is for torch.nn.Module models; drop it for a transformers model")
    components = hf.transformers_components(obj, tokenizer)
    tags = hf.version_tags(components, merge, base_model_path)
    requirements = pip_requirements or hf.default_requirements(components, merge)

    def save(path: str) -> None:
        hf.save_transformers_model(
            components,
            path,
            merge=merge,
            base_model_path=base_model_path,
            task=task,
            requirements=requirements,
            code_paths=code_paths,
        )

    return save, tags


def _register_files(
    reg,
    parsed,
    save,
    run_id,
    checkpoint,
    checkpoint_step,
    data_version,
    tags,
    description,
) -> int:
    from mlflow.exceptions import MlflowException

    client, stored, label = reg.client, reg.stored(parsed), f"registered model '{parsed}'"
    run = client.get_run(run_id)
    run_tags = run.data.tags
    lineage = {"sparkgpu.run_id": run_id}
    for key in ("sparkgpu.job_id", "sparkgpu.data.source", "sparkgpu.data.version"):
        if run_tags.get(key):
            lineage[key] = run_tags[key]
    if data_version is not None:
        lineage["sparkgpu.data.version"] = str(data_version)
    if checkpoint is not None:
        lineage["sparkgpu.checkpoint.path"] = checkpoint
    if checkpoint_step is not None:
        lineage["sparkgpu.checkpoint.step"] = str(checkpoint_step)
    version_tags = {**lineage, **{str(k): str(v) for k, v in (tags or {}).items()}}
    artifact_path = f"models/{parsed.model}-{secrets.token_hex(4)}"
    with tempfile.TemporaryDirectory(prefix="sparkgpu-model-") as tmp:
        local = os.path.join(tmp, "model")
        save(local)
        with reg.guard(f"store the model's files in run {run_id}", "EDIT permission on the run's experiment"):
            client.log_artifacts(run_id, local, artifact_path)
    with reg.guard(f"create {label}", "permission to create registered models"):
        try:
            client.create_registered_model(
                stored,
                tags={
                    "sparkgpu.spec.catalog": parsed.catalog,
                    "sparkgpu.schema": parsed.schema,
                    "sparkgpu.model": parsed.model,
                },
            )
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
    with reg.guard(f"create a new version of {label}", f"EDIT permission on {label}"):
        mv = client.create_model_version(
            stored,
            f"{run.info.artifact_uri}/{artifact_path}",
            run_id=run_id,
            tags=version_tags,
            description=description,
        )
    return int(mv.version)


# -- reading and managing ---------------------------------------------------------------------


def load(ref: str, *, map_location=None, spark=None, tracking_uri: str | None = None, registry_uri: str | None = None):
    """Loads a registered model: ``"main.ml.ctr@champion"``, ``"main.ml.ctr/3"`` or the latest
    version with ``"main.ml.ctr"`` (short names are completed).

    Args:
        ref: Model reference.
        map_location: Passed to ``torch.load`` (``"cpu"`` to load GPU-trained weights on CPU);
            for a transformers model, the device to load it on.
        spark: Session completing short names.
        tracking_uri: Tracking store (for runs-relative artifact locations).
        registry_uri: Registry.

    Returns:
        The ``torch.nn.Module``; for a transformers model, ``{"model": ..., "tokenizer": ...}``
        (a PEFT model with its adapter on its base model, unless it was registered merged).

    Raises:
        ConfigurationError: bad reference, or the model has no versions.
        PermissionDeniedError: the registry refused to let you read it.
    """
    import mlflow.artifacts
    import mlflow.pytorch
    from mlflow.models import Model

    from sparkgpu.tracking import _transformers as _transformers_flavor

    parsed = parse_model_ref(ref, spark=spark)
    reg = _Registry(tracking_uri, registry_uri)
    stored, mv = reg.resolve(parsed)
    label = f"registered model '{parsed.name}'"
    with reg.guard(f"download {label} version {mv.version}", f"READ permission on {label}"):
        uri = reg.client.get_model_version_download_uri(stored, mv.version)
        with tempfile.TemporaryDirectory(prefix="sparkgpu-load-") as tmp:
            local = mlflow.artifacts.download_artifacts(
                artifact_uri=uri, dst_path=tmp, tracking_uri=reg.target.tracking_uri
            )
            if _transformers_flavor.FLAVOR in Model.load(local).flavors:
                return _transformers_flavor.load_transformers_model(local, device=map_location)
            return mlflow.pytorch.load_model(local, map_location=map_location)


def get_version(
    ref: str, *, spark=None, tracking_uri: str | None = None, registry_uri: str | None = None
) -> ModelVersionInfo:
    """The version a reference points at (``name/3``, ``name@alias``, or ``name`` for the latest)."""
    reg = _Registry(tracking_uri, registry_uri)
    _, mv = reg.resolve(parse_model_ref(ref, spark=spark))
    return reg.info(mv)


def versions(
    name: str, *, spark=None, tracking_uri: str | None = None, registry_uri: str | None = None
) -> list[ModelVersionInfo]:
    """Every version of a registered model, oldest first (empty when it does not exist)."""
    parsed = parse_model_name(name, spark=spark)
    reg = _Registry(tracking_uri, registry_uri)
    label = f"registered model '{parsed}'"
    with reg.guard(f"list the versions of {label}", f"READ permission on {label}"):
        found = reg.client.search_model_versions(_name_filter(reg.stored(parsed)))
    return sorted((reg.info(mv) for mv in found), key=lambda v: v.version)


def aliases(
    name: str, *, spark=None, tracking_uri: str | None = None, registry_uri: str | None = None
) -> dict[str, int]:
    """Alias -> version of a registered model."""
    parsed = parse_model_name(name, spark=spark)
    reg = _Registry(tracking_uri, registry_uri)
    label = f"registered model '{parsed}'"
    with reg.guard(f"read {label}", f"READ permission on {label}"):
        model = reg.client.get_registered_model(reg.stored(parsed))
    return {alias: int(version) for alias, version in (model.aliases or {}).items()}


def set_alias(
    name: str, alias: str, version: int, *, spark=None, tracking_uri: str | None = None, registry_uri: str | None = None
) -> None:
    """Points ``alias`` at ``version`` (moving it from the version it pointed at before)."""
    with _alias_change(name, alias, spark, tracking_uri, registry_uri, "set alias '{alias}' on", "EDIT") as (
        reg,
        model,
    ):
        reg.client.set_registered_model_alias(model, alias, str(int(version)))


def delete_alias(
    name: str, alias: str, *, spark=None, tracking_uri: str | None = None, registry_uri: str | None = None
) -> None:
    """Removes ``alias`` from a registered model."""
    with _alias_change(name, alias, spark, tracking_uri, registry_uri, "delete alias '{alias}' of", "MANAGE") as (
        reg,
        model,
    ):
        reg.client.delete_registered_model_alias(model, alias)


@contextlib.contextmanager
def _alias_change(name: str, alias: str, spark, tracking_uri, registry_uri, what: str, permission: str):
    """The registry and the stored model name for a change of ``alias``, inside the guard that names
    ``what`` was tried and the ``permission`` it needs when the registry refuses."""
    parsed = parse_model_name(name, spark=spark)
    validate_alias(alias)
    reg = _Registry(tracking_uri, registry_uri)
    label = f"registered model '{parsed}'"
    with reg.guard(f"{what.format(alias=alias)} {label}", f"{permission} permission on {label}"):
        yield reg, reg.stored(parsed)


def set_tags(
    ref: str, tags: dict, *, spark=None, tracking_uri: str | None = None, registry_uri: str | None = None
) -> None:
    """Sets tags on a version (``name/3``, ``name@alias``) or, for a bare name, on the model."""
    if not isinstance(tags, dict):
        raise ConfigurationError(f"tags must be a dict of name -> value, got {type(tags).__name__}")
    parsed = parse_model_ref(ref, spark=spark)
    reg = _Registry(tracking_uri, registry_uri)
    label = f"registered model '{parsed.name}'"
    stored = reg.stored(parsed.name)
    if parsed.version is None and parsed.alias is None:
        with reg.guard(f"tag {label}", f"EDIT permission on {label}"):
            for key, value in tags.items():
                reg.client.set_registered_model_tag(stored, str(key), str(value))
        return
    _, mv = reg.resolve(parsed)
    with reg.guard(f"tag version {mv.version} of {label}", f"EDIT permission on {label}"):
        for key, value in tags.items():
            reg.client.set_model_version_tag(stored, mv.version, str(key), str(value))
