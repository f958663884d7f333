"""The options of a job, defined once: ``@distributed`` keywords, ``sparkgpu run`` flags, job-file fields.

Each :class:`JobOption` names a keyword of :func:`sparkgpu.distributed` (and so of
``spark.gpu.train``), says what a value looks like when it comes from a file or the command
line, and carries the one help text all of them show. The job file's fields and validation
(:mod:`sparkgpu.spec.jobfile`) and the ``sparkgpu run`` flags (:mod:`sparkgpu.cli`) are generated
from :data:`JOB_OPTIONS`; a test checks that ``distributed`` takes every one of them. Keywords
that only make sense in Python (``backend``, ``callbacks``, the ``num_accelerators`` /
``num_gpus`` spellings of ``gpus``) are not options of a file or a command line.

Values are checked where ``distributed`` checks them (durations by :mod:`sparkgpu.spec.units`, GPU
types by the catalog); here only their shape in a document is.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Mapping

from sparkgpu.errors import ConfigurationError
from sparkgpu.spec import log_rank_selection

__all__ = [
    "JobOption",
    "JOB_OPTIONS",
    "PYTHON_ONLY_KEYWORDS",
    "add_cli_flags",
    "cli_values",
    "check_document_value",
    "key_value",
]

# Shapes of values: what a YAML/TOML/JSON document and a command line may hold.
INT, TEXT, FLAG, DURATION, MAPPING, RANKS = "int", "text", "flag", "duration", "mapping", "ranks"


@dataclasses.dataclass(frozen=True)
class JobOption:
    """One job option.

    Attributes:
        name: Keyword of ``distributed`` and field of a job file.
        shape: What a value looks like in a document: one of ``int``, ``text``, ``flag``,
            ``duration`` (seconds or ``"7d"``), ``mapping`` (``{team: ml}``), ``ranks``
            (``main``, ``all``, ``none`` or a list of ranks).
        help: The one description shown by ``--help``, job-file errors and the docs.
        flag: Command-line flag (``--gpu-type``); ``--tag KEY=VALUE`` repeats for a mapping.
    """

    name: str
    shape: str
    help: str
    flag: str = ""

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def default(self) -> Any:
        """The value when neither the file nor the command line gives one: ``distributed()``'s
        own default for it, the one place it is set."""
        import inspect

        from sparkgpu.api.decorator import distributed

        return inspect.signature(distributed).parameters[self.name].default


JOB_OPTIONS: tuple[JobOption, ...] = (
    JobOption("name", TEXT, "job name (default: the script's or function's name)"),
    JobOption(
        "gpus",
        INT,
        "number of GPUs (ranks); default: every GPU of this host (one rank without GPUs), "
        "or one node of accelerator_type when remote",
    ),
    JobOption("gpu_type", TEXT, "GPU type such as H100, A10, A100-80GB, H200, B200, L4, or cpu"),
    JobOption("accelerator_type", TEXT, "node shape such as GPU_8xH100 (remote nodes of N GPUs each)"),
    JobOption("remote", FLAG, "true to run on the remote GPU pool (Spark) instead of this host"),
    JobOption("pool", TEXT, "GPU pool (name or id in SPARKGPU_POOLS) to run on; needs remote"),
    JobOption("max_runtime", DURATION, "cap on one attempt, e.g. 7d; ranks checkpoint before it and the job resumes"),
    JobOption("checkpoint_grace", DURATION, "time before max_runtime at which ranks are asked to checkpoint, e.g. 5m"),
    JobOption("timeout", DURATION, "limit on the whole job, e.g. 12h"),
    JobOption("max_restarts", INT, "number of attempts restarted after a failure"),
    JobOption(
        "priority",
        TEXT,
        "priority class: best_effort, normal or critical (BEST_EFFORT/NORMAL/CRITICAL too); critical jobs go "
        "first and may preempt best_effort ones, which checkpoint and resume by themselves",
    ),
    JobOption(
        "capacity_wait",
        DURATION,
        "how long a remote attempt may wait for its GPUs, e.g. 2h (default: max_runtime); not billed",
    ),
    JobOption(
        "min_gpus",
        INT,
        "fewest GPUs a remote job may go on with when a lost node is not replaced within elastic_wait "
        "(it grows back at a checkpoint)",
    ),
    JobOption(
        "elastic_wait",
        DURATION,
        "how long an elastic job (min_gpus) waits for all its GPUs before going on with fewer, e.g. 20m",
    ),
    JobOption(
        "preflight",
        FLAG,
        "false to skip each node's check of its cache disk and GPUs before the ranks start (default: on)",
    ),
    JobOption("tags", MAPPING, "mapping of tags for tracking and cost attribution, e.g. {team: ml}", flag="--tag"),
    JobOption("log_ranks", RANKS, "ranks whose output streams to the caller: main, all, none or a list such as 0,2"),
    JobOption("experiment", TEXT, "MLflow experiment of the job's run (default: named after the script)"),
    JobOption("register_as", TEXT, "catalog.schema.model name to register rank 0's returned model under"),
    JobOption(
        "ship_environment", FLAG, "true to ship this Python environment to the workers (default: for remote jobs)"
    ),
)

#: ``run_async``: a job file or ``sparkgpu run`` waits for its job (``sparkgpu logs --follow`` watches one).
#: ``detach``: ``sparkgpu run --detach`` says it for the command, not the file. ``idempotency_key``: a
#: field of the file beside its options (:class:`~sparkgpu.spec.jobfile.JobFile`), and ``--idempotency-key``.
#: ``restart_on``: not a job-file option yet (a list of failure classes; the default policy applies).
#: ``progress_timeout``: not a job-file option yet (a duration or "off"; the default applies).
PYTHON_ONLY_KEYWORDS = frozenset(
    {
        "num_accelerators",
        "num_gpus",
        "backend",
        "callbacks",
        "run_async",
        "detach",
        "idempotency_key",
        "restart_on",
        "progress_timeout",
    }
)


def check_document_value(option: JobOption, value, source: str, *, subject: str | None = None):
    """``value`` of ``option`` as a job document gave it, checked for shape (``log_ranks``:
    ``"none"`` stays a word, :meth:`~sparkgpu.spec.jobfile.JobFile.build` turns it into ``None``).

    Raises:
        ConfigurationError: the value has the wrong shape; names the field and what it takes.
    """

    def bad() -> ConfigurationError:
        return ConfigurationError(
            f"{source}: {subject or f'field {option.name!r}'} must be the {option.help}, got {value!r}"
        )

    if value is None:
        return None
    if option.shape == INT:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
    elif option.shape == FLAG:
        if not isinstance(value, bool):
            raise bad()
    elif option.shape == TEXT:
        if not isinstance(value, str):
            raise bad()
    elif option.shape == DURATION:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise bad()
    elif option.shape == MAPPING:
        if not isinstance(value, Mapping) or any(isinstance(v, (dict, list)) for v in value.values()):
            raise bad()
        value = {str(k): str(v) for k, v in value.items()}
    elif option.shape == RANKS:
        try:
            ranks = log_rank_selection(value)
        except ConfigurationError:
            raise bad() from None
        value = value if value in ("main", "all", "none") else list(ranks or ())
    return value


def key_value(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` from a command line, as ``(key, value)``."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per job option; a flag left out is ``None`` (the job file's value stands)."""
    for option in JOB_OPTIONS:
        if option.shape == FLAG:
            parser.add_argument(option.cli_flag, action=argparse.BooleanOptionalAction, default=None, help=option.help)
        elif option.shape == MAPPING:
            parser.add_argument(
                option.cli_flag,
                dest=option.name,
                action="append",
                type=key_value,
                metavar="KEY=VALUE",
                help=f"{option.help} (repeat)",
            )
        else:
            parser.add_argument(
                option.cli_flag,
                dest=option.name,
                type=int if option.shape == INT else str,
                help=option.help + (f" (default {option.default})" if option.default is not None else ""),
            )


def cli_values(args: argparse.Namespace) -> dict[str, Any]:
    """The job options the command line gave, in the form ``distributed`` takes."""
    values = {}
    for option in JOB_OPTIONS:
        value = getattr(args, option.name, None)
        if value is None:
            continue
        if option.shape == MAPPING:
            value = dict(value)
        elif option.shape == RANKS:
            value = check_document_value(option, value, "sparkgpu run", subject=option.cli_flag)
        values[option.name] = value
    return values
