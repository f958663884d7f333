"""A fixture wider than one test runs its job in a home of its own.

Every test gets its own ``SPARKGPU_HOME`` (tests/conftest.py), but a module- or session-scoped
fixture runs before that and outlives it: :func:`home_of_its_own` gives it one, with the
settings read again on the way in and out.
"""

from __future__ import annotations

import contextlib

import pytest

__all__ = ["home_of_its_own"]


@contextlib.contextmanager
def home_of_its_own(tmp_path_factory, *, cwd: bool = False):
    """While inside: ``SPARKGPU_HOME`` a new folder (and, with ``cwd``, a new working folder)."""
    from sparkgpu.config import reset_settings

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SPARKGPU_HOME", str(tmp_path_factory.mktemp("home")))
            if cwd:
                mp.chdir(tmp_path_factory.mktemp("cwd"))
            reset_settings()
            yield
    finally:
        reset_settings()
