"""The first code a scoring task runs: rehydrate the client's environment, then score.

Pickled by value into the task (the executor may have no sparkgpu, or another version), so it
uses the standard library alone, as training's generated entrypoint does. Each Python worker
rehydrates a given environment once (the overlay is cached on the node, as training's is), puts
it first on ``sys.path``, and only then unpickles the scoring function and its plan, so that
these and the model's code are imported from the client's environment.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import types

__all__ = ["score_shipped"]

_STATE = "_sparkgpu_predict_bootstrap"  # a module in sys.modules: what this worker has activated


def _activated() -> set:
    state = sys.modules.get(_STATE)
    if state is None:
        state = sys.modules[_STATE] = types.ModuleType(_STATE)
        setattr(state, "environments", set())  # noqa: B010 - a module attribute mypy cannot know
    return getattr(state, "environments")  # noqa: B009


def _write_once(path: str, data: bytes) -> None:
    if os.path.exists(path):
        return
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as f:
        f.write(data)
    os.replace(temporary, path)


def _activate(shipped: dict, cache: str) -> None:
    """Rehydrates the shipped environment into the node cache and puts it first on ``sys.path``."""
    files = shipped["files"]
    digest = hashlib.sha256(b"".join(files[name] for name in sorted(files))).hexdigest()[:16]
    folder = os.path.join(cache, "predict-bootstrap", digest)
    os.makedirs(folder, exist_ok=True)
    for name, data in files.items():
        _write_once(os.path.join(folder, name), data)
    spec = importlib.util.spec_from_file_location("_sparkgpu_hydrate", os.path.join(folder, "_hydrate.py"))
    assert spec is not None and spec.loader is not None
    hydrate = importlib.util.module_from_spec(spec)
    sys.modules["_sparkgpu_hydrate"] = hydrate
    spec.loader.exec_module(hydrate)
    overlay = hydrate.hydrate(shipped["manifest"], cache)
    hydrate.activate(overlay)


def score_shipped(shipped: dict, batches):
    """Scores one partition with the environment of ``shipped`` active.

    Args:
        shipped: ``manifest`` (the staged environment, or ``None`` when nothing is shipped),
            ``files`` (the hydration module and the error module, by file name), ``key``
            (the environment's id) and ``payload`` (the pickled scoring function and plan).
        batches: The partition's Arrow record batches.
    """
    if shipped.get("manifest") is not None and shipped["key"] not in _activated():
        cache = os.environ.get("SPARKGPU_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sparkgpu")
        _activate(shipped, cache)
        _activated().add(shipped["key"])
    from pyspark import cloudpickle

    score, plan = cloudpickle.loads(shipped["payload"])
    return score(plan, batches)
