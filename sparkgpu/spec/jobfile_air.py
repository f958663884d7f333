"""Databricks ``air run`` workload files, read as they are and mapped onto sparkgpu's job options.

```yaml
# train.yaml, written for `air run --file train.yaml`; `sparkgpu run train.yaml` runs it too
experiment_name: ctr
environment:
  dependencies: [torch, "mlflow>=2"]
compute:
  num_accelerators: 16
  accelerator_type: GPU_8xH100
code_source:
  type: snapshot
  snapshot: {root_path: .}
env_variables: {BATCH_SIZE: "32"}
command: torchrun --nproc_per_node=8 $CODE_SOURCE_PATH/train.py --lr 1e-4
```

Each field becomes the job option sparkgpu's own job files use (:mod:`sparkgpu.spec.jobfile`):
``experiment_name`` -> ``experiment``, ``compute.num_accelerators`` -> ``gpus``,
``compute.accelerator_type`` -> ``accelerator_type``, ``compute.pool_id`` -> ``pool`` (a
remote job), ``compute.priority_class`` -> ``priority``, ``env_variables`` -> ``env``. The
command must be one Python script started by ``python`` or ``torchrun``: sparkgpu starts one
rank per GPU itself and runs the script on each. What it cannot run that way (pipes, ``&&``,
other programs, ``python -m``) is refused when the file is read, naming what is supported.

``environment.dependencies`` is checked, not installed: the job runs in this Python
environment (shipped to remote workers), so a requirement it does not meet is refused with
the ``pip install`` command that meets it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import os
import re
import shlex
from pathlib import Path
from typing import Any, Mapping

from sparkgpu.errors import ConfigurationError
from sparkgpu.job_secrets import SecretRef, parse_secret_refs, read_secrets

__all__ = [
    "AIR_FIELDS",
    "AIR_DEFAULT_MAX_RETRIES",
    "air_field_paths",
    "is_air_workload",
    "job_fields_from_air_workload",
    "unmet_requirements",
    "ScriptCommand",
]

# Field -> what it holds, for error messages and the porting guide.
AIR_FIELDS: dict[str, str] = {
    "experiment_name": "MLflow experiment of the job's run",
    "compute": "mapping with accelerator_type, num_accelerators and optionally pool_id, priority_class",
    "command": "one command: `python SCRIPT.py ARGS` or `torchrun [OPTIONS] SCRIPT.py ARGS`",
    "environment": "mapping with dependencies (a list of requirements or a requirements file) and version",
    "code_source": "mapping with type: snapshot and snapshot: {root_path: PATH}",
    "env_variables": "mapping of environment variables for the command",
    "mlflow_run_name": "name of the job's MLflow run",
    "mlflow_experiment_directory": "folder of the MLflow experiment, e.g. /Users/me@example.com",
    "mlflow_artifact_location": "where MLflow artifacts are written",
    "secrets": "mapping of names to 'scope/key' secrets, read by the script with sparkgpu.runtime.secret(NAME)",
    "max_retries": "number of attempts restarted after a failure (default 3)",
    "parameters": "mapping written to a YAML file whose path the script finds in $HYPERPARAMETERS_PATH",
    "timeout_minutes": "limit on the whole job, in minutes",
    "idempotency_token": "key of the submission: a workload submitted again with the same token is the same job",
    "usage_policy_name": "usage policy the job runs under, by name",
    "usage_policy_id": "usage policy the job runs under, by id (sparkgpu's policies have names: the same as the name)",
    "permissions": "grants on the job to other users (refused unless empty: a job is its launching user's alone)",
}
#: ``max_retries`` when the workload gives none, as ``air run`` has it (sparkgpu's own default is 0).
AIR_DEFAULT_MAX_RETRIES = 3
# Fields whose keys are the user's own: `--override parameters.lr=0.1` may name any key under them.
_OPEN_MAPPINGS = ("env_variables", "secrets", "parameters")
_SECTIONS: dict[str, dict[str, str]] = {
    "compute": {
        "accelerator_type": "node shape such as GPU_8xH100",
        "num_accelerators": "number of GPUs in all, a multiple of the GPUs per node",
        "pool_id": "GPU pool (name or id in SPARKGPU_POOLS) to run on",
        "priority_class": "BEST_EFFORT, NORMAL or CRITICAL",
    },
    "environment": {
        "dependencies": "list of pip requirements, or the path of a requirements YAML file",
        "version": "base environment version (no effect: the job runs in this Python environment)",
    },
    "code_source": {
        "type": "snapshot",
        "snapshot": "mapping with root_path",
        "root_path": "folder of the code, relative to the workload file",
    },
    "code_source.snapshot": {"root_path": "folder of the code, relative to the workload file"},
    "requirements file": {
        "dependencies": "list of pip requirements",
        "version": "base environment version",
        "environment_version": "base environment version",
    },
}
_REQUIRED = ("experiment_name", "compute", "command")
PRIORITY_CLASSES = ("BEST_EFFORT", "NORMAL", "CRITICAL")
CODE_SOURCE_VARIABLE = "CODE_SOURCE_PATH"
_SUPPORTED_COMMANDS = (
    "`python SCRIPT.py ARGS` or `torchrun [--nproc_per_node=N] [--nnodes=M] SCRIPT.py ARGS`, "
    "with $CODE_SOURCE_PATH and the env_variables expanded"
)

# torchrun options that set up what sparkgpu sets up itself: the rendezvous and the nodes' roles.
_TORCHRUN_RENDEZVOUS = frozenset(
    {"node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "role"}
)
_TORCHRUN_FLAGS = frozenset({"standalone"})
# pip options in a requirements list that only steer an installation; sparkgpu installs nothing.
_PIP_INSTALL_OPTIONS = frozenset(
    {"--index-url", "-i", "--extra-index-url", "--find-links", "-f", "--trusted-host", "--pre", "--no-deps"}
    | {"--no-build-isolation", "--no-binary", "--only-binary", "--prefer-binary", "--upgrade", "-U"}
)


def is_air_workload(data: Mapping[str, Any]) -> bool:
    """Whether a job document is an ``air run`` workload rather than a sparkgpu job file:
    it has no ``script`` and has one of the workload's required fields."""
    return "script" not in data and any(key in data for key in _REQUIRED)


def air_field_paths() -> tuple[list[str], tuple[str, ...]]:
    """The dotted paths ``--override`` may set in a workload, and the fields whose keys are the user's own."""
    paths = list(AIR_FIELDS)
    for section in ("compute", "environment", "code_source", "code_source.snapshot"):
        paths += [f"{section}.{name}" for name in _SECTIONS[section] if f"{section}.{name}" not in _SECTIONS]
    return paths, _OPEN_MAPPINGS


def _unknown(keys, known: Mapping[str, str], where: str, source: str) -> ConfigurationError | None:
    unknown = [k for k in keys if k not in known]
    if not unknown:
        return None
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), list(known), n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ConfigurationError(f"{source}: unknown field(s) {', '.join(hints)} in {where}; it takes: {', '.join(known)}")


def _section(data: Mapping[str, Any], name: str, source: str, *, label: str | None = None) -> Mapping[str, Any]:
    label = label or name
    value = data.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"{source}: {label} must be a {AIR_FIELDS.get(name, 'mapping')}, got {value!r}")
    error = _unknown(value, _SECTIONS[label], label, source)
    if error:
        raise error
    return value


@dataclasses.dataclass(frozen=True)
class ScriptCommand:
    """What a workload's ``command`` runs, as sparkgpu runs it.

    Attributes:
        script: Absolute path of the Python script.
        args: Its arguments, variables expanded.
        env: Variables the command set before its program (``A=1 python train.py``).
        ranks_per_node: ``torchrun --nproc_per_node``, when given as a number.
        nodes: ``torchrun --nnodes``, when given.
        max_restarts: ``torchrun --max_restarts``, when given.
        cwd: The folder a ``cd`` line of the command moved to, when one did.
    """

    script: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ranks_per_node: int | None = None
    nodes: int | None = None
    max_restarts: int | None = None

    cwd: str | None = None

    @classmethod
    def parse(cls, command: str, variables: Mapping[str, str], base_dir: Path, source: str) -> "ScriptCommand":
        """Reads ``command`` as a shell would, for the forms sparkgpu runs (:data:`_SUPPORTED_COMMANDS`).

        A multi-line command may set up before its program: blank lines, comments, ``cd DIR``
        (relative paths after it start there, and so does the script), ``export NAME=VALUE``,
        ``NAME=VALUE`` (a shell variable for the lines after it) and ``set`` options
        (``set -euo pipefail``: one program, whose failure fails the job either way).

        Raises:
            ConfigurationError: any other line (naming it), a line after the program, several
                commands on a line, a pipe, a redirection, another program, ``python -m``, or a
                variable that is neither ``$CODE_SOURCE_PATH`` nor one of ``env_variables``.
        """

        def refuse(why: str, line: str | None = None, number: int | None = None) -> ConfigurationError:
            what = f"command line {number} {line!r}" if number is not None else f"command {command.strip()!r}"
            return ConfigurationError(
                f"{source}: {what} {why}; sparkgpu runs {_SUPPORTED_COMMANDS}, after lines that only set up "
                f"({_SETUP_LINES})"
            )

        lines = re.sub(r"\\\r?\n", " ", command).splitlines()  # backslash-newline continues a line
        several = sum(1 for line in lines if line.strip() and not line.strip().startswith("#")) > 1
        known, env, base, cwd = dict(variables), {}, base_dir, None
        program: list[str] | None = None
        for number, line in enumerate(lines, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue

            def refuse_line(why: str, text=text, number=number) -> ConfigurationError:
                return refuse(why, text, number) if several else refuse(why)

            if program is not None:
                raise refuse_line("comes after the program; sparkgpu runs one program, on the last line")
            words = _words(text, refuse_line)
            if not words:
                continue  # a line holding a comment only
            if words[0] == "cd":
                if len(words) != 2 or words[1] == "-":
                    raise refuse_line("is not `cd DIR`")
                base = (base / _expand(words[1], known, refuse_line)).resolve()
                cwd = str(base)
            elif words[0] == "export":
                for word in words[1:]:
                    name, has_value, value = word.partition("=")
                    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                        raise refuse_line(f"exports {word!r}, which is not NAME=VALUE")
                    if has_value:
                        env[name] = known[name] = _expand(value, known, refuse_line)
                    elif name not in known:
                        raise refuse_line(f"exports ${name}, which is not set")
            elif words[0] == "set" and all(
                re.fullmatch(r"[-+][a-zA-Z]+|pipefail|errexit|nounset|xtrace", w) for w in words[1:]
            ):
                continue  # shell options: one program runs, and its failure fails the job either way
            elif all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w) for w in words) and several:
                for word in words:  # shell variables, not exported: for the lines below only
                    name, _, value = word.partition("=")
                    known[name] = _expand(value, known, refuse_line)
            else:
                program = words
                parsed = cls._program(words, known, base, refuse_line)
        if program is None:
            raise refuse("runs no program")
        return dataclasses.replace(parsed, env={**env, **parsed.env}, cwd=cwd)

    @classmethod
    def _program(cls, words: list[str], variables: Mapping[str, str], base_dir: Path, refuse) -> "ScriptCommand":
        env: dict[str, str] = {}
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = _expand(value, {**variables, **env}, refuse)
        if not words:
            raise refuse("runs no program")
        program, rest = os.path.basename(words[0]), words[1:]
        if re.fullmatch(r"python(3(\.\d+)?)?", program):
            rest = _python_options(rest, refuse)
            parsed: dict[str, int | None] = {}
        elif program == "torchrun":
            parsed, rest = _torchrun_options(rest, refuse)
        else:
            raise refuse(f"runs {words[0]!r}")
        if not rest:
            raise refuse("names no script")
        script = _expand(rest[0], {**variables, **env}, refuse)
        if not script.endswith(".py"):
            raise refuse(f"runs {script!r}, which is not a .py file")
        path = (base_dir / script).resolve()
        args = tuple(_expand(arg, {**variables, **env}, refuse) for arg in rest[1:])
        return cls(str(path), args, env, parsed.get("nproc_per_node"), parsed.get("nnodes"), parsed.get("max_restarts"))


_SETUP_LINES = "comments, cd DIR, export NAME=VALUE, NAME=VALUE, set -euo pipefail"


def _words(text: str, refuse) -> list[str]:
    """One line's words as a shell splits them; refuses what would run more than one program."""
    if "`" in text or "$(" in text:
        raise refuse("uses command substitution")
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError as exc:  # an unclosed quote
        raise refuse(f"does not parse ({exc})") from None
    operators = [w for w in words if w and set(w) <= set("();<>|&")]
    if operators:
        raise refuse(f"uses the shell operator {operators[0]!r}")
    return words


def _expand(word: str, variables: Mapping[str, str], refuse) -> str:
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise refuse(
                f"uses ${name}, which is not known when the job starts (known: {', '.join('$' + n for n in variables)})"
            )
        return variables[name]

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", value, word)


def _python_options(words: list[str], refuse) -> list[str]:
    while words and words[0].startswith("-"):
        if words[0] != "-u":  # unbuffered output: rank output is streamed either way
            raise refuse(f"passes {words[0]!r} to python (only -u is supported, and a script path)")
        words = words[1:]
    return words


def _torchrun_options(words: list[str], refuse) -> tuple[dict[str, int | None], list[str]]:
    parsed: dict[str, int | None] = {}
    while words and words[0].startswith("-"):
        word = words.pop(0)
        name, has_value, value = word.lstrip("-").partition("=")
        name = name.replace("-", "_")
        if name in _TORCHRUN_FLAGS:
            continue
        if name not in _TORCHRUN_RENDEZVOUS | {"nproc_per_node", "nnodes", "max_restarts"}:
            raise refuse(
                f"passes {word!r} to torchrun (supported: --nproc_per_node, --nnodes, --max_restarts, "
                f"--standalone, and the rendezvous options sparkgpu sets itself: "
                f"{', '.join('--' + o for o in sorted(_TORCHRUN_RENDEZVOUS))})"
            )
        if not has_value:
            if not words:
                raise refuse(f"gives {word!r} no value")
            value = words.pop(0)
        if name in _TORCHRUN_RENDEZVOUS:
            continue  # sparkgpu sets up the rendezvous and each node's rank itself
        if name == "nproc_per_node" and value in ("gpu", "auto"):
            parsed[name] = None  # one rank per GPU: what sparkgpu does
        elif value.isdigit():
            parsed[name] = int(value)
        else:
            raise refuse(f"gives {word.split('=')[0]} the value {value!r}; sparkgpu takes a number here")
    return parsed, words


def _requirement_lines(dependencies, base_dir: Path, source: str) -> list[str]:
    """The requirement strings of ``environment.dependencies``: its list, or the list of the
    requirements YAML file it names."""
    if isinstance(dependencies, str):
        from sparkgpu._util.documents import parse_document

        path = base_dir / dependencies
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigurationError(
                f"{source}: cannot read environment.dependencies file {str(path)!r} ({exc.strerror}); "
                "give a list of requirements or the path of a requirements YAML file, relative to the workload file"
            ) from None
        document = parse_document(text, path, what="requirements file")
        error = _unknown(document, _SECTIONS["requirements file"], "requirements file", f"{source}: {str(path)!r}")
        if error:
            raise error
        dependencies, base_dir = document.get("dependencies") or [], path.parent
    if not isinstance(dependencies, list) or not all(isinstance(d, str) for d in dependencies):
        raise ConfigurationError(
            f"{source}: environment.dependencies must be a list of pip requirements or the path of a "
            f"requirements YAML file, got {dependencies!r}"
        )
    lines: list[str] = []
    for entry in (d.strip() for d in dependencies):
        if not entry.startswith("-"):
            lines.append(entry)  # one requirement, spaces and markers included
            continue
        words = shlex.split(entry)  # `-r 'path'`, `--index-url=URL`
        flag, _, value = words[0].partition("=")
        value = value or " ".join(words[1:])
        if flag in ("-r", "--requirement"):
            lines += _requirements_txt(base_dir / value, source)
        elif flag not in _PIP_INSTALL_OPTIONS:  # the others steer how pip installs; sparkgpu installs nothing
            raise ConfigurationError(f"{source}: environment.dependencies: pip option {flag!r} is not supported")
    return lines


def _requirements_txt(path: Path, source: str) -> list[str]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigurationError(
            f"{source}: cannot read requirements file {str(path)!r} ({exc.strerror}); "
            "a `-r` path is read on this machine, relative to the file that names it"
        ) from None
    lines = [line.split(" #")[0].strip() for line in text.splitlines()]
    return _requirement_lines([line for line in lines if line and not line.startswith("#")], path.parent, source)


def unmet_requirements(requirements: list[str], source: str = "environment.dependencies") -> list[str]:
    """The requirements this Python environment does not meet, each with what it has instead.

    A requirement is a PEP 508 string (``"torch>=2.4"``, ``"pkg[extra]; python_version>'3'"``)
    or a wheel's path or URL (its name and version are read from the file name).

    Raises:
        ConfigurationError: a requirement is neither.
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

    unmet = []
    for text in requirements:
        if text.endswith(".whl"):
            try:
                name, version, _, _ = parse_wheel_filename(text.rsplit("/", 1)[-1])
            except InvalidWheelFilename as exc:
                raise ConfigurationError(f"{source}: {text!r} is not a wheel's name ({exc})") from None
            requirement = Requirement(f"{name}=={version}")
        else:
            try:
                requirement = Requirement(text)
            except InvalidRequirement as exc:
                raise ConfigurationError(
                    f"{source}: {text!r} is not a requirement sparkgpu can check ({exc}); "
                    "give `name`, `name>=version` and the like, or a wheel"
                ) from None
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue  # not for this platform or Python
        try:
            installed = importlib.metadata.version(canonicalize_name(requirement.name))
        except importlib.metadata.PackageNotFoundError:
            unmet.append(f"{text} (not installed)")
            continue
        if requirement.specifier and not requirement.specifier.contains(installed, prereleases=True):
            unmet.append(f"{text} (installed: {installed})")
    return unmet


def job_fields_from_air_workload(data: Mapping[str, Any], base_dir: str | os.PathLike, source: str) -> dict:
    """The fields of the :class:`~sparkgpu.spec.jobfile.JobFile` an ``air run`` workload describes:
    ``script``, ``args``, ``env`` and ``options``.

    Raises:
        ConfigurationError: a field is missing, unknown or wrong, the command is not one
            sparkgpu runs, it disagrees with ``compute``, or ``environment.dependencies``
            are not met here; each names the field and the fix. Nothing has started.
    """
    from sparkgpu.spec.catalog import lookup_accelerator_type

    base_dir = Path(base_dir)
    error = _unknown(data, AIR_FIELDS, "the workload", source)
    if error:
        raise error
    missing = [f for f in _REQUIRED if not data.get(f)]
    if missing:
        raise ConfigurationError(
            f"{source}: field(s) {', '.join(missing)} are required in an air run workload "
            f"({'; '.join(f'{f}: {AIR_FIELDS[f]}' for f in missing)})"
        )
    experiment, command = data["experiment_name"], data["command"]
    if not isinstance(experiment, str):
        raise ConfigurationError(
            f"{source}: experiment_name must be the name of an MLflow experiment, got {experiment!r}"
        )
    if not isinstance(command, str) or not command.strip():
        raise ConfigurationError(f"{source}: command must be {AIR_FIELDS['command']}, got {command!r}")

    compute = _section(data, "compute", source)
    accelerator_type, gpus = compute.get("accelerator_type"), compute.get("num_accelerators")
    if not isinstance(accelerator_type, str):
        raise ConfigurationError(
            f"{source}: compute.accelerator_type is required: a node shape such as GPU_8xH100, got {accelerator_type!r}"
        )
    try:
        shape = lookup_accelerator_type(accelerator_type)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{source}: compute.{exc}") from None
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ConfigurationError(
            f"{source}: compute.num_accelerators must be a number of GPUs (1 or more), got {gpus!r}"
        )
    if gpus % shape.gpus_per_node:
        raise ConfigurationError(
            f"{source}: compute.num_accelerators must be a multiple of the {shape.gpus_per_node} GPUs per node of "
            f"{accelerator_type}, got {gpus}"
        )
    options: dict[str, Any] = {"experiment": experiment, "gpus": gpus, "accelerator_type": accelerator_type}
    pool, priority = compute.get("pool_id"), compute.get("priority_class")
    if pool is not None:
        if not isinstance(pool, str) or not pool:
            raise ConfigurationError(f"{source}: compute.pool_id must be a pool's name or id, got {pool!r}")
        options.update(pool=pool, remote=True)  # a pool is remote capacity
    if priority is not None:
        if priority not in PRIORITY_CLASSES:
            close = difflib.get_close_matches(str(priority).upper(), PRIORITY_CLASSES, n=1)
            raise ConfigurationError(
                f"{source}: compute.priority_class must be one of {', '.join(PRIORITY_CLASSES)}, got {priority!r}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
            )
        if pool is None:
            raise ConfigurationError(
                f"{source}: compute.priority_class needs compute.pool_id: priorities order jobs in a pool"
            )
        options["priority"] = priority.lower()

    environment = _section(data, "environment", source)
    if environment.get("version") is not None and not isinstance(environment["version"], (str, int)):
        raise ConfigurationError(
            f"{source}: environment.version must be a version such as '4', got {environment['version']!r}"
        )
    code_source = _section(data, "code_source", source)
    root = _code_root(code_source, source)
    code_root = (base_dir / root).resolve() if root is not None else base_dir.resolve()
    if not code_root.is_dir():
        raise ConfigurationError(f"{source}: code_source root_path {str(code_root)!r} is not a folder")

    env_variables = data.get("env_variables") or {}
    if not isinstance(env_variables, Mapping) or any(isinstance(v, (Mapping, list)) for v in env_variables.values()):
        raise ConfigurationError(
            f"{source}: env_variables must be a {AIR_FIELDS['env_variables']}, got {env_variables!r}"
        )
    env = {CODE_SOURCE_VARIABLE: str(code_root), **{str(k): str(v) for k, v in env_variables.items()}}
    secret_refs = parse_secret_refs(data.get("secrets") or {}, source)
    clash = sorted(set(secret_refs) & set(env_variables))
    if clash:
        raise ConfigurationError(
            f"{source}: {', '.join(clash)} named in both env_variables and secrets; a name is a plain value or a secret"
        )
    parsed = ScriptCommand.parse(command, env, code_root, source)
    _check_ranks(parsed, gpus, shape.gpus_per_node, command, source)
    options["max_restarts"] = _max_restarts(data.get("max_retries"), parsed.max_restarts, source)
    extra = _optional_fields(data, options, source)
    _check_secret_reads(parsed.script, secret_refs, source)

    if environment.get("dependencies") is not None:
        unmet = unmet_requirements(_requirement_lines(environment["dependencies"], base_dir, source), source)
        if unmet:
            install = " ".join(shlex.quote(u.rsplit(" (", 1)[0]) for u in unmet)
            raise ConfigurationError(
                f"{source}: environment.dependencies not met by this Python environment, which runs the job "
                f"(and is shipped to remote workers; sparkgpu installs nothing): {'; '.join(unmet)}. "
                f"Install them here: pip install {install}"
            )
    return {
        "script": parsed.script,
        "args": parsed.args,
        "env": {**env, **parsed.env},
        "options": options,
        "cwd": parsed.cwd,
        "secret_refs": secret_refs,
        # Read now, when the file is read: a missing or exposed secret file stops the job before it starts.
        "secret_values": read_secrets(secret_refs, source),
        **extra,
    }


def _max_restarts(max_retries, torchrun_restarts: int | None, source: str) -> int:
    """``max_retries`` (``air run``'s default of 3 when absent), agreeing with ``torchrun --max_restarts``."""
    if max_retries is not None and (
        isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0
    ):
        raise ConfigurationError(f"{source}: max_retries must be a number of retries (0 or more), got {max_retries!r}")
    if max_retries is not None and torchrun_restarts is not None and max_retries != torchrun_restarts:
        raise ConfigurationError(
            f"{source}: max_retries is {max_retries} but the command's torchrun --max_restarts is {torchrun_restarts}; "
            "give one of them"
        )
    for given in (max_retries, torchrun_restarts):
        if given is not None:
            return given
    return AIR_DEFAULT_MAX_RETRIES


def _optional_fields(data: Mapping[str, Any], options: dict[str, Any], source: str) -> dict[str, Any]:
    """Maps the optional fields onto ``options`` (timeout, experiment folder) and returns the
    :class:`~sparkgpu.spec.jobfile.JobFile` fields they give; refuses those sparkgpu has no counterpart of."""
    extra: dict[str, Any] = {}
    run_name = data.get("mlflow_run_name")
    if run_name is not None:
        if not isinstance(run_name, str) or not run_name.strip():
            raise ConfigurationError(f"{source}: mlflow_run_name must be a run name, got {run_name!r}")
        extra["run_name"] = run_name
    folder = data.get("mlflow_experiment_directory")
    if folder is not None:
        if not isinstance(folder, str) or not folder.startswith("/"):
            raise ConfigurationError(
                f"{source}: mlflow_experiment_directory must be a folder such as /Users/me@example.com, got {folder!r}"
            )
        options["experiment"] = f"{folder.rstrip('/')}/{options['experiment']}"  # MLflow names experiments by path
    if data.get("mlflow_artifact_location") is not None:
        raise ConfigurationError(
            f"{source}: mlflow_artifact_location is not supported: the tracking store places a new experiment's "
            "artifacts under its own artifact root (MLflow's --default-artifact-root, or sparkgpu's store beside "
            "the embedded tracking database), and an existing experiment keeps its location; drop the field, or "
            "set the artifact root of the tracking server"
        )
    minutes = data.get("timeout_minutes")
    if minutes is not None:
        if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or minutes <= 0:
            raise ConfigurationError(f"{source}: timeout_minutes must be a number of minutes above 0, got {minutes!r}")
        options["timeout"] = minutes * 60
    parameters = data.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, Mapping):
            raise ConfigurationError(
                f"{source}: parameters must be a mapping such as {{lr: 0.001}}, got {parameters!r}"
            )
        extra["parameters"] = dict(parameters)
    token = data.get("idempotency_token")
    if token is not None:
        if not isinstance(token, str) or not token:
            raise ConfigurationError(f"{source}: idempotency_token must be a non-empty text, got {token!r}")
        extra["idempotency_key"] = token
    _check_usage_policy(data.get("usage_policy_name"), data.get("usage_policy_id"), options.get("pool"), source)
    _check_permissions(data.get("permissions"), source)
    return extra


def _code_root(code_source: Mapping[str, Any], source: str) -> str | None:
    if not code_source:
        return None
    kind = code_source.get("type", "snapshot" if "snapshot" in code_source else None)
    if kind not in (None, "snapshot"):
        raise ConfigurationError(f"{source}: code_source.type {kind!r} is not supported; use type: snapshot")
    if kind == "snapshot" and "snapshot" in code_source:
        snapshot = _section(code_source, "snapshot", source, label="code_source.snapshot")
        root = snapshot.get("root_path")
    else:
        root = code_source.get("root_path")
    if not isinstance(root, str) or not root:
        raise ConfigurationError(
            f"{source}: code_source needs snapshot: {{root_path: PATH}}, the folder of the code, got {dict(code_source)!r}"
        )
    return root


def _check_ranks(command: ScriptCommand, gpus: int, per_node: int, text: str, source: str) -> None:
    """``torchrun``'s rank counts must be the ones ``compute`` gives: sparkgpu starts one rank per GPU."""
    nodes = gpus // per_node
    if command.ranks_per_node is not None and command.ranks_per_node != per_node:
        raise ConfigurationError(
            f"{source}: command {text.strip()!r} starts {command.ranks_per_node} rank(s) per node, but compute gives "
            f"{per_node} GPU(s) per node ({gpus} in all); sparkgpu starts one rank per GPU: "
            f"set --nproc_per_node={per_node} or drop it"
        )
    if command.nodes is not None and command.nodes != nodes:
        raise ConfigurationError(
            f"{source}: command {text.strip()!r} asks for {command.nodes} node(s), but compute gives {nodes} "
            f"({gpus} GPUs, {per_node} per node): set --nnodes={nodes} or drop it"
        )


def _known_usage_policies() -> list[tuple[str, str, str | None]]:
    """``(name, file, pool)`` of each usage policy configured here: ``SPARKGPU_USAGE_POLICY``'s
    (every job's; pool ``None``), then each pool's of ``SPARKGPU_POOLS``."""
    from sparkgpu.config import settings
    from sparkgpu.spec.pools import configured_pools
    from sparkgpu.usage.policy import UsagePolicy

    known: list[tuple[str, str, str | None]] = []
    path = settings().usage_policy_path
    if path is not None:
        known.append((UsagePolicy.from_file(path).name, str(path), None))
    for pool in configured_pools() or []:
        if pool.usage_policy:
            known.append((UsagePolicy.from_file(pool.usage_policy).name, pool.usage_policy, pool.name))
    return known


def _check_usage_policy(name, policy_id, pool: str | None, source: str) -> None:
    """sparkgpu has no per-job choice of policy: ``SPARKGPU_USAGE_POLICY`` governs every job, and a
    pool's ``usage_policy`` every job on that pool. The named policy must be one of those that
    govern this job; anything else is refused, naming the known ones."""
    if name is None and policy_id is None:
        return
    if name is not None and policy_id is not None:
        raise ConfigurationError(f"{source}: give usage_policy_name or usage_policy_id, not both")
    field, wanted = ("usage_policy_name", name) if name is not None else ("usage_policy_id", policy_id)
    if not isinstance(wanted, str) or not wanted:
        raise ConfigurationError(f"{source}: {field} must be a policy's name, got {wanted!r}")
    known = _known_usage_policies()
    match = [k for k in known if wanted.lower() in (k[0].lower(), k[1].lower())]
    if any(p is None or (pool is not None and p == pool) for _, _, p in match):
        return  # the policy that governs this job anyway: checked before it starts, metered while it runs
    listing = "; ".join(f"{n!r} ({'every job' if p is None else 'jobs on pool ' + repr(p)})" for n, _, p in known)
    if match:
        pools = ", ".join(repr(p) for _, _, p in match)
        raise ConfigurationError(
            f"{source}: {field} {wanted!r} governs jobs on pool {pools}, and this job does not run there: "
            f"set compute.pool_id to it, or drop {field}"
        )
    raise ConfigurationError(
        f"{source}: {field} {wanted!r} is not a usage policy configured here (a job runs under "
        f"SPARKGPU_USAGE_POLICY and its pool's usage_policy); known: {listing or 'none'}. "
        f"Name one of those, or drop {field}"
    )


_PRINCIPALS = ("user_name", "group_name", "service_principal_name")


def _check_permissions(permissions, source: str) -> None:
    """A job is reachable by the OS user who launched it alone (its key is theirs, its run dir
    0700): there is nothing to grant. Grants to that very user change nothing and are accepted."""
    if permissions is None or permissions == []:
        return
    if not isinstance(permissions, list) or not all(isinstance(p, Mapping) for p in permissions):
        raise ConfigurationError(
            f"{source}: permissions must be a list of {{user_name|group_name|service_principal_name, level}}, "
            f"got {permissions!r}"
        )
    from sparkgpu.config import settings

    me = settings().user
    for entry in permissions:
        principals = [k for k in _PRINCIPALS if k in entry]
        if len(principals) != 1 or "level" not in entry:
            raise ConfigurationError(
                f"{source}: permissions entry {dict(entry)!r} needs exactly one of {', '.join(_PRINCIPALS)} and a level"
            )
        if principals[0] == "user_name" and str(entry["user_name"]).split("@")[0] == me:
            continue  # the launching user has every right already
        raise ConfigurationError(
            f"{source}: permissions entry {dict(entry)!r} cannot be granted: a sparkgpu job is reachable only by "
            f"the OS user who launched it (its key is in their $SPARKGPU_HOME/keys, its run dir is mode 0700), "
            "and sparkgpu has no grants. Drop the entry; to let someone else read or resume a job, they need "
            "that user's key file (docs: Security, the trust model)"
        )


def _check_secret_reads(script: str, refs: Mapping[str, SecretRef], source: str) -> None:
    """``air run`` sets each secret as an environment variable; sparkgpu does not (any process of
    the user reads ``/proc/<pid>/environ``): a script that reads one there is refused, naming the call."""
    if not refs:
        return
    try:
        text = Path(script).read_text()
    except (OSError, UnicodeDecodeError):
        return  # JobFile reports an unreadable script
    for name in refs:
        pattern = rf"(environ\s*(\.get\s*\(|\[)|getenv\s*\()\s*['\"]{re.escape(name)}['\"]"
        if re.search(pattern, text):
            raise ConfigurationError(
                f"{source}: {script} reads the secret {name} from the environment; sparkgpu never puts secrets in "
                f"the ranks' environment (every process of the user can read it): read it with "
                f"sparkgpu.runtime.secret({name!r})"
            )
