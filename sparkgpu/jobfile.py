"""Job files: a training script and everything ``@distributed`` takes, in YAML or TOML.

```yaml
# ctr.yaml: run with `sparkgpu run ctr.yaml` (from cron, Airflow, CI, ...)
script: train.py              # relative to this file
args: [--epochs, "3"]
name: ctr-nightly
gpus: 8
gpu_type: H100
remote: true
max_runtime: 7d
max_restarts: 2
tags: {team: ml, project: ctr}
env: {HF_HOME: /local_disk0/hf}
```

The script runs on every rank as ``python train.py ARGS`` would run it (``__name__ ==
"__main__"``, ``sys.argv``, its folder first on ``sys.path``), inside a job whose process
group is already set up. Its source travels with the job, so workers that lack the file
(a remote pool) run the same code.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import runpy
import sys
from pathlib import Path
from typing import Any, Mapping

from sparkgpu._files import atomic_write_bytes
from sparkgpu.errors import ConfigurationError
from sparkgpu.job_options import JOB_OPTIONS, check_document_value
from sparkgpu.jobfile_air import is_air_workload, job_fields_from_air_workload

__all__ = ["JobFile", "ScriptRunner", "JOB_FILE_SUFFIXES"]

JOB_FILE_SUFFIXES = (".yaml", ".yml", ".toml", ".json")


@dataclasses.dataclass(frozen=True, slots=True)  # slots: no __dict__ for functools.update_wrapper to copy
class ScriptRunner:
    """A picklable callable that runs a Python script as ``__main__`` on a rank.

    Attributes:
        path: Absolute path of the script on the client.
        source: Its text, for workers where the path does not hold the same file.
        argv: Arguments after the script name.
        env: Environment variables set before the script starts.
    """

    path: str
    source: str
    argv: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_path(cls, path: str | os.PathLike, argv=(), env=None) -> "ScriptRunner":
        """Reads the script now, so the job runs the code as it was at launch.

        Raises:
            ConfigurationError: the script does not exist or is not readable text.
        """
        path = Path(path).expanduser().resolve()
        if not path.is_file():
            raise ConfigurationError(f"script {str(path)!r} does not exist; pass the path of a .py file")
        try:
            source = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(f"cannot read script {str(path)!r}: {exc}") from None
        return cls(str(path), source, tuple(str(a) for a in argv), {str(k): str(v) for k, v in (env or {}).items()})

    @property
    def __name__(self) -> str:  # DistributedFunction names the job after its function
        return Path(self.path).stem

    def _script_file(self) -> str:
        """The client's file when it is the same code here, else a copy in the run dir."""
        digest = hashlib.sha256(self.source.encode()).hexdigest()
        try:
            if hashlib.sha256(Path(self.path).read_bytes()).hexdigest() == digest:
                return self.path
        except OSError:
            pass  # the file is not on this machine: materialise it below
        from sparkgpu import runtime

        base = (
            Path(os.environ.get(runtime.ENV_RUN_DIR) or Path.home() / ".cache" / "sparkgpu") / "scripts" / digest[:16]
        )
        target = base / Path(self.path).name
        if not target.exists():
            base.mkdir(parents=True, exist_ok=True)
            # Ranks racing here write identical bytes; a copy lost to a power loss is written again.
            atomic_write_bytes(target, self.source.encode(), fsync=False)
        return str(target)

    def __call__(self) -> None:
        script = self._script_file()
        os.environ.update(self.env)
        saved_argv, saved_path = sys.argv[:], sys.path[:]
        sys.argv = [script, *self.argv]
        sys.path.insert(0, os.path.dirname(script))
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):  # `sys.exit(0)` at the end of a script is success
                raise
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
        return None


_FILE_FIELDS: dict[str, str] = {
    "script": "path of the .py file, relative to the job file",
    "args": "list of arguments passed to the script",
    "env": "mapping of environment variables for the script",
}
_OPTIONS = {option.name: option for option in JOB_OPTIONS}
_FIELDS: dict[str, str] = {**_FILE_FIELDS, **{name: option.help for name, option in _OPTIONS.items()}}


@dataclasses.dataclass(frozen=True)
class JobFile:
    """A job as a file describes it: the script, its arguments and environment, and the job
    options (:data:`sparkgpu.job_options.JOB_OPTIONS`) it gives; ``job.gpus`` and the like
    read an option or its default."""

    script: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    source: str = "command line"

    def __getattr__(self, name: str):
        option = _OPTIONS.get(name)
        if option is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self.options.get(name, option.default)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "JobFile":
        """Reads and validates a job file (YAML, TOML or JSON): sparkgpu's own fields, or a
        ``databricks air run`` workload (:mod:`sparkgpu.jobfile_air`).

        Raises:
            ConfigurationError: unreadable file, unknown field or wrong value; names the field.
        """
        from sparkgpu._documents import parse_document

        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigurationError(f"cannot read job file {str(path)!r} ({exc.strerror})") from None
        data = parse_document(text, path, what="job file")
        base_dir, source = path.resolve().parent, f"job file {str(path)!r}"
        if is_air_workload(data):  # a `databricks air run` workload file, read as it is
            job = cls(**job_fields_from_air_workload(data, base_dir=base_dir, source=source), source=source)
            job.build()  # every check @distributed makes (GPU counts per node, pool needs remote, ...)
            return job
        return cls.from_dict(data, base_dir=base_dir, source=source)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base_dir: str | os.PathLike = ".", source: str = "job") -> "JobFile":
        """Validates each field of ``data``; ``script`` is resolved against ``base_dir``.

        Raises:
            ConfigurationError: naming the field, what it expects and what it got.
        """
        unknown = [k for k in data if k not in _FIELDS]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(str(key), list(_FIELDS), n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigurationError(
                f"{source}: unknown field(s) {', '.join(hints)}; known fields: {', '.join(_FIELDS)}"
            )
        if not data.get("script"):
            raise ConfigurationError(f"{source}: field 'script' is required ({_FIELDS['script']})")

        def bad(field: str, value) -> ConfigurationError:
            return ConfigurationError(f"{source}: field {field!r} must be the {_FIELDS[field]}, got {value!r}")

        script, args, env = data["script"], data.get("args", ()), data.get("env") or {}
        if not isinstance(script, str):
            raise bad("script", script)
        if isinstance(args, str) or not isinstance(args, (list, tuple)):
            raise bad("args", args)
        if not isinstance(env, Mapping) or any(isinstance(v, (dict, list)) for v in env.values()):
            raise bad("env", env)
        options = {
            name: check_document_value(_OPTIONS[name], value, source)
            for name, value in data.items()
            if name in _OPTIONS and value is not None
        }
        job = cls(
            script=str((Path(base_dir) / script).resolve()),
            args=tuple(str(a) for a in args),
            env={str(k): str(v) for k, v in env.items()},
            options=options,
            source=source,
        )
        job.build()  # every other check (durations, gpu_type, log_ranks) as @distributed does it
        return job

    def with_overrides(self, **overrides) -> "JobFile":
        """A copy with the fields the command line gave (``None`` means "not given"); tags and
        environment variables add to the file's."""
        given = {k: v for k, v in overrides.items() if v is not None}
        fields: dict[str, Any] = {k: given.pop(k) for k in ("script", "args", "source") if k in given}
        if "env" in given:
            fields["env"] = {**self.env, **given.pop("env")}
        if "tags" in given:
            given["tags"] = {**(self.options.get("tags") or {}), **given["tags"]}
        unknown = set(given) - set(_OPTIONS)
        if unknown:
            raise ConfigurationError(
                f"unknown job option(s) {', '.join(sorted(unknown))}; known: {', '.join(_OPTIONS)}"
            )
        return dataclasses.replace(self, options={**self.options, **given}, **fields)

    def runner(self) -> ScriptRunner:
        return ScriptRunner.from_path(self.script, self.args, self.env)

    def build(self, callbacks=None):
        """The :class:`~sparkgpu.decorator.DistributedFunction` that runs this job.

        Raises:
            ConfigurationError: a field is invalid; the message names the job file.
        """
        from sparkgpu.decorator import distributed

        options = dict(self.options)  # what the file and command line gave; distributed() has the defaults
        options.setdefault("name", Path(self.script).stem)
        try:
            return distributed(self.runner(), callbacks=callbacks, **options)
        except ConfigurationError as exc:
            raise ConfigurationError(f"{self.source}: {exc}") from None
