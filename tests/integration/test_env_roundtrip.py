"""Environment shipping end to end with real virtual environments and real pip installs.

The client is a fresh venv into which pip installs locally built packages (a regular one, a
flat editable one, a src-layout editable one); the worker is another fresh venv with nothing
in it, not even sparkgpu: it runs only the standard-library hydrate module, copied next to
where a run directory would hold it.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from sparkgpu.env import stage_environment, worker_bootstrap_files

# One worker runs the module: its module-scoped fixtures (a reference run, built data) are built
# once, not once on every worker a test of it lands on.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("env-roundtrip")]

PY = f"python{sys.version_info.major}.{sys.version_info.minor}"
PYPROJECT = """\
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"
[project]
name = "{name}"
version = "{version}"
{extra}
"""


def make_project(root: Path, name: str, version: str, layout: str = "flat", scripts: bool = False) -> Path:
    project = root / name
    package = project / ("src" if layout == "src" else "") / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"VERSION = {version!r}\ndef hello():\n    return 'hello from {name}'\n")
    extra = f'[project.scripts]\n{name} = "{name}:hello"\n' if scripts else ""
    (project / "pyproject.toml").write_text(PYPROJECT.format(name=name, version=version, extra=extra))
    return project


def make_venv(path: Path) -> tuple[Path, Path]:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return path / "bin" / "python", path / "lib" / PY / "site-packages"


def pip_install(venv: Path, *args: str) -> None:
    """pip of this environment installs into ``venv``, building packages from source with setuptools."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--prefix",
            str(venv),
            "--no-index",
            "--no-deps",
            "--no-build-isolation",
            *args,
        ],
        check=True,
        capture_output=True,
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("env-world")
    projects = root / "projects"
    make_project(projects, "tinyalpha", "1.0", scripts=True)
    make_project(projects, "tinyedit", "0.3")
    make_project(projects, "tinysrc", "0.5", layout="src")
    make_project(projects, "tinybeta", "2.0")
    client_python, client_site = make_venv(root / "client")
    pip_install(
        root / "client", str(projects / "tinyalpha"), "-e", str(projects / "tinyedit"), "-e", str(projects / "tinysrc")
    )
    worker_python, _ = make_venv(root / "worker")
    notebook = root / "notebook"
    notebook.mkdir()
    (notebook / "usermod.py").write_text("VALUE = 'user code'\n")
    (notebook / ".git").mkdir()
    (notebook / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    runner = root / "rundir"
    runner.mkdir()
    for name, data in worker_bootstrap_files().items():  # what the launcher copies next to _air.py
        (runner / name).write_bytes(data)
    return {
        "root": root,
        "projects": projects,
        "client_python": client_python,
        "client_site": client_site,
        "worker_python": worker_python,
        "notebook": notebook,
        "hydrate": runner / "_hydrate.py",
    }


def stage(world, store: Path):
    return stage_environment(paths=[str(world["client_site"])], store=str(store))


def worker_hydrate(world, manifest: dict, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    path = cache.parent / f"manifest-{abs(hash(json.dumps(manifest, sort_keys=True)))}.json"
    path.write_text(json.dumps(manifest))
    return subprocess.run(
        [str(world["worker_python"]), "-I", str(world["hydrate"]), str(path), "--cache", str(cache), *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )


IMPORT_CHECK = textwrap.dedent("""
    import importlib.metadata as md, json, sys
    import tinyalpha, tinyedit, tinysrc, usermod
    print(json.dumps({
        "versions": {n: md.version(n) for n in ("tinyalpha", "tinyedit", "tinysrc")},
        "values": [tinyalpha.VERSION, tinyedit.VERSION, tinysrc.VERSION, usermod.VALUE],
        "files": [m.__file__ for m in (tinyalpha, tinyedit, tinysrc, usermod)],
    }))
""")


def import_on_worker(world, paths: list[str], check: str = IMPORT_CHECK) -> dict:
    """A fresh ``python -I`` on the bare worker with only the overlay added to its path."""
    code = f"import sys; sys.path[:0] = {paths!r}\n" + check
    result = subprocess.run([str(world["worker_python"]), "-I", "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_round_trip_to_a_bare_worker_then_only_changes_travel(world, tmp_path, monkeypatch):
    monkeypatch.chdir(world["notebook"])
    store, cache = tmp_path / "store", tmp_path / "cache"

    first = stage(world, store)
    assert sorted(first.report.uploaded) == ["code", "tinyalpha", "tinyedit", "tinysrc"]
    assert "tinyedit==0.3  # editable: file://" in first.lock and "tinyalpha==1.0\n" in first.lock
    result = worker_hydrate(world, first.manifest, cache)
    assert result.returncode == 0, result.stderr
    hydrated = json.loads(result.stdout)
    assert sorted(hydrated["report"]["extracted"]) == ["code", "tinyalpha", "tinyedit", "tinysrc"]

    seen = import_on_worker(world, hydrated["paths"])
    assert seen["versions"] == {"tinyalpha": "1.0", "tinyedit": "0.3", "tinysrc": "0.5"}
    assert seen["values"] == ["1.0", "0.3", "0.5", "user code"]
    assert all(f.startswith(str(cache)) for f in seen["files"]), seen["files"]  # nothing read from the client's paths
    # Subprocesses inherit the overlay through PYTHONPATH alone.
    inherited = subprocess.run(
        [str(world["worker_python"]), "-c", IMPORT_CHECK],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": hydrated["pythonpath"], "PATH": os.environ["PATH"]},
        timeout=60,
    )
    assert inherited.returncode == 0, inherited.stderr
    assert json.loads(inherited.stdout)["versions"] == seen["versions"]

    second = stage(world, store)
    assert second.report.uploaded_bytes == 0 and second.report.uploaded == ()
    assert second.report.step("hash").items == 0  # the pack index knew every blob
    assert second.report.skipped_bytes == first.report.step("upload").bytes

    pip_install(world["root"] / "client", str(world["projects"] / "tinybeta"))
    third = stage(world, store)
    assert third.report.uploaded == ("tinybeta",)
    beta = next(e for e in third.manifest["entries"] if e["name"] == "tinybeta")
    assert third.report.step("upload").bytes == (store / beta["object"]).stat().st_size
    result = worker_hydrate(world, third.manifest, cache)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["report"]["extracted"] == ["tinybeta"]

    # An edit of the editable project travels without a version bump or reinstall.
    init = world["projects"] / "tinyedit" / "tinyedit" / "__init__.py"
    init.write_text(init.read_text().replace("VERSION = '0.3'", "VERSION = '0.3-edited'"))
    fourth = stage(world, store)
    assert fourth.report.uploaded == ("tinyedit",)
    result = worker_hydrate(world, fourth.manifest, cache)
    assert json.loads(result.stdout)["report"]["extracted"] == ["tinyedit"]
    assert import_on_worker(world, json.loads(result.stdout)["paths"])["values"][1] == "0.3-edited"
    init.write_text(init.read_text().replace("0.3-edited", "0.3"))


def test_ranks_on_one_node_share_the_cache(world, tmp_path, monkeypatch):
    monkeypatch.chdir(world["notebook"])
    staged = stage(world, tmp_path / "store")
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(staged.manifest))
    cache = tmp_path / "cache"
    ranks = [
        subprocess.Popen(
            [str(world["worker_python"]), "-I", str(world["hydrate"]), str(manifest), "--cache", str(cache)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0] * 4, [err for _, err in outputs]
    reports = [json.loads(out) for out, _ in outputs]
    assert len({tuple(r["paths"]) for r in reports}) == 1
    extracted = sorted(name for r in reports for name in r["report"]["extracted"])
    assert extracted == sorted(e["name"] for e in staged.manifest["entries"])  # each blob extracted exactly once
    assert os.listdir(cache / "env" / ".tmp") == []
    assert import_on_worker(world, reports[0]["paths"])["values"][3] == "user code"


def test_worker_with_another_python_refuses_before_extracting(world, tmp_path, monkeypatch):
    monkeypatch.chdir(world["notebook"])
    manifest = dict(stage(world, tmp_path / "store").manifest)
    manifest["client"] = dict(manifest["client"], python="3.8.18")
    result = worker_hydrate(world, manifest, tmp_path / "cache")
    assert result.returncode == 2
    assert "EnvironmentMismatchError" in result.stderr and "Python 3.8.18" in result.stderr
    assert f"Python {sys.version_info.major}.{sys.version_info.minor}" in result.stderr
    assert not (tmp_path / "cache" / "env").exists()


def test_probe_of_the_worker_drives_what_is_shipped(world, tmp_path, monkeypatch):
    monkeypatch.chdir(world["notebook"])
    probe = subprocess.run(
        [str(world["client_python"]), "-I", str(world["hydrate"]), "--probe"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    image = tmp_path / "image.json"
    image.write_text(probe.stdout)  # a worker image that has the client's packages already
    assert json.loads(probe.stdout)["packages"]["tinyalpha"] == "1.0"
    staged = stage_environment(paths=[str(world["client_site"])], store=str(tmp_path / "store"), worker_has=image)
    shipped = sorted(e["name"] for e in staged.manifest["entries"])
    assert "tinyalpha" not in shipped and {"tinyedit", "tinysrc", "code"} <= set(shipped)  # editables always travel
    assert any(
        e["name"] == "tinyalpha" and "the workers have tinyalpha==1.0" == e["reason"]
        for e in staged.manifest["excluded"]
    )


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_workers_fetch_blobs_from_an_http_store(world, tmp_path, monkeypatch):
    monkeypatch.chdir(world["notebook"])
    store = tmp_path / "store"
    staged = stage(world, store)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(store)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        result = worker_hydrate(world, staged.manifest, tmp_path / "cache", "--store", url)
        assert result.returncode == 0, result.stderr
        hydrated = json.loads(result.stdout)
        assert hydrated["report"]["fetched_bytes"] == sum(e["tar_bytes"] for e in staged.manifest["entries"])
        assert import_on_worker(world, hydrated["paths"])["values"][0] == "1.0"
    finally:
        server.shutdown()
        server.server_close()
