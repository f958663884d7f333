"""The model registry under its short name: ``import sparkgpu.registry`` or ``from sparkgpu import registry``.

The same functions as :mod:`sparkgpu.tracking.registry`, where they are documented::

    import sparkgpu.registry
    sparkgpu.registry.register(model, "main.ml.ctr", alias="champion")
"""

from __future__ import annotations

from sparkgpu.tracking.registry import *  # noqa: F403 - this module is that one's public names, under a short name
from sparkgpu.tracking.registry import __all__  # noqa: F401
