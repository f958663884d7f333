"""Reading the small TOML / YAML / JSON documents users write: policies, rate cards, job files."""

from __future__ import annotations

import sys
from pathlib import Path

from sparkgpu.errors import ConfigurationError

__all__ = ["parse_document"]


def parse_document(text: str, path: Path, *, what: str) -> dict:
    """Parses ``text`` as TOML (``.toml``) or YAML (anything else; JSON is YAML too).

    Raises:
        ConfigurationError: the text does not parse or its top level is not a mapping; the
            message names the file and the line the parser stopped at.
    """
    if path.suffix.lower() == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # the same parser, from PyPI, before it joined the standard library
            import tomli as tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigurationError(f"{what} {str(path)!r} is not valid TOML: {exc}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigurationError(f"{what} {str(path)!r} is not valid YAML{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigurationError(
            f"{what} {str(path)!r} must hold a mapping of settings at its top level, got {type(data).__name__}"
        )
    return data
