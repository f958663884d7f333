"""Hugging Face models in the registry: PEFT adapters with their base model, merged on request.

Saved with MLflow's ``transformers`` flavour, so ``mlflow.transformers.load_model`` reads them
too. A PEFT model is stored as its adapter (``peft/``) beside its base model, which is either
stored (``model/``, the default: loads need nothing else) or referenced by a local folder that
must exist wherever the model is loaded (``base_model_path=``). ``merge=True`` stores the
merged weights as a plain ``transformers`` model instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from typing import Any

from sparkgpu._util.modules import imported
from sparkgpu.errors import ConfigurationError

__all__ = ["is_transformers_model", "transformers_components", "save_transformers_model", "load_transformers_model"]

_logger = logging.getLogger(__name__)

FLAVOR = "transformers"
# Keys of the model dict MLflow's transformers flavour takes (and load gives back).
_COMPONENT_KEYS = ("model", "tokenizer", "feature_extractor", "image_processor", "processor")


def _is_peft(model) -> bool:
    peft = imported("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def is_transformers_model(obj) -> bool:
    """Whether ``obj`` is a transformers or PEFT model, or MLflow's ``{"model": ..., ...}`` dict of one.

    Looks only at modules this process has imported: an object of theirs imported them.
    """
    if isinstance(obj, dict):
        obj = obj.get("model")
    transformers = imported("transformers")
    return _is_peft(obj) or (transformers is not None and isinstance(obj, transformers.PreTrainedModel))


def transformers_components(obj, tokenizer=None) -> dict[str, Any]:
    """MLflow's components dict for ``obj`` (a model, or a dict with ``"model"`` and a tokenizer).

    Raises:
        ConfigurationError: no tokenizer, or keys MLflow's flavour does not know.
    """
    components = dict(obj) if isinstance(obj, dict) else {"model": obj}
    if tokenizer is not None:
        components["tokenizer"] = tokenizer
    unknown = sorted(set(components) - set(_COMPONENT_KEYS))
    if unknown:
        raise ConfigurationError(
            f"a transformers model is registered from a dict with the keys {list(_COMPONENT_KEYS)}; "
            f"{unknown} are not among them"
        )
    if components.get("tokenizer") is None and components.get("processor") is None:
        raise ConfigurationError(
            "registering a transformers model needs its tokenizer: register({'model': model, "
            "'tokenizer': tokenizer}, name), or return that dict from rank 0 with register_as="
        )
    return components


def _wrapper_classes() -> tuple[type, ...]:
    """PEFT's modules that wrap a base model's module: tuner layers and ``modules_to_save`` copies."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return (BaseTunerLayer, AuxiliaryTrainingWrapper)


def _unwrapped_base(peft_model):
    """The transformers model inside a PEFT model (adapter layers still injected for LoRA-like tuners)."""
    config = peft_model.peft_config.get(peft_model.active_adapter)
    return peft_model.base_model if config is not None and config.is_prompt_learning else peft_model.base_model.model


# Where PEFT's wrappers keep the base model's own weights: a tuner layer's ``base_layer`` (LoRA's
# q_proj), a ``modules_to_save`` wrapper's ``original_module`` (a trained lm_head's untrained original).
_BASE_WEIGHTS_IN_WRAPPERS = ("base_layer.", "original_module.")


def base_state_dict(peft_model) -> dict:
    """The base model's own weights, under the base model's own names, without copying tensors.

    PEFT's LoRA-like tuners replace a ``q_proj`` by a layer holding ``q_proj.base_layer`` and
    the adapter's ``q_proj.lora_A...`` (and ``modules_to_save=["lm_head"]`` keeps the original
    as ``lm_head.original_module``); the base model saved as it stands would carry those
    names, and loading it as the base architecture would leave ``q_proj.weight`` missing
    (randomly initialised). MLflow 3's flavour saves it so: sparkgpu writes this instead.
    """
    base = _unwrapped_base(peft_model)
    wrappers = _wrapper_classes()
    state = base.state_dict()
    layers = sorted(
        (name for name, module in base.named_modules() if isinstance(module, wrappers)), key=len, reverse=True
    )
    clean: dict = {}
    for key, value in state.items():
        for layer in layers:
            prefix = f"{layer}." if layer else ""
            if key.startswith(prefix):
                rest = key[len(prefix) :]
                own = next((p for p in _BASE_WEIGHTS_IN_WRAPPERS if rest.startswith(p)), None)
                # The adapter's own weights (lora_A, modules_to_save copies) are in peft/.
                key = None if own is None else prefix + rest[len(own) :]
                break
        if key is not None:
            clean[key] = value
    return clean


def base_model_description(model) -> dict[str, Any]:
    """What the registry records of a model's base: its ``name_or_path``, class and config."""
    base = _unwrapped_base(model) if _is_peft(model) else model
    config = base.config.to_dict()
    canonical = json.dumps(config, sort_keys=True, default=str)
    return {
        "name_or_path": str(getattr(base, "name_or_path", "") or ""),
        "architecture": type(base).__name__,
        "config": json.loads(canonical),
        "config_sha256": hashlib.sha256(canonical.encode()).hexdigest(),
    }


def version_tags(components: dict, merge: bool, base_model_path: str | None) -> dict[str, str]:
    """Registry tags naming the base model and the adapter (``sparkgpu.base_model.*``, ``sparkgpu.adapter.*``)."""
    model = components["model"]
    base = base_model_description(model)
    tags = {
        "sparkgpu.base_model.name_or_path": base["name_or_path"],
        "sparkgpu.base_model.architecture": base["architecture"],
        "sparkgpu.base_model.config_sha256": base["config_sha256"],
    }
    if _is_peft(model):
        config = model.peft_config[model.active_adapter]
        tags["sparkgpu.adapter.type"] = str(getattr(config.peft_type, "value", config.peft_type))
        tags["sparkgpu.adapter.merged"] = "true" if merge else "false"
        if not merge:
            tags["sparkgpu.base_model.weights"] = "referenced" if base_model_path else "stored"
            if base_model_path:
                tags["sparkgpu.base_model.path"] = os.path.abspath(base_model_path)
    return tags


def default_requirements(components: dict, merge: bool) -> list[str]:
    """Pins of the installed packages a load needs (none inferred: that loads the model again)."""
    from importlib.metadata import PackageNotFoundError, version

    names = ["torch", "transformers", "tokenizers", "safetensors", "accelerate"]
    if _is_peft(components["model"]) and not merge:
        names.append("peft")
    pins = []
    for name in names:
        with contextlib.suppress(PackageNotFoundError):
            pins.append(f"{name}=={version(name).split('+')[0]}")
    return pins


@contextlib.contextmanager
def _without_hub_name(model):
    """Hides a base model's hub id while MLflow saves it: MLflow would reference the hub instead
    of storing the weights (and ask the hub for the revision, which offline jobs cannot)."""
    base = _unwrapped_base(model)
    saved = getattr(base, "name_or_path", None)
    base.name_or_path = ""
    try:
        yield
    finally:
        base.name_or_path = saved


def _task(model, task: str | None) -> str:
    """The pipeline task: given, or read from the model's class (MLflow asks the hub, which offline jobs cannot)."""
    if task is not None:
        return task
    from transformers.models.auto import modeling_auto

    base = _unwrapped_base(model) if _is_peft(model) else model
    name = type(base).__name__
    for mapping, inferred in (
        ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "text-generation"),
        ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "text2text-generation"),
        ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "text-classification"),
        ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "token-classification"),
    ):
        if name in getattr(modeling_auto, mapping, {}).values():
            return inferred
    raise ConfigurationError(
        f"the transformers task of a {name} cannot be told from its class; give it: register(..., task='text-generation')"
    )


def _merged(model):
    """A merged copy of a PEFT model (the registered one keeps its adapter)."""
    import copy

    return copy.deepcopy(model).merge_and_unload()


def save_transformers_model(
    components: dict,
    path: str,
    *,
    merge: bool,
    base_model_path: str | None,
    task: str | None,
    requirements: list[str],
    code_paths: list[str] | None,
) -> None:
    """Writes an MLflow ``transformers`` model to ``path``.

    Raises:
        ConfigurationError: ``merge`` or ``base_model_path`` on a model without an adapter, or
            ``base_model_path`` not a transformers model folder.
    """
    import mlflow.transformers

    model = components["model"]
    peft = _is_peft(model)
    if (merge or base_model_path) and not peft:
        raise ConfigurationError(
            "merge= and base_model_path= are for PEFT models (an adapter on a base model); "
            f"{type(model).__name__} has no adapter, register it without them"
        )
    if base_model_path and merge:
        raise ConfigurationError("merge=True stores the merged weights; drop base_model_path=, which it does not use")
    if base_model_path and not os.path.isfile(os.path.join(base_model_path, "config.json")):
        raise ConfigurationError(
            f"base_model_path={base_model_path!r} is not a transformers model folder (no config.json); "
            "give the folder the base model was loaded from with from_pretrained, reachable wherever "
            "the model will be loaded, or leave it out to store the base weights with the adapter"
        )
    base = base_model_description(model)
    saved = dict(components, model=_merged(model) if merge else model)
    metadata = {"sparkgpu.base_model": {k: base[k] for k in ("name_or_path", "architecture", "config")}}
    kwargs = dict(task=_task(model, task), pip_requirements=requirements, code_paths=code_paths, metadata=metadata)
    hide = _without_hub_name(model) if peft and not merge and not base_model_path else contextlib.nullcontext()
    with hide:
        mlflow.transformers.save_model(saved, path, base_model_path=base_model_path, **kwargs)
    if peft and not merge and not base_model_path:
        # MLflow stored the base with the adapter's layers injected (see base_state_dict).
        binary = os.path.join(path, "model")
        shutil.rmtree(binary)
        _unwrapped_base(model).save_pretrained(binary, state_dict=base_state_dict(model))


def load_transformers_model(local: str, *, device=None) -> dict[str, Any]:
    """The model (with its adapter, if any) and its tokenizer, from an MLflow ``transformers`` model.

    Returns:
        ``{"model": ..., "tokenizer": ...}`` (and any other saved component), model in eval mode.
    """
    import mlflow.transformers

    loaded = mlflow.transformers.load_model(local, return_type="components", device=device)
    components = {key: value for key, value in loaded.items() if key in _COMPONENT_KEYS}
    components["model"].eval()
    return components
