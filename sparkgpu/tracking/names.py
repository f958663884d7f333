"""Three-level model names (``catalog.schema.model``) with Unity Catalog's rules.

Rules checked for each level: not empty; at most 255 characters; lowercase (Unity Catalog
stores names lowercase, so ``Main.ML.ctr`` and ``main.ml.ctr`` would be the same model); no
period, space, forward slash or ASCII control character. Every violation raises a
:class:`~sparkgpu.errors.ConfigurationError` that names the rule and suggests a valid name.

A name of one or two levels is completed from the active Spark session
(``spark.catalog.currentCatalog()`` / ``currentDatabase()``), or, without one, from the
settings ``SPARKGPU_REGISTRY_CATALOG`` (default ``main``) and ``SPARKGPU_REGISTRY_SCHEMA``
(default ``default``). :attr:`ModelName.completed_from` says which.

Model references add a version or an alias: ``main.ml.ctr/3``, ``main.ml.ctr@champion``.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import urllib.parse

from sparkgpu.errors import ConfigurationError

__all__ = [
    "ModelName",
    "ModelRef",
    "parse_model_name",
    "parse_model_ref",
    "validate_alias",
    "encode_for_store",
    "decode_from_store",
]

MAX_LEVEL_CHARS = 255
_LEVELS = ("catalog", "schema", "model")
_ALIAS = re.compile(r"^[A-Za-z0-9_-]+$")
# Characters a level may hold under Unity Catalog's rules that MLflow's own registry refuses
# (":") or that would break ``models:/<name>@<alias>`` URIs; percent-encoded in that registry.
_UNSAFE_FOR_MLFLOW = set("%:@#?\\'\"")


@dataclasses.dataclass(frozen=True)
class ModelName:
    """A validated ``catalog.schema.model`` name.

    Attributes:
        catalog: First level.
        schema: Second level.
        model: Third level.
        completed_from: ``"name"`` when all three levels were given, ``"spark session"`` or
            ``"settings"`` when missing levels were filled in from there.
    """

    catalog: str
    schema: str
    model: str
    completed_from: str = "name"

    def __str__(self) -> str:
        return f"{self.catalog}.{self.schema}.{self.model}"


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """A model name with at most one of a version and an alias (neither: the latest version)."""

    name: ModelName
    version: int | None = None
    alias: str | None = None

    def __str__(self) -> str:
        if self.version is not None:
            return f"{self.name}/{self.version}"
        if self.alias is not None:
            return f"{self.name}@{self.alias}"
        return str(self.name)


def _suggest_level(level: str) -> str:
    fixed = "".join("_" if (ch in " ./" or ord(ch) < 32 or ord(ch) == 127) else ch for ch in level.lower())
    return fixed[:MAX_LEVEL_CHARS] or "model"


def _check_level(kind: str, level: str, levels: list[str], index: int) -> None:
    def fail(rule: str):
        fixed = list(levels)
        fixed[index] = _suggest_level(level)
        raise ConfigurationError(
            f"model name {'.'.join(levels)!r}: the {kind} level {level!r} {rule}; use a name like {'.'.join(fixed)!r}"
        )

    if not level:
        raise ConfigurationError(
            f"model name {'.'.join(levels)!r} has an empty {kind} level; write it as catalog.schema.model, "
            f"e.g. 'main.ml.ctr'"
        )
    if len(level) > MAX_LEVEL_CHARS:
        fail(f"is {len(level)} characters long, more than Unity Catalog's limit of {MAX_LEVEL_CHARS}")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in level):
        fail("contains a control character, which Unity Catalog does not allow in names")
    if " " in level:
        fail("contains a space, which Unity Catalog does not allow in names")
    if "/" in level:
        fail("contains a forward slash, which Unity Catalog does not allow in names")
    if level != level.lower():
        fail("has uppercase letters; Unity Catalog names are lowercase")


def _active_spark_session():
    if "pyspark" not in sys.modules:  # no session can be active without pyspark imported
        return None
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    if session is None and "pyspark.sql.connect.session" in sys.modules:
        from pyspark.sql.connect.session import SparkSession as ConnectSession

        session = ConnectSession.getActiveSession()
    return session


def parse_model_name(name: str, *, spark=None) -> ModelName:
    """Validates ``name`` and completes it to three levels.

    Args:
        name: ``"catalog.schema.model"``, ``"schema.model"`` or ``"model"``.
        spark: Session whose current catalog and schema complete short names; by default
            the active one, if any.

    Raises:
        ConfigurationError: the name breaks a rule; the message names it and suggests a fix.
    """
    if not isinstance(name, str) or not name.strip():
        raise ConfigurationError(f"a model name must be a string like 'main.ml.ctr', got {name!r}")
    levels = name.split(".")
    if len(levels) > 3:
        suggestion = ".".join(levels[:2] + ["_".join(levels[2:])]).lower()
        raise ConfigurationError(
            f"model name {name!r} has {len(levels)} levels; names have at most three (catalog.schema.model) "
            f"and a period cannot appear inside a level. Use a name like {suggestion!r}"
        )
    completed_from = "name"
    if len(levels) < 3:
        session = spark if spark is not None else _active_spark_session()
        if session is not None:
            defaults = [session.catalog.currentCatalog(), session.catalog.currentDatabase()]
            completed_from = "spark session"
        else:
            from sparkgpu.config import settings

            defaults = [settings().registry_catalog, settings().registry_schema]
            completed_from = "settings"
        levels = defaults[: 3 - len(levels)] + levels
    for index, (kind, level) in enumerate(zip(_LEVELS, levels)):
        _check_level(kind, level, levels, index)
    catalog, schema, model = levels  # three, once completed and checked
    return ModelName(catalog, schema, model, completed_from=completed_from)


def validate_alias(alias: str) -> str:
    """Checks an alias against MLflow's rules (letters, digits, ``_`` and ``-``; not
    ``latest``, not ``v<number>``) and returns it.

    Raises:
        ConfigurationError: the alias breaks a rule.
    """
    if not isinstance(alias, str) or not _ALIAS.match(alias) or len(alias) > MAX_LEVEL_CHARS:
        suggestion = re.sub(r"[^A-Za-z0-9_-]+", "_", str(alias)).strip("_")[:MAX_LEVEL_CHARS] or "champion"
        raise ConfigurationError(
            f"alias {alias!r} may only hold letters, digits, '_' and '-' (at most {MAX_LEVEL_CHARS}); "
            f"use e.g. {suggestion!r}"
        )
    if alias.lower() == "latest" or re.fullmatch(r"[vV]\d+", alias):
        raise ConfigurationError(
            f"alias {alias!r} is reserved (it names the latest version or a version number); "
            "choose another, e.g. 'champion'"
        )
    return alias


def parse_model_ref(ref: str, *, spark=None) -> ModelRef:
    """Parses ``name``, ``name/<version>`` or ``name@<alias>`` (``models:/`` prefix allowed).

    Raises:
        ConfigurationError: the name, version or alias is invalid.
    """
    if not isinstance(ref, str):
        raise ConfigurationError(f"a model reference must be a string like 'main.ml.ctr@champion', got {ref!r}")
    text = ref[len("models:/") :] if ref.startswith("models:/") else ref
    version = alias = None
    if "@" in text:
        text, alias = text.rsplit("@", 1)
        validate_alias(alias)
    elif "/" in text:
        text, raw_version = text.rsplit("/", 1)
        if not raw_version.isdigit() or int(raw_version) < 1:
            raise ConfigurationError(
                f"{ref!r}: the version after '/' must be a positive integer, as in 'main.ml.ctr/3'"
            )
        version = int(raw_version)
    return ModelRef(parse_model_name(text, spark=spark), version, alias)


def encode_for_store(name: ModelName, unity_catalog: bool) -> str:
    """The registered-model name to use in the registry.

    Unity Catalog registries take the three-level name as it is. MLflow's own registry gets
    the same dotted name with the few characters it refuses (or that break model URIs)
    percent-encoded, so that :func:`decode_from_store` gives the levels back exactly.
    """
    if unity_catalog:
        return str(name)

    def encode(level: str) -> str:
        return "".join(f"%{ord(ch):02X}" if ch in _UNSAFE_FOR_MLFLOW else ch for ch in level)

    return ".".join(encode(level) for level in (name.catalog, name.schema, name.model))


def decode_from_store(stored: str) -> str:
    """Inverse of :func:`encode_for_store`: the three-level name of a registered model."""
    return ".".join(urllib.parse.unquote(level) for level in stored.split("."))
