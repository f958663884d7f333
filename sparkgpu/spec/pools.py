"""GPU pools chosen by type: ``remote=True`` jobs name a GPU type, never a cluster.

A pools file (``SPARKGPU_POOLS=pools.yaml``) names the Spark clusters jobs may run on, each
behind a Spark Connect URL::

    pools:
      a10-shared:
        url: sc://spark-a10.internal:15002
        gpu_type: A10
        gpus_per_node: 4
      h100-team:
        url: sc://spark-h100.internal:15002
        gpu_type: H100
        gpus_per_node: 8
        reserved: true
        id: 0415-h100-pool          # optional: the id DATABRICKS_REMOTE_GPU_POOL_ID names
        usage_policy: /etc/sparkgpu/h100-policy.toml

A job runs on the pool it names (``pool=``, ``SPARKGPU_POOL`` or
``DATABRICKS_REMOTE_GPU_POOL_ID``), else on the first pool of its GPU type: shared pools
before reserved ones, or only reserved ones with ``SPARKGPU_USE_RESERVED_POOL=1`` (alias
``DATABRICKS_USE_RESERVED_GPU_POOL``). CPU jobs (``gpu_type="cpu"``) prefer ``cpu`` pools
and otherwise run on any pool.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from sparkgpu.spec.catalog import lookup_gpu_type
from sparkgpu.errors import CapacityError, ConfigurationError
from sparkgpu.spec import Resources

__all__ = ["Pool", "load_pools", "configured_pools", "choose_pool", "describe_pools", "POOL_TAG"]

#: Job tag naming the pool a job runs on (usage records and resumed jobs read it).
POOL_TAG = "sparkgpu.pool"

_FIELDS = {"url", "gpu_type", "gpus_per_node", "reserved", "usage_policy", "id"}
_EXAMPLE = "pools:\n  h100:\n    url: sc://spark-h100.internal:15002\n    gpu_type: H100\n    gpus_per_node: 8"


@dataclasses.dataclass(frozen=True)
class Pool:
    """One Spark cluster jobs may run on.

    Attributes:
        name: The pool's name in the file (what ``pool=`` and ``SPARKGPU_POOL`` name).
        url: Spark Connect URL of the cluster (``sc://host:15002``).
        gpu_type: Catalog name of its GPUs (``"cpu"`` for a CPU-only cluster).
        gpus_per_node: GPUs each of its nodes carries.
        reserved: A reserved pool (a team's own), chosen by type only when reserved pools
            are asked for or no shared pool of the type exists.
        usage_policy: Usage policy file checked for every job on this pool, beside
            ``SPARKGPU_USAGE_POLICY``.
        pool_id: Another id the pool answers to (a Databricks pool id), or ``None``.
    """

    name: str
    url: str
    gpu_type: str
    gpus_per_node: int
    reserved: bool = False
    usage_policy: str | None = None
    pool_id: str | None = None

    def answers_to(self, name: str) -> bool:
        return name in (self.name, self.pool_id)

    def describe(self) -> str:
        kind = "reserved" if self.reserved else "shared"
        return f"{self.name} ({self.gpu_type}, {self.gpus_per_node} per node, {kind})"


def _field_lines(text: str) -> dict[tuple[str, ...], int]:
    """Line (1-based) of each pool and each of its fields (top-level keys under ``""``)."""
    import yaml

    lines: dict[tuple[str, ...], int] = {}
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if not isinstance(root, yaml.MappingNode):
        return lines
    for key, value in root.value:
        lines[("", str(key.value))] = key.start_mark.line + 1
        if key.value != "pools" or not isinstance(value, yaml.MappingNode):
            continue
        for pool_key, pool_value in value.value:
            lines[(str(pool_key.value),)] = pool_key.start_mark.line + 1
            if isinstance(pool_value, yaml.MappingNode):
                for field_key, _ in pool_value.value:
                    lines[(str(pool_key.value), str(field_key.value))] = field_key.start_mark.line + 1
    return lines


def load_pools(path: str | Path) -> list[Pool]:
    """Reads and validates a pools file.

    Args:
        path: A YAML (or JSON) file with a top-level ``pools:`` mapping of name to settings.

    Returns:
        The pools, in file order.

    Raises:
        ConfigurationError: the file is missing, does not parse, or a pool is invalid; the
            message names the file, the line and the field, and what a valid one looks like.
    """
    from sparkgpu._util.documents import parse_document

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read the pools file {str(path)!r} ({exc.strerror}); fix SPARKGPU_POOLS or unset it"
        ) from None
    data = parse_document(text, path, what="pools file")
    lines = _field_lines(text)
    where = str(path)

    def fail(problem: str, *key: str) -> ConfigurationError:
        line = lines.get(tuple(key)) or lines.get(tuple(key[:1]))
        at = f" line {line}" if line else ""
        return ConfigurationError(f"pools file {where!r}{at}: {problem}")

    unknown = sorted(set(data) - {"pools"})
    if unknown:
        raise fail(
            f"unknown top-level key(s) {', '.join(map(repr, unknown))}; the file holds one 'pools:' mapping, "
            f"e.g.\n{_EXAMPLE}",
            "",
            unknown[0],
        )
    entries = data.get("pools")
    if not isinstance(entries, dict) or not entries:
        raise fail(f"'pools:' must map pool names to their settings, e.g.\n{_EXAMPLE}")
    pools = [_parse_pool(str(name), settings, fail) for name, settings in entries.items()]
    seen: dict[str, str] = {}
    for pool in pools:
        for alias in filter(None, (pool.name, pool.pool_id)):
            if alias in seen and seen[alias] != pool.name:
                raise fail(
                    f"pool {pool.name!r}: {alias!r} is already the name or id of pool {seen[alias]!r}; names "
                    "and ids must be unique",
                    pool.name,
                    "id" if alias == pool.pool_id else "",
                )
            seen[alias] = pool.name
    return pools


def _parse_pool(name: str, settings, fail) -> Pool:
    if not isinstance(settings, dict):
        raise fail(f"pool {name!r} must be a mapping with url, gpu_type and gpus_per_node", name)
    unknown = sorted(set(map(str, settings)) - _FIELDS)
    if unknown:
        raise fail(
            f"pool {name!r} has unknown field(s) {', '.join(map(repr, unknown))}; "
            f"the fields are {', '.join(sorted(_FIELDS))}",
            name,
            unknown[0],
        )
    for required in ("url", "gpu_type", "gpus_per_node"):
        if settings.get(required) in (None, ""):
            raise fail(f"pool {name!r} needs {required}:, e.g.\n{_EXAMPLE}", name)
    url = settings["url"]
    if not isinstance(url, str) or not url.startswith("sc://"):
        raise fail(f"pool {name!r} url: {url!r} is not a Spark Connect URL; write sc://host:15002", name, "url")
    try:
        gpu_type = lookup_gpu_type(str(settings["gpu_type"])).name
    except ConfigurationError as exc:
        raise fail(f"pool {name!r} gpu_type: {exc}", name, "gpu_type") from None
    per_node = settings["gpus_per_node"]
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise fail(f"pool {name!r} gpus_per_node: {per_node!r} must be a positive integer", name, "gpus_per_node")
    reserved = settings.get("reserved", False)
    if not isinstance(reserved, bool):
        raise fail(f"pool {name!r} reserved: {reserved!r} must be true or false", name, "reserved")
    policy = settings.get("usage_policy")
    if policy is not None and not isinstance(policy, str):
        raise fail(f"pool {name!r} usage_policy: {policy!r} must be the path of a policy file", name, "usage_policy")
    pool_id = settings.get("id")
    return Pool(
        name=name,
        url=url,
        gpu_type=gpu_type,
        gpus_per_node=per_node,
        reserved=reserved,
        usage_policy=policy or None,
        pool_id=None if pool_id in (None, "") else str(pool_id),
    )


def configured_pools() -> list[Pool] | None:
    """The pools of ``SPARKGPU_POOLS``, or ``None`` when no pools file is configured."""
    from sparkgpu.config import settings

    path = settings().pools_path
    return load_pools(path) if path else None


def describe_pools(pools: Sequence[Pool]) -> str:
    return "; ".join(pool.describe() for pool in pools)


def choose_pool(
    resources: Resources, pool: str | None = None, *, pools: Sequence[Pool], reserved: bool | None = None
) -> Pool:
    """The pool a remote job runs on.

    Args:
        resources: What the job asks for (its ``gpu_type`` is required).
        pool: Name (or id) of the pool to use; ``None`` picks one by GPU type.
        pools: The pools that exist.
        reserved: ``True``: only reserved pools; ``False`` or ``None``: shared pools first,
            then reserved ones.

    Returns:
        The chosen pool.

    Raises:
        ConfigurationError: ``pool`` names no pool, or one with other GPUs than the job asks for.
        CapacityError: no pool has the job's GPU type; the message names every pool and its type.
    """
    gpu_type = resources.gpu_type
    if gpu_type is None:
        raise ConfigurationError("remote jobs need a gpu_type to choose a pool by, e.g. gpu_type='H100'")
    if pool is not None:
        named = next((p for p in pools if p.answers_to(pool)), None)
        if named is None:
            raise ConfigurationError(
                f"there is no pool {pool!r}; the pools are: {describe_pools(pools)} "
                "(fix pool=, SPARKGPU_POOL or DATABRICKS_REMOTE_GPU_POOL_ID)"
            )
        if gpu_type not in ("cpu", named.gpu_type):
            raise ConfigurationError(
                f"pool {named.name!r} has {named.gpu_type} GPUs and the job asks for "
                f"gpu_type={gpu_type!r}; ask for {named.gpu_type!r} or choose another pool "
                f"({describe_pools(pools)})"
            )
        return named
    if gpu_type == "cpu":
        fitting = [p for p in pools if p.gpu_type == "cpu"] or list(pools)  # CPU ranks run on any executor
    else:
        fitting = [p for p in pools if p.gpu_type == gpu_type]
    if reserved:
        fitting = [p for p in fitting if p.reserved]
    else:
        fitting = sorted(fitting, key=lambda p: p.reserved)  # stable: file order within each kind
    if not fitting:
        which = "reserved pool" if reserved else "pool"
        raise CapacityError(
            f"no {which} has {gpu_type} GPUs; the pools are: {describe_pools(pools)}. Ask for "
            "one of their GPU types, or add a pool to the pools file (SPARKGPU_POOLS)"
            + (", or unset SPARKGPU_USE_RESERVED_POOL / DATABRICKS_USE_RESERVED_GPU_POOL" if reserved else "")
        )
    return fitting[0]
