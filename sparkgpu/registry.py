"""The model registry under its short name: ``import sparkgpu.registry`` or ``from sparkgpu import registry``.

The same functions as :mod:`sparkgpu.tracking.registry`, where they are documented::

    import sparkgpu.registry
    sparkgpu.registry.register(model, "main.ml.ctr", alias="champion")
"""

from __future__ import annotations

from sparkgpu.tracking.registry import (
    ModelVersionInfo,
    aliases,
    delete_alias,
    get_version,
    load,
    load_checkpoint_into,
    register,
    set_alias,
    set_tags,
    versions,
)

__all__ = [
    "ModelVersionInfo",
    "register",
    "load",
    "get_version",
    "versions",
    "aliases",
    "set_alias",
    "delete_alias",
    "set_tags",
    "load_checkpoint_into",
]
