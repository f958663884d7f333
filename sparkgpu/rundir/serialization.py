"""How a job's function, arguments, callbacks, return values and errors are pickled.

The client pickles the payload (:func:`serialize_payload`) part by part, so that an error
names the function, argument or callback that cannot be sent, and the global or closure
variable behind it; ranks unpickle it (:func:`unpack_payload`) with an error that names a
module missing in the workers' environment. Ranks pickle their return value
(:func:`dump_result`) or their failure (:func:`serialize_error`), which the client reads
back (:func:`deserialize_error`). :func:`client_sys_path` lists the import paths the
workers need so that the caller's own modules unpickle there too.

Where these bytes are stored, and how they are signed, is :mod:`sparkgpu.rundir.directory`'s.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

import cloudpickle

import sparkgpu
from sparkgpu.errors import RankFailure, SerializationError

__all__ = [
    "serialize_payload",
    "add_keyword_arguments",
    "unpack_payload",
    "unpack_callbacks",
    "dump_result",
    "serialize_error",
    "deserialize_error",
    "client_sys_path",
]


_CLOUDPICKLE_CODE_REDUCE = cloudpickle.Pickler.dispatch_table[types.CodeType]
_DYNAMIC_CODE = "<dynamic-code>"  # what cloudpickle >= 3.1.3 writes as the file name of pickled code


def _code_keeping_its_file(code: types.CodeType):
    """cloudpickle's reduction of a code object, with the code's own file name kept, so that a
    rank's traceback shows the user's file and source lines, not ``<dynamic-code>``."""
    constructor, args = _CLOUDPICKLE_CODE_REDUCE(code)
    return constructor, tuple(code.co_filename if isinstance(a, str) and a == _DYNAMIC_CODE else a for a in args)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = collections.ChainMap({types.CodeType: _code_keeping_its_file}, cloudpickle.Pickler.dispatch_table)


def _pickle(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _describe(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _dumps(obj: Any, what: str, fn=None) -> bytes:
    try:
        return _pickle(obj)
    except Exception as exc:  # pickling raises TypeError, PicklingError, AttributeError, ...
        culprit = _find_unpicklable_global(fn) if fn is not None else None
        hint = (
            f" It refers to {culprit}, which cannot be pickled: create that object inside the function instead."
            if culprit
            else " Pass plain data (numbers, strings, arrays, tensors, paths) and create connections, "
            "locks, sessions and open files inside the function."
        )
        raise SerializationError(
            f"{what} ({_describe(obj)}) cannot be sent to the workers: {type(exc).__name__}: {exc}.{hint}"
        ) from exc


def _find_unpicklable_global(fn) -> str | None:
    """Names the global or closure variable of ``fn`` that fails to pickle, if one does."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    candidates: dict[str, Any] = {}
    fn_globals = getattr(fn, "__globals__", {})
    for name in code.co_names:
        if name in fn_globals:
            candidates[f"global {name!r}"] = fn_globals[name]
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            candidates[f"closure variable {name!r}"] = cell.cell_contents
        except ValueError:
            continue
    for label, value in candidates.items():
        try:
            cloudpickle.dumps(value)
        except Exception:
            return f"{label} ({_describe(value)})"
    return None


def serialize_payload(fn, args: tuple, kwargs: dict, callbacks: list) -> bytes:
    """Pickles each part separately, so an error names the argument that failed.

    Raises:
        SerializationError: the function, an argument or a callback does not pickle.
    """
    parts = {
        "fn": _dumps(fn, f"function {getattr(fn, '__qualname__', fn)!r}", fn=fn),
        "args": [_dumps(a, f"positional argument {i}") for i, a in enumerate(args)],
        "kwargs": {k: _dumps(v, f"keyword argument {k!r}") for k, v in kwargs.items()},
        "callbacks": _dumps(list(callbacks), "job callbacks"),
    }
    return pickle.dumps(parts, protocol=pickle.HIGHEST_PROTOCOL)


def add_keyword_arguments(payload: bytes, extra: dict[str, Any]) -> bytes:
    """``payload`` with keyword arguments added (or replaced): only the new values are pickled.

    Raises:
        SerializationError: a new value does not pickle.
    """
    parts = pickle.loads(payload)  # the outer dict of already pickled parts: no user code runs
    parts["kwargs"] = {**parts["kwargs"], **{k: _dumps(v, f"keyword argument {k!r}") for k, v in extra.items()}}
    return pickle.dumps(parts, protocol=pickle.HIGHEST_PROTOCOL)


def _unpickle(data: bytes, what: str):
    try:
        return cloudpickle.loads(data)
    except ModuleNotFoundError as exc:
        raise SerializationError(
            f"{what} needs module {exc.name!r}, which is not available in the workers' environment; "
            f"install it where the workers run, or make it importable from the job's working directory"
        ) from exc


def unpack_payload(parts: dict) -> tuple[Any, tuple, dict, list]:
    """The function, arguments and callbacks of a payload's parts (as :func:`serialize_payload` made them).

    Raises:
        SerializationError: a part needs a module the workers' environment lacks.
    """
    fn = _unpickle(parts["fn"], "the function")
    args = tuple(_unpickle(a, f"positional argument {i}") for i, a in enumerate(parts["args"]))
    kwargs = {k: _unpickle(v, f"keyword argument {k!r}") for k, v in parts["kwargs"].items()}
    return fn, args, kwargs, unpack_callbacks(parts)


def unpack_callbacks(parts: dict) -> list:
    """The job callbacks of a payload's parts alone: what a supervisor needs, without the user's function.

    Raises:
        SerializationError: a callback needs a module this environment lacks.
    """
    return _unpickle(parts["callbacks"], "job callbacks")


class _Discard:
    """A file that keeps nothing: what a pickle of it would hold does not matter, only whether it pickles."""

    def write(self, data) -> int:
        return len(data)


def _unpicklable_item(value: Any) -> str | None:
    """Names the first item of a returned dict, list or tuple that fails to pickle, at any depth."""
    if type(value) is dict:
        items: list[tuple[str, Any]] = [(repr(k), v) for k, v in value.items()]
    elif type(value) in (list, tuple):
        items = [(str(i), v) for i, v in enumerate(value)]
    else:
        return None
    for label, item in items:
        try:
            cloudpickle.dump(item, _Discard(), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            inner = _unpicklable_item(item)
            return f"[{label}]{inner}" if inner and inner.startswith("[") else f"[{label}] ({_describe(item)})"
    return None


def dump_result(value: Any, f, rank: int) -> None:
    """Pickles rank ``rank``'s return value into the file ``f``; models in it should be unwrapped first
    (:func:`~sparkgpu.train.trained_models.unwrap_models`).

    Raises:
        SerializationError: the value does not pickle; names the item of a returned container that does not.
    """
    try:
        cloudpickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        item = _unpicklable_item(value)
        where = f"; the part that does not is its item {item}" if item else ""
        raise SerializationError(
            f"the return value of rank {rank} ({_describe(value)}) cannot be pickled: "
            f"{type(exc).__name__}: {str(exc).rstrip('.')}"
            f"{where}. Return plain data (numbers, arrays, tensors, state dicts, models) and leave locks, "
            "generators, open files and connections out of it"
        ) from exc


def serialize_error(rank: int, exc: BaseException) -> bytes:
    """Rank ``rank``'s failure: a :class:`RankFailure` with the traceback, and the exception if it pickles."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    exc_type = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
    failure = RankFailure(rank, exc_type, str(exc), tb, timestamp=time.time())
    try:
        exc_bytes = cloudpickle.dumps(exc)
    except Exception:  # the traceback text above still tells what happened
        exc_bytes = None
    return pickle.dumps({"failure": failure, "exception": exc_bytes})


def deserialize_error(data) -> tuple[RankFailure, BaseException | None]:
    """What :func:`serialize_error` wrote: the failure, and the exception when its class exists here."""
    record = pickle.loads(data)
    exc = None
    if record["exception"] is not None:
        try:
            exc = cloudpickle.loads(record["exception"])
        except Exception:  # the exception's class does not exist on the client
            exc = None
    return record["failure"], exc


def client_sys_path() -> list[str]:
    """Import paths the workers need so the caller's own modules unpickle there too."""
    paths = [os.getcwd()]
    paths += [p for p in sys.path if p and os.path.isdir(p) and "site-packages" not in p and "lib/python" not in p]
    package_root = str(Path(sparkgpu.__file__).resolve().parent.parent)  # where sparkgpu itself imports from
    paths.append(package_root)
    seen, ordered = set(), []
    for p in paths:
        if p not in seen:
            seen.add(p)
            ordered.append(p)
    return ordered
