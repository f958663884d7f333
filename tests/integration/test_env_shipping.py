"""Jobs that ship their environment: staged on the client, rehydrated by `_air.py` on each rank."""

import json

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
