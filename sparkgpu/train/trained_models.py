"""Models in what a job's function returns: unwrapped from their training wrappers, saved when they cannot be pickled.

Training wraps a model: Accelerate (and a ``Trainer`` or ``SFTTrainer`` through it) replaces a
mixed-precision model's ``forward`` with one that converts its outputs to fp32 and refuses to
be pickled; DDP, FSDP and DeepSpeed put it inside a module of theirs; ``torch.compile`` inside an
``OptimizedModule``. None of those wrappers means anything once training is done, and most
cannot be pickled or registered. :func:`unwrap_models` takes them off every model in a return
value (a model, or one inside the dicts, lists and tuples the function returns): the rank's
result (:mod:`sparkgpu.launch.rank.entrypoint`) and a registered model
(:func:`sparkgpu.tracking.registry.register`) both go through it. A PEFT model stays a PEFT
model: its adapter is what was trained.

When a result still does not pickle, :func:`save_models` saves its models into the run dir
first, so nothing trained is lost to the failure.

Nothing here imports torch or a training library that the process has not imported: a value
holds a model of theirs only if they are imported already.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path
from typing import Any

from sparkgpu._util.modules import imported

__all__ = ["unwrap_model", "unwrap_models", "find_models", "save_models"]

_logger = logging.getLogger(__name__)

#: The modules whose classes wrap a model: a model of one of them is unwrapped.
_WRAPPER_MODULES = ("torch.nn.parallel", "torch._dynamo", "torch.distributed.fsdp", "deepspeed")
#: What Accelerate keeps in a model's ``__dict__`` once it replaced the model's ``forward`` for mixed precision.
_ACCELERATE_FORWARD = "_original_forward"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def _is_module(value: Any) -> bool:
    torch = imported("torch")
    return torch is not None and isinstance(value, torch.nn.Module)


def _wrapped(model: Any) -> bool:
    """Whether ``model`` is a wrapper's module, or a model whose ``forward`` Accelerate replaced."""
    module = type(model).__module__
    return _ACCELERATE_FORWARD in vars(model) or any(
        module == name or module.startswith(name + ".") for name in _WRAPPER_MODULES
    )


def _unwrap_by_hand(model: Any) -> Any:
    """One wrapper off ``model`` where Accelerate is not installed (and so wrapped nothing itself)."""
    dynamo = imported("torch._dynamo.eval_frame")
    if dynamo is not None and isinstance(model, dynamo.OptimizedModule):
        return model._orig_mod
    inner = getattr(model, "module", None)  # DDP, DataParallel, FSDP and DeepSpeed's engine
    return inner if _is_module(inner) else model


def unwrap_model(model: Any) -> Any:
    """The plain module inside a model that training wrapped; anything else as it is.

    Accelerate's own unwrapping (``extract_model_from_parallel`` without its fp32 wrapper and
    without ``torch.compile``) where Accelerate is installed, as a ``Trainer`` would unwrap for
    its own saves; else DDP's ``module`` and ``OptimizedModule._orig_mod``. A mixed-precision
    model's ``forward`` is restored in place: the model itself no longer converts its outputs
    to fp32 afterwards.
    """
    if not _is_module(model):
        return model
    while _wrapped(model):
        if importlib.util.find_spec("accelerate") is not None:
            from accelerate.utils import extract_model_from_parallel  # type: ignore[import-untyped]

            inner = extract_model_from_parallel(model, keep_fp32_wrapper=False, keep_torch_compile=False)
        else:
            inner = _unwrap_by_hand(model)
        if inner is model and _wrapped(model):
            break  # a wrapper neither knows: pickled or registered as it is
        model = inner
    return model


def _walk(value: Any, on_model, seen: set[int]) -> Any:
    if _is_module(value):
        return on_model(value)
    if type(value) not in (dict, list, tuple) or id(value) in seen:
        return value  # only the plain containers a function builds; a cycle is walked once
    seen.add(id(value))
    if type(value) is dict:
        items = {key: _walk(item, on_model, seen) for key, item in value.items()}
        changed = any(items[key] is not item for key, item in value.items())
        return items if changed else value
    walked = [_walk(item, on_model, seen) for item in value]
    if all(new is old for new, old in zip(walked, value)):
        return value
    return walked if type(value) is list else tuple(walked)


def unwrap_models(value: Any) -> Any:
    """``value`` with :func:`unwrap_model` applied to every model in it, at any depth of its dicts, lists and tuples.

    Containers holding no wrapped model are returned as they are (the same objects).
    """
    return _walk(value, unwrap_model, set())


def _models_in(value: Any) -> dict[str, tuple[Any, Any]]:
    """The models in ``value`` by their place in it, each with the tokenizer beside it (or ``None``)."""
    found: dict[str, tuple[Any, Any]] = {}
    seen: set[int] = set()

    def walk(item: Any, where: str, tokenizer: Any) -> None:
        if _is_module(item):
            found.setdefault(where, (item, tokenizer))
            return
        if type(item) not in (dict, list, tuple) or id(item) in seen:
            return
        seen.add(id(item))
        if type(item) is dict:
            beside = item.get("tokenizer")
            beside = beside if hasattr(beside, "save_pretrained") else None
            for key, inner in item.items():
                walk(inner, f"{where}.{key}" if where else str(key), beside)
        else:
            for i, inner in enumerate(item):
                walk(inner, f"{where}.{i}" if where else str(i), None)

    walk(value, "", None)
    return found


def find_models(value: Any) -> dict[str, Any]:
    """The models in ``value`` by where they are in it: ``""`` for ``value`` itself, ``"model"``, ``"0.model"``."""
    return {where: model for where, (model, _) in _models_in(value).items()}


def save_models(value: Any, folder: Path) -> dict[str, str]:
    """Saves every model in ``value`` into ``folder``; returns where each went, by its place in ``value``.

    A model with ``save_pretrained`` (transformers, PEFT: the adapter alone for a PEFT model)
    gets a folder of its own, with the tokenizer beside it in ``value`` when there is one; any
    other module its ``state_dict`` in a ``.pt`` file (``torch.save``). A model that fails to
    save is logged and left out: the others are still saved.
    """
    models = _models_in(value)
    if not models:
        return {}
    import torch

    saved: dict[str, str] = {}
    for where, (model, tokenizer) in models.items():
        name = _UNSAFE.sub("_", where).lstrip(".") or "model"  # a dict key never leaves the folder
        try:
            if hasattr(model, "save_pretrained"):
                target = folder / name
                model.save_pretrained(target)
                if tokenizer is not None:
                    tokenizer.save_pretrained(target)
            else:
                target = folder / f"{name}.pt"
                folder.mkdir(parents=True, exist_ok=True)
                torch.save(model.state_dict(), target)
        except Exception:  # one model that fails to save must not cost the others theirs
            _logger.exception("the returned model %r could not be saved into %s", name, folder)
            continue
        saved[where or "model"] = str(target)
    return saved
