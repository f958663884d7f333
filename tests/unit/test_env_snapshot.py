"""What a snapshot ships: distributions, editable installs, the caller's code, exclusions."""

from __future__ import annotations

import json
import logging

import pytest

from sparkgpu.env import check_compatibility, parse_worker_has, snapshot_environment
from sparkgpu.errors import ConfigurationError, EnvironmentMismatchError
from tests.unit.test_env_support import arcnames, by_name, write_dist


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty working directory: no code component unless a test adds one
    return tmp_path / "venv" / "lib" / "python3.11" / "site-packages"


def write_torch(site, version="2.14.1", cuda="12.6"):
    write_dist(
        site,
        "torch",
        version,
        {
            "torch/__init__.py": "",
            "torch/version.py": f"from typing import Optional\n__version__ = '{version}'\ncuda: Optional[str] = {cuda!r}\n",
        },
        tag="cp311-cp311-linux_x86_64",
    )


def test_distribution_ships_its_site_files_but_not_bytecode_or_scripts(site):
    write_dist(
        site,
        "alpha",
        "1.0",
        {"alpha/__init__.py": "X = 1", "alpha/data.json": "{}"},
        extra_record=("../../../bin/alpha", "alpha/__pycache__/__init__.cpython-311.pyc"),
    )
    snap = snapshot_environment(paths=[str(site)])
    alpha = by_name(snap)["alpha"]
    assert alpha.version == "1.0" and alpha.kind == "site" and alpha.pure is True
    assert arcnames(alpha) == [
        "site/alpha-1.0.dist-info/METADATA",
        "site/alpha-1.0.dist-info/RECORD",
        "site/alpha-1.0.dist-info/WHEEL",
        "site/alpha/__init__.py",
        "site/alpha/data.json",
    ]
    assert alpha.size == sum((site / a.removeprefix("site/")).stat().st_size for a in arcnames(alpha))
    assert [c.name for c in snap.components] == ["alpha"]  # the empty cwd adds no code component


def test_first_distribution_on_the_path_wins_as_for_imports(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, second = tmp_path / "first", tmp_path / "second"
    write_dist(first, "alpha", "2.0", {"alpha/__init__.py": "X = 2"})
    write_dist(second, "alpha", "1.0", {"alpha/__init__.py": "X = 1"})
    snap = snapshot_environment(paths=[str(first), str(second)])
    assert [(c.name, c.version, c.kind) for c in snap.components] == [("alpha", "2.0", "path")]


def test_lock_lists_every_distribution_and_marks_editables(site, tmp_path):
    write_dist(site, "Alpha_Pkg", "1.0", {"alpha_pkg.py": ""})
    project = tmp_path / "proj"
    (project / "src" / "beta").mkdir(parents=True)
    (project / "src" / "beta" / "__init__.py").write_text("")
    write_dist(
        site,
        "beta",
        "0.1",
        {"__editable__.beta-0.1.pth": f"{project / 'src'}\n"},
        direct_url={"url": project.as_uri(), "dir_info": {"editable": True}},
    )
    snap = snapshot_environment(paths=[str(site)], exclude=["alpha-pkg"])
    lines = snap.lock.splitlines()
    assert lines[0].startswith("# python ")
    assert lines[1:] == ["Alpha_Pkg==1.0", f"beta==0.1  # editable: {project.as_uri()}"]
    assert [e.name for e in snap.excluded] == ["Alpha_Pkg"]  # excluded, still in the lock


def test_path_style_editable_ships_its_source_tree_not_its_pth(site, tmp_path):
    project = tmp_path / "proj"
    (project / "src" / "beta" / "__pycache__").mkdir(parents=True)
    (project / "src" / "beta" / "__init__.py").write_text("VALUE = 1")
    (project / "src" / "beta" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"x")
    write_dist(
        site,
        "beta",
        "0.1",
        {"__editable__.beta-0.1.pth": f"{project / 'src'}\n"},
        direct_url={"url": project.as_uri(), "dir_info": {"editable": True}},
    )
    beta = by_name(snapshot_environment(paths=[str(site)]))["beta"]
    assert beta.kind == "editable" and beta.paths == 1
    assert "path/0/beta/__init__.py" in arcnames(beta)
    assert not any(".pth" in a or "__pycache__" in a for a in arcnames(beta))


def test_finder_style_editable_ships_mapped_packages_into_site(site, tmp_path):
    project = tmp_path / "proj"
    (project / "gamma").mkdir(parents=True)
    (project / "gamma" / "__init__.py").write_text("VALUE = 3")
    (project / "gamma" / "scratch.log").write_text("junk")
    (project / ".gitignore").write_text("# local files\n*.log\n")
    finder = f"MAPPING: dict[str, str] = {{'gamma': {str(project / 'gamma')!r}}}\nNAMESPACES = {{}}\n"
    write_dist(
        site,
        "gamma",
        "0.3",
        {
            "__editable__.gamma-0.3.pth": "import __editable___gamma_0_3_finder; __editable___gamma_0_3_finder.install()",
            "__editable___gamma_0_3_finder.py": finder,
        },
        direct_url={"url": project.as_uri(), "dir_info": {"editable": True}},
    )
    gamma = by_name(snapshot_environment(paths=[str(site)]))["gamma"]
    assert gamma.kind == "editable" and gamma.paths == 0
    assert arcnames(gamma) == [
        "site/gamma-0.3.dist-info/METADATA",
        "site/gamma-0.3.dist-info/RECORD",
        "site/gamma-0.3.dist-info/WHEEL",
        "site/gamma-0.3.dist-info/direct_url.json",
        "site/gamma/__init__.py",
    ]


def test_distribution_without_record_walks_top_level_or_is_skipped_with_a_warning(site, caplog):
    write_dist(
        site, "legacy", "0.9", {"legacy/__init__.py": "", "legacy/sub/m.py": ""}, record=False, top_level=["legacy"]
    )
    write_dist(site, "opaque", "1.2", {"opaque_mod.py": ""}, record=False)
    with caplog.at_level(logging.WARNING, logger="sparkgpu.env.snapshot"):
        snap = snapshot_environment(paths=[str(site)])
    legacy = by_name(snap)["legacy"]
    assert {"site/legacy/__init__.py", "site/legacy/sub/m.py", "site/legacy-0.9.dist-info/METADATA"} <= set(
        arcnames(legacy)
    )
    assert "opaque" not in by_name(snap)
    assert any("opaque==1.2" in w and "not shipped" in w for w in snap.warnings)
    assert "opaque==1.2" in caplog.text


def test_exclude_by_name_and_pattern(site):
    for name in ("nvidia-cublas-cu12", "nvidia-nccl-cu12", "Keep_Me"):
        write_dist(site, name, "1.0", {f"{name.lower()}.py": ""})
    snap = snapshot_environment(paths=[str(site)], exclude=["nvidia-*"])
    assert [c.name for c in snap.components] == ["Keep_Me"]
    assert {e.reason for e in snap.excluded} == {"excluded by name (nvidia-*)"}
    assert [c.name for c in snapshot_environment(paths=[str(site)], exclude="keep.me").components] == [
        "nvidia-cublas-cu12",
        "nvidia-nccl-cu12",
    ]


def test_what_the_workers_have_at_the_same_version_is_not_shipped(site):
    write_dist(site, "alpha", "1.0", {"alpha.py": ""})
    write_dist(site, "beta", "2.0", {"beta.py": ""})
    snap = snapshot_environment(paths=[str(site)], worker_has="alpha==1.0\nbeta==1.9  # older on the image\n")
    assert [c.name for c in snap.components] == ["beta"]
    assert [(e.name, e.reason) for e in snap.excluded] == [("alpha", "the workers have alpha==1.0")]


def test_workers_gpu_stack_is_used_instead_of_the_clients(site):
    write_torch(site, "2.14.1", "12.6")
    write_dist(site, "nvidia-cudnn-cu12", "9.1", {"nvidia/cudnn/lib.so": b"\0" * 10}, tag="py3-none-manylinux1_x86_64")
    write_dist(site, "alpha", "1.0", {"alpha.py": ""})
    snap = snapshot_environment(paths=[str(site)], worker_has={"torch": "2.14.0", "nvidia-cudnn-cu12": "9.0"})
    assert [c.name for c in snap.components] == ["alpha"]
    assert {e.name: e.reason for e in snap.excluded} == {
        "torch": "the workers' own GPU stack is used (torch==2.14.0)",
        "nvidia-cudnn-cu12": "the workers' own GPU stack is used (nvidia-cudnn-cu12==9.0)",
    }


def test_other_torch_minor_on_the_workers_is_refused_before_anything_ships(site):
    write_torch(site, "2.14.1", "12.6")
    with pytest.raises(EnvironmentMismatchError) as err:
        snapshot_environment(paths=[str(site)], worker_has=["torch==2.13.0"])
    message = str(err.value)
    assert "torch 2.14.1" in message and "torch 2.13.0" in message and "pip install 'torch==2.13.*'" in message


def test_probe_of_workers_with_another_python_is_refused(site, tmp_path):
    write_dist(site, "alpha", "1.0", {"alpha.py": ""})
    probe = tmp_path / "worker.json"
    probe.write_text(json.dumps({"python": "3.9.18", "platform": "linux-x86_64", "torch": None, "packages": {}}))
    with pytest.raises(EnvironmentMismatchError, match=r"Python 3\.9\.18.*Python 3\.9"):
        snapshot_environment(paths=[str(site)], worker_has=probe)


def test_parse_worker_has_accepts_locks_mappings_and_probes(tmp_path):
    lock = tmp_path / "image.lock"
    lock.write_text("# worker image\nTorch==2.14.1\nnumpy == 2.1.3  # pinned\n\n")
    assert parse_worker_has(lock) == ({"torch": "2.14.1", "numpy": "2.1.3"}, None)
    assert parse_worker_has({"Foo_Bar": "1"}) == ({"foo-bar": "1"}, None)
    packages, interpreter = parse_worker_has({"python": "3.11.7", "packages": {"six": "1.17.0"}})
    assert packages == {"six": "1.17.0"} and interpreter == {"python": "3.11.7"}
    with pytest.raises(ConfigurationError, match="'numpy>=2' is not 'name==version'"):
        parse_worker_has(["numpy>=2"])
    with pytest.raises(ConfigurationError, match="not a file"):
        parse_worker_has(tmp_path / "missing.lock")


def test_working_directory_modules_travel_without_junk(site, tmp_path):
    (tmp_path / "train_utils.py").write_text("def f(): return 1")
    (tmp_path / "mypkg" / "sub").mkdir(parents=True)
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "sub" / "model.py").write_text("")
    (tmp_path / "mypkg" / "weights.bin").write_bytes(b"\0" * 2048)
    (tmp_path / "mypkg" / "secret.cfg").write_text("token")
    (tmp_path / "mypkg" / "__pycache__").mkdir()
    (tmp_path / "mypkg" / "__pycache__" / "x.pyc").write_bytes(b"x")
    (tmp_path / "notes").mkdir()  # not a package: not importable by its name
    (tmp_path / "notes" / "todo.py").write_text("")
    (tmp_path / ".git").mkdir()
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "pyvenv.cfg").write_text("")
    (tmp_path / "env" / "__init__.py").write_text("")
    (tmp_path / "2023-report.py").write_text("")  # not an importable module name
    (tmp_path / ".gitignore").write_text("secret.cfg\n")
    snap = snapshot_environment(paths=[str(site)], max_code_file_bytes=1024)
    code = by_name(snap)["code"]
    assert code.kind == "code" and code.paths == 1 and snap.components[0] is code
    assert arcnames(code) == ["path/0/mypkg/__init__.py", "path/0/mypkg/sub/model.py", "path/0/train_utils.py"]
    assert any("weights.bin" in w and "max_code_file_bytes" in w for w in snap.warnings)


def test_explicit_code_paths(site, tmp_path):
    (tmp_path / "lib" / "helpers").mkdir(parents=True)
    (tmp_path / "lib" / "helpers" / "__init__.py").write_text("")
    (tmp_path / "job.py").write_text("")
    (tmp_path / "other.py").write_text("")
    code = by_name(snapshot_environment(paths=[str(site)], code_paths=["lib/helpers", tmp_path / "job.py"]))["code"]
    assert arcnames(code) == ["path/0/helpers/__init__.py", "path/0/job.py"]
    assert "code" not in by_name(snapshot_environment(paths=[str(site)], code_paths=[]))
    with pytest.raises(ConfigurationError, match="'nope' does not exist"):
        snapshot_environment(paths=[str(site)], code_paths=["nope"])
    (tmp_path / "lib" / "job.py").write_text("")
    with pytest.raises(ConfigurationError, match="several entries named job.py"):
        snapshot_environment(paths=[str(site)], code_paths=["job.py", "lib/job.py"])


def test_editable_project_as_working_directory_is_not_shipped_twice(site, tmp_path):
    (tmp_path / "gamma").mkdir()
    (tmp_path / "gamma" / "__init__.py").write_text("")
    finder = f"MAPPING = {{'gamma': {str(tmp_path / 'gamma')!r}}}\n"
    write_dist(
        site,
        "gamma",
        "0.3",
        {
            "__editable__.gamma-0.3.pth": "import __editable___gamma_0_3_finder; __editable___gamma_0_3_finder.install()",
            "__editable___gamma_0_3_finder.py": finder,
        },
        direct_url={"url": tmp_path.as_uri(), "dir_info": {"editable": True}},
    )
    assert [c.name for c in snapshot_environment(paths=[str(site)]).components] == ["gamma"]


@pytest.mark.parametrize(
    "client, worker, expected",
    [
        ({"python": "3.11.7"}, {"python": "3.11.2"}, []),
        ({"python": "3.11.7"}, {"python": "3.12.1"}, ["Python 3.11.7", "Python 3.12.1", "Python 3.12"]),
        (
            {"torch": "2.14.1", "torch_cuda": None},
            {"torch": "2.14.0", "torch_cuda": "12.6"},
            [],
        ),  # CPU client, GPU workers
        (
            {"torch": "2.14.1", "torch_cuda": "12.6"},
            {"torch": "2.14.1", "torch_cuda": "13.0"},
            ["CUDA 12.6", "CUDA 13.0", "--index-url https://download.pytorch.org/whl/cu130"],
        ),
        ({"torch": "2.14.1"}, {"torch": None}, []),  # the client's torch is shipped
    ],
)
def test_compatibility_messages_name_both_sides_and_the_fix(client, worker, expected):
    problems = check_compatibility(client, worker)
    assert bool(problems) == bool(expected)
    for part in expected:
        assert part in problems[0]


def test_platform_only_matters_for_native_code():
    client, worker = {"platform": "macosx-14.0-arm64"}, {"platform": "linux-x86_64"}
    assert check_compatibility(client, worker, native=[]) == []
    (problem,) = check_compatibility(client, worker, native=["numpy", "pyarrow"])
    assert "macosx-14.0-arm64" in problem and "linux-x86_64" in problem and "numpy, pyarrow" in problem


def test_build_metadata_in_the_working_directory_does_not_shadow_the_install(site, tmp_path):
    (tmp_path / "gamma").mkdir()
    (tmp_path / "gamma" / "__init__.py").write_text("")
    (tmp_path / "gamma.egg-info").mkdir()  # left by `setup.py egg_info` / a build
    (tmp_path / "gamma.egg-info" / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: gamma\nVersion: 0.0.dev0\n")
    (tmp_path / "gamma.egg-info" / "SOURCES.txt").write_text("gamma/__init__.py\n")
    finder = f"MAPPING = {{'gamma': {str(tmp_path / 'gamma')!r}}}\n"
    write_dist(
        site,
        "gamma",
        "0.3",
        {
            "__editable__.gamma-0.3.pth": "import __editable___gamma_0_3_finder; __editable___gamma_0_3_finder.install()",
            "__editable___gamma_0_3_finder.py": finder,
        },
        direct_url={"url": tmp_path.as_uri(), "dir_info": {"editable": True}},
    )
    snap = snapshot_environment(paths=["", str(tmp_path), str(site)])
    assert [(c.name, c.version, c.kind) for c in snap.components] == [("gamma", "0.3", "editable")]
