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
from typing import Any, Mapping, Sequence

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.errors import ConfigurationError
from sparkgpu.spec.options import JOB_OPTIONS, check_document_value
from sparkgpu.job_secrets import parse_secret_refs, read_secrets
from sparkgpu.spec.jobfile_air import air_field_paths, is_air_workload, job_fields_from_air_workload

__all__ = ["JobFile", "ScriptRunner", "JOB_FILE_SUFFIXES", "PARAMETERS_ENV", "PARAMETERS_FILE"]

JOB_FILE_SUFFIXES = (".yaml", ".yml", ".toml", ".json")
#: The variable that names the parameters file to the script, as ``air run`` names it.
PARAMETERS_ENV = "HYPERPARAMETERS_PATH"
PARAMETERS_FILE = "parameters.yaml"  # in the run dir


@dataclasses.dataclass(frozen=True, slots=True)  # slots: no __dict__ for functools.update_wrapper to copy
class ScriptRunner:
    """A picklable callable that runs a Python script as ``__main__`` on a rank.

    Attributes:
        path: Absolute path of the script on the client.
        source: Its text, for workers where the path does not hold the same file.
        argv: Arguments after the script name.
        env: Environment variables set before the script starts.
        parameters: The job file's ``parameters``, written to a file of the run dir that
            ``HYPERPARAMETERS_PATH`` names to the script; ``None`` when it gives none.
        cwd: Folder the script starts in (an ``air run`` command's ``cd``), when it exists on the node.
    """

    path: str
    source: str
    argv: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    parameters: Mapping[str, Any] | None = None
    cwd: str | None = None

    @classmethod
    def from_path(cls, path: str | os.PathLike, argv=(), env=None, parameters=None, cwd=None) -> "ScriptRunner":
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
        env = {str(k): str(v) for k, v in (env or {}).items()}
        return cls(str(path), source, tuple(str(a) for a in argv), env, parameters, cwd)

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

    def _parameters_file(self) -> str:
        """Writes :attr:`parameters` as YAML into the rank's run dir (private: 0700) and returns its path."""
        import yaml

        from sparkgpu import runtime

        folder = Path(os.environ.get(runtime.ENV_RUN_DIR) or Path.home() / ".cache" / "sparkgpu")
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / PARAMETERS_FILE
        # Every rank of a node writes the same bytes; atomically, so that none reads half a file.
        atomic_write_bytes(target, yaml.safe_dump(dict(self.parameters or {}), sort_keys=False).encode(), fsync=False)
        return str(target)

    def __call__(self, sealed_secrets: bytes | None = None) -> None:
        """Runs the script; ``sealed_secrets`` are the job's secrets, sealed under its key
        (:mod:`sparkgpu.job_secrets`), which this rank opens and holds in memory."""
        if sealed_secrets is not None:
            from sparkgpu import job_secrets
            from sparkgpu.rundir.keyring import current_job_key

            job_secrets.hold(job_secrets.unseal(current_job_key(), sealed_secrets))
        script = self._script_file()
        os.environ.update(self.env)
        if self.parameters is not None:
            os.environ[PARAMETERS_ENV] = self._parameters_file()  # a path, not a secret
        if self.cwd and os.path.isdir(self.cwd):
            os.chdir(self.cwd)
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
    "parameters": "mapping written to a YAML file whose path the script finds in $HYPERPARAMETERS_PATH",
    "secrets": "mapping of names to 'scope/key' secrets, read by the script with sparkgpu.runtime.secret(NAME)",
    "idempotency_key": "key of the submission: a job submitted again with the same key is the same job",
}
# Fields whose value is a mapping of the user's own keys: `--override env.A=1` may name any key.
_OPEN_MAPPINGS = ("env", "tags", "parameters", "secrets")
_OPTIONS = {option.name: option for option in JOB_OPTIONS}
_FIELDS: dict[str, str] = {**_FILE_FIELDS, **{name: option.help for name, option in _OPTIONS.items()}}


@dataclasses.dataclass(frozen=True)
class JobFile:
    """A job as a file describes it: the script, its arguments and environment, and the job
    options (:data:`sparkgpu.spec.options.JOB_OPTIONS`) it gives; ``job.gpus`` and the like
    read an option or its default."""

    script: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    source: str = "command line"
    #: ``parameters``: written into the run dir, its path in ``HYPERPARAMETERS_PATH``.
    parameters: Mapping[str, Any] | None = None
    #: ``secrets``: name -> ``scope/key``; their values, read when the file was read, are never printed.
    secret_refs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    secret_values: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    #: The MLflow run's name (an ``air run`` workload's ``mlflow_run_name``).
    run_name: str | None = None
    idempotency_key: str | None = None
    #: Folder the script starts in (an ``air run`` command's ``cd``).
    cwd: str | None = None
    #: Whether the file is an ``air run`` workload (``sparkgpu run`` then returns once it is submitted).
    air: bool = False

    def __getattr__(self, name: str):
        option = _OPTIONS.get(name)
        if option is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self.options.get(name, option.default)

    @classmethod
    def load(cls, path: str | os.PathLike, overrides: Sequence[str] = ()) -> "JobFile":
        """Reads and validates a job file (YAML, TOML or JSON): sparkgpu's own fields, or a
        ``databricks air run`` workload (:mod:`sparkgpu.spec.jobfile_air`).

        Args:
            path: The file.
            overrides: ``a.b=VALUE`` settings of fields by dotted path, applied before anything
                is checked; ``VALUE`` is typed as YAML reads it (``3``, ``true``, ``[a, b]``).

        Raises:
            ConfigurationError: unreadable file, unknown field or path, or wrong value; names the field.
        """
        from sparkgpu._util.documents import parse_document

        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigurationError(f"cannot read job file {str(path)!r} ({exc.strerror})") from None
        data = parse_document(text, path, what="job file")
        base_dir, source = path.resolve().parent, f"job file {str(path)!r}"
        air = is_air_workload(data)
        if overrides:
            known, open_mappings = air_field_paths() if air else (list(_FIELDS), _OPEN_MAPPINGS)
            data = apply_overrides(data, overrides, known, open_mappings)
        if air:  # a `databricks air run` workload file, read as it is
            job = cls(**job_fields_from_air_workload(data, base_dir=base_dir, source=source), source=source, air=True)
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
        parameters, idempotency_key = data.get("parameters"), data.get("idempotency_key")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise bad("parameters", parameters)
        if idempotency_key is not None and (not isinstance(idempotency_key, str) or not idempotency_key):
            raise bad("idempotency_key", idempotency_key)
        refs = parse_secret_refs(data.get("secrets") or {}, source)
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
            parameters=parameters,
            secret_refs=refs,
            secret_values=read_secrets(refs, source),
            idempotency_key=idempotency_key,
        )
        job.build()  # every other check (durations, gpu_type, log_ranks) as @distributed does it
        return job

    def with_overrides(self, **overrides) -> "JobFile":
        """A copy with the fields the command line gave (``None`` means "not given"); tags and
        environment variables add to the file's."""
        given = {k: v for k, v in overrides.items() if v is not None}
        fields: dict[str, Any] = {
            k: given.pop(k) for k in ("script", "args", "source", "idempotency_key") if k in given
        }
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
        return ScriptRunner.from_path(self.script, self.args, self.env, self.parameters, self.cwd)

    def seal_secrets(self, prepared):
        """``prepared`` (a :class:`~sparkgpu.api.prepare.PreparedJob` not yet written) with this job's
        secrets sealed under its key as an argument of the script's runner; as it is without secrets."""
        if not self.secret_values:
            return prepared
        from sparkgpu.job_secrets import seal

        return prepared.with_kwargs(sealed_secrets=seal(prepared.key, self.secret_values))

    def build(self, callbacks=None):
        """The :class:`~sparkgpu.api.decorator.DistributedFunction` that runs this job.

        Raises:
            ConfigurationError: a field is invalid; the message names the job file.
        """
        from sparkgpu.api.decorator import distributed

        options = dict(self.options)  # what the file and command line gave; distributed() has the defaults
        options.setdefault("name", Path(self.script).stem)
        if self.idempotency_key is not None:
            options["idempotency_key"] = self.idempotency_key
        try:
            return distributed(self.runner(), callbacks=callbacks, **options)
        except ConfigurationError as exc:
            raise ConfigurationError(f"{self.source}: {exc}") from None


def apply_overrides(
    data: Mapping[str, Any], overrides: Sequence[str], known: Sequence[str], open_mappings: Sequence[str] = ()
) -> dict:
    """``data`` with ``a.b=VALUE`` settings applied; ``VALUE`` is typed as YAML reads it.

    Args:
        data: The job document.
        overrides: The settings, each ``dotted.path=VALUE``.
        known: The dotted paths a setting may name.
        open_mappings: Fields whose keys are the user's own (``env_variables.ANY``, ``parameters.a.b``).

    Raises:
        ConfigurationError: a setting without ``=``, or a path that is not a field; names the known ones.
    """
    import copy

    import yaml

    result = copy.deepcopy(dict(data))
    for override in overrides:
        path, equals, text = override.partition("=")
        path = path.strip()
        if not equals or not path:
            raise ConfigurationError(f"--override {override!r}: give FIELD.PATH=VALUE, e.g. compute.num_accelerators=8")
        if path not in known and not any(path.startswith(m + ".") for m in open_mappings):
            close = difflib.get_close_matches(path, list(known), n=1)
            raise ConfigurationError(
                f"--override {override!r}: {path!r} is not a field"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + f"; known: {', '.join(known)}"
                + (f", and any key under {', '.join(open_mappings)}" if open_mappings else "")
            )
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigurationError(f"--override {override!r}: the value does not read as YAML ({exc})") from None
        *parents, leaf = path.split(".")
        node = result
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {} if child is None else child
            if not isinstance(child, dict):
                raise ConfigurationError(f"--override {override!r}: {part!r} holds {child!r}, not a mapping")
            node = child
        node[leaf] = value
    return result
