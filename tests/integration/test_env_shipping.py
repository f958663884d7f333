"""Jobs that ship their environment: staged on the client, rehydrated by `_air.py` on each rank."""

import json
import os

import pytest

from sparkgpu import WorkerFailedError, distributed, runtime
from sparkgpu.config import settings

pytestmark = pytest.mark.integration


@distributed(gpus=2, gpu_type="cpu", ship_environment=True)
def where_is_sparkgpu():
    import sparkgpu

    return runtime.get_global_rank(), sparkgpu.__file__


def test_a_shipping_job_runs_on_its_rehydrated_environment(workers_share_this_image, tmp_path):
    results = where_is_sparkgpu.distributed()
    assert [r[0] for r in results] == [0, 1]
    # sparkgpu is an editable install here, so it travels and the ranks import the shipped copy.
    assert all(str(tmp_path / "node-cache") in r[1] for r in results)
    run_dir = settings().staging_root / where_is_sparkgpu.last_job_id
    spec = json.loads((run_dir / "spec.json").read_text())
    assert spec["signed_files"] == ["_errors.py", "_hydrate.py"] and spec["env"]


def test_a_tampered_hydration_module_never_runs(workers_share_this_image, tmp_path):
    from sparkgpu.launch.client.supervisor import Supervisor

    prepared = where_is_sparkgpu.prepare((), {}).write()
    marker = tmp_path / "pwned"
    hydrate = prepared.run_dir.path / "_hydrate.py"
    hydrate.write_text(f"open({str(marker)!r}, 'w').write('x')\n" + hydrate.read_text())
    with pytest.raises(WorkerFailedError, match=r"PayloadSignatureError: refusing to run .*modified"):
        Supervisor(prepared.job, prepared.run_dir, prepared.backend, prepared.key, []).run()
    assert not marker.exists()


def _where_the_rank_came_from():
    import importlib

    import psutil

    import sparkgpu.launch.rank.entrypoint as entrypoint  # imported by the agent before the fork

    later = importlib.import_module("sparkgpu.predict.job")  # imported by no agent
    typing_extensions = importlib.import_module("typing_extensions")  # imported by torch in the agent
    return {
        "own_cmdline": psutil.Process().cmdline(),
        "agent_cmdline": psutil.Process(os.getppid()).cmdline(),
        "files": [entrypoint.__file__, later.__file__, entrypoint.__spec__.origin],
        "typing_extensions": typing_extensions.__file__,
        "patched": getattr(typing_extensions, "SHIPPED_BY_THE_TEST", False),
    }


def test_a_shipping_job_forks_its_ranks_where_the_overlay_holds_the_agents_modules(workers_share_this_image, tmp_path):
    """The workers run the client's image, so the shipped sparkgpu is the agent's byte for byte: the
    ranks are forked, and their modules are the overlay's, as a new interpreter's would be."""
    job = distributed(gpus=2, gpu_type="cpu", ship_environment=True, log_ranks=None)(_where_the_rank_came_from)
    ranks = job.distributed()
    assert len(ranks) == 2, ranks  # one answer per rank
    for seen in ranks:
        assert seen["own_cmdline"] == seen["agent_cmdline"], seen
        assert all(f.startswith(str(tmp_path / "node-cache")) for f in seen["files"]), seen
        assert not seen["patched"]


def test_a_module_the_agent_imported_otherwise_than_shipped_starts_new_interpreters(
    workers_share_this_image, tmp_path, monkeypatch
):
    """The job ships the working directory's typing_extensions (a changed copy); by the time the
    agent starts (in that directory, which its import path begins with) the file has changed
    again, and torch in the agent imports that one. A forked rank would run the agent's: the ranks
    start as new interpreters and import the shipped copy."""
    import typing_extensions

    from sparkgpu.launch.client.supervisor import Supervisor

    code = tmp_path / "code"
    code.mkdir()
    original = open(typing_extensions.__file__).read()
    (code / "typing_extensions.py").write_text(original + "\nSHIPPED_BY_THE_TEST = 'shipped'\n")
    monkeypatch.chdir(code)

    def where_the_rank_came_from():  # by value: the tests package stays behind with the old directory
        import psutil
        import typing_extensions

        return psutil.Process().cmdline(), getattr(typing_extensions, "SHIPPED_BY_THE_TEST", None)

    job = distributed(gpus=2, gpu_type="cpu", ship_environment=True, log_ranks=None)(where_the_rank_came_from)
    prepared = job.prepare((), {}).write()
    (code / "typing_extensions.py").write_text(original + "\nSHIPPED_BY_THE_TEST = 'edited later'\n")
    ranks = Supervisor(prepared.job, prepared.run_dir, prepared.backend, prepared.key, []).run()
    assert len(ranks) == 2, ranks  # one answer per rank
    for cmdline, shipped in ranks:
        assert cmdline[1:3] == ["-u", "-c"] and shipped == "shipped", (cmdline, shipped)
