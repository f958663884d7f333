"""What ``spark.gpu.predict`` scores with: a model reference resolved on the client, loaded on executors.

``model=`` takes:

- a registry reference, ``"main.ml.ctr@champion"``, ``"main.ml.ctr/3"`` or ``"main.ml.ctr"``
  (the latest version): resolved to one version on the client, so every task scores with the
  same one even if the alias moves while the job runs;
- an MLflow model URI, ``"runs:/<run>/model"`` or ``"models:/<name>/<version>"``;
- a local directory of a transformers causal LM (``config.json``) or of a PEFT adapter
  (``adapter_config.json``; its base comes from ``base_model=`` or the adapter's config);
- a ``torch.nn.Module`` object, shipped in the task closure;
- a function taking no argument that returns a predict function (the contract of
  ``pyspark.ml.functions.predict_batch_udf``'s ``make_predict_fn``): ``predict(*arrays)``
  gets one numpy array per input column and returns an array, or a dict of arrays for
  several output columns.

Loaders for other kinds plug in through :func:`register_loader` (for instance the registry's
PEFT adapter loader: a version tagged ``sparkgpu.model.kind=peft``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from sparkgpu.errors import ConfigurationError

__all__ = ["ModelSource", "LoadedModel", "resolve_model", "register_loader"]

#: A version's tag naming how to load it; versions without it load as torch modules.
KIND_TAG = "sparkgpu.model.kind"

_LOADERS: dict[str, Callable[["ModelSource", str], Any]] = {}


def register_loader(kind: str, loader: Callable[["ModelSource", str], Any]) -> None:
    """Loads registry versions tagged ``sparkgpu.model.kind=<kind>`` with ``loader(source, device)``.

    The loader runs on the executors (it must be importable there) and returns a
    ``torch.nn.Module``, or a ``(model, tokenizer)`` pair for a language model.
    Registry versions of transformers models (``register_as=`` of a PEFT or transformers
    model) need no loader: the registry returns them with their tokenizer.
    """
    _LOADERS[kind] = loader


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A model pinned to one version, as the executors load it.

    Attributes:
        kind: ``"registry"``, ``"mlflow"``, ``"hf"``, ``"peft"``, ``"module"`` or ``"function"``.
        uri: What is loaded: ``models:/<name>/<version>``, an MLflow URI, a directory.
        key: The process cache's key: the same key, the same loaded model.
        name: Registered model name (registry versions only).
        version: Registered version (registry versions only).
        run_id: MLflow run that produced the version, if known.
        tags: The version's tags.
        base_model: Base model directory of a PEFT adapter.
        tracking_uri: Tracking store the executors read MLflow artifacts from.
        registry_uri: Registry the executors read versions from.
        make_predict_fn: The user's function, for ``kind="function"``.
        module: The user's ``torch.nn.Module``, for ``kind="module"`` (shipped in the task closure).
        tokenizer: Directory of the tokenizer of a language model whose source has none (a
            registry version or a module); a directory's own tokenizer is used otherwise.
    """

    kind: str
    uri: str
    key: str
    name: str | None = None
    version: int | None = None
    run_id: str | None = None
    tags: dict = dataclasses.field(default_factory=dict)
    base_model: str | None = None
    tracking_uri: str | None = None
    registry_uri: str | None = None
    make_predict_fn: Callable | None = None
    module: Any = None
    tokenizer: str | None = None

    def load(self, device: str) -> "LoadedModel":
        """Loads the model on ``device``: runs on an executor, once per process (see the cache)."""
        if self.kind == "function":
            assert self.make_predict_fn is not None
            return LoadedModel(predict_fn=self.make_predict_fn())
        if self.kind in ("hf", "peft") and device.startswith("cuda"):
            from sparkgpu.predict.executor.generation import vllm_usable

            if vllm_usable():
                return _load_vllm(self, device)
        loaded = self._load_module(device)
        if isinstance(loaded, dict):  # the registry's transformers models: {"model", "tokenizer"}
            model, tokenizer = loaded["model"], loaded.get("tokenizer")
        else:
            model, tokenizer = loaded if isinstance(loaded, tuple) else (loaded, None)
        if self.tokenizer is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer)
        if hasattr(model, "eval"):
            model.eval()
        return LoadedModel(module=model, tokenizer=tokenizer, device=device)

    def _load_module(self, device: str):
        kind = self.tags.get(KIND_TAG)
        if kind is not None and kind in _LOADERS:
            return _LOADERS[kind](self, device)
        if self.kind == "module":
            import copy

            return copy.deepcopy(self.module).to(device)
        if self.kind == "hf":
            return _load_hf(self.uri, device)
        if self.kind == "peft":
            return _load_peft(self.uri, self.base_model, device)
        if self.kind == "registry":
            from sparkgpu.tracking.registry import load

            return load(
                f"{self.name}/{self.version}",
                map_location=device,
                tracking_uri=self.tracking_uri,
                registry_uri=self.registry_uri,
            )
        import mlflow
        import mlflow.pytorch

        if self.tracking_uri:
            mlflow.set_tracking_uri(self.tracking_uri)
        if self.registry_uri:
            mlflow.set_registry_uri(self.registry_uri)
        return mlflow.pytorch.load_model(self.uri, map_location=device)


@dataclasses.dataclass
class LoadedModel:
    """A model ready in one executor process: a torch module (with its tokenizer) or a predict function."""

    module: Any = None
    tokenizer: Any = None
    device: str = "cpu"
    predict_fn: Callable | None = None
    vllm: Any = None
    lora_request: Any = None

    @property
    def generates(self) -> bool:
        return self.module is not None and hasattr(self.module, "generate")


def _load_vllm(source: ModelSource, device: str) -> LoadedModel:
    """A ``vllm.LLM`` on the task's GPU; a PEFT adapter is served as a LoRA on its base model."""
    import json

    from vllm import LLM

    if ":" in device and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]  # vLLM takes the first visible GPU
    if source.kind == "peft":
        from vllm.lora.request import LoRARequest

        with open(os.path.join(source.uri, "adapter_config.json")) as f:
            base = source.base_model or json.load(f).get("base_model_name_or_path")
        return LoadedModel(
            vllm=LLM(model=base, enable_lora=True), lora_request=LoRARequest("adapter", 1, source.uri), device=device
        )
    return LoadedModel(vllm=LLM(model=source.uri), device=device)


def _load_hf(path: str, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    model.to(device)  # type: ignore[arg-type]  # transformers types .to() for modules it wraps
    return model, AutoTokenizer.from_pretrained(path)


def _load_peft(path: str, base: str | None, device: str):
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(os.path.join(path, "adapter_config.json")) as f:
        base = base or json.load(f).get("base_model_name_or_path")
    if not base:
        raise ConfigurationError(f"the adapter in {path} does not name its base model; pass base_model=")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path).to(device)
    tokenizer_dir = path if os.path.exists(os.path.join(path, "tokenizer.json")) else base
    return model, AutoTokenizer.from_pretrained(tokenizer_dir)


def _directory_key(path: str) -> str:
    """A directory's cache key: its path and the newest modification time inside it."""
    newest = max(
        (os.stat(os.path.join(root, f)).st_mtime_ns for root, _, files in os.walk(path) for f in files), default=0
    )
    return f"{os.path.abspath(path)}@{newest}"


def resolve_model(
    model,
    *,
    base_model: str | None = None,
    tokenizer: str | None = None,
    tracking_uri: str | None = None,
    registry_uri: str | None = None,
) -> ModelSource:
    """Pins ``model=`` to one loadable version (on the client, before anything runs).

    ``tokenizer`` (a directory) gives a language model without one its tokenizer.

    Raises:
        ConfigurationError: ``model`` is none of the accepted forms, or the version does not exist.
    """
    if isinstance(model, ModelSource):
        return model
    if tokenizer is not None:
        source = resolve_model(model, base_model=base_model, tracking_uri=tracking_uri, registry_uri=registry_uri)
        key = f"{source.key}+tokenizer:{_directory_key(os.fspath(tokenizer))}"
        return dataclasses.replace(source, tokenizer=os.path.abspath(os.fspath(tokenizer)), key=key)
    if callable(model) and not hasattr(model, "state_dict"):
        import hashlib

        import cloudpickle

        # Keyed by the pickled function, not its id: each task unpickles its own copy.
        name = getattr(model, "__qualname__", type(model).__name__)
        digest = hashlib.sha256(cloudpickle.dumps(model)).hexdigest()[:16]
        return ModelSource(kind="function", uri=name, key=f"function:{name}:{digest}", make_predict_fn=model)
    if hasattr(model, "state_dict") and hasattr(model, "forward"):
        import hashlib

        import cloudpickle

        digest = hashlib.sha256(cloudpickle.dumps(model)).hexdigest()[:16]
        return ModelSource(kind="module", uri=type(model).__name__, key=f"module:{digest}", module=model)
    if not isinstance(model, (str, os.PathLike)):
        raise ConfigurationError(
            f"model= must be a registry name ('main.ml.ctr@champion'), an MLflow model URI, a model "
            f"directory or a function returning a predict function, not {type(model).__name__}"
        )
    text = os.fspath(model)
    if os.path.isdir(text):
        if os.path.exists(os.path.join(text, "adapter_config.json")):
            key = _directory_key(text) + (f"+{_directory_key(base_model)}" if base_model else "")
            return ModelSource(kind="peft", uri=os.path.abspath(text), key=key, base_model=base_model)
        if os.path.exists(os.path.join(text, "config.json")):
            return ModelSource(kind="hf", uri=os.path.abspath(text), key=_directory_key(text))
        raise ConfigurationError(
            f"{text} is neither a transformers model (config.json) nor a PEFT adapter (adapter_config.json)"
        )
    from sparkgpu.tracking.registry import get_version
    from sparkgpu.tracking.target import resolve_target

    target = resolve_target(tracking_uri, registry_uri)
    if text.startswith("models:/"):
        text = text[len("models:/") :]
    elif "://" in text or text.startswith("runs:/"):
        return ModelSource(
            kind="mlflow",
            uri=text,
            key=text,
            tracking_uri=target.tracking_uri,
            registry_uri=target.registry_uri,
        )
    info = get_version(text, tracking_uri=target.tracking_uri, registry_uri=target.registry_uri)
    return ModelSource(
        kind="registry",
        uri=info.uri,
        key=f"{target.registry_uri}|{info.uri}",
        name=info.name,
        version=info.version,
        run_id=info.run_id,
        tags=dict(info.tags),
        base_model=base_model,
        tracking_uri=target.tracking_uri,
        registry_uri=target.registry_uri,
    )
