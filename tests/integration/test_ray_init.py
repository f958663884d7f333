"""`ray_init` in a notebook-like process: a real single-node Ray cluster, started once, joined again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

pytest.importorskip("ray", reason="ray_init needs ray: pip install 'sparkgpu[ray]'")

# One worker runs the Ray tests: they look for Ray processes and temp dirs machine-wide.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300), pytest.mark.xdist_group("ray")]

NOTEBOOK = textwrap.dedent("""
    import json, sys
    import ray
    from sparkgpu import ray_init

    context = ray_init(num_cpus=1, include_dashboard=True, dashboard_port=0, _node_ip_address="127.0.0.1",
                       _temp_dir=sys.argv[1])

    @ray.remote
    def square(x):
        return x * x

    squares = ray.get([square.remote(i) for i in range(4)])
    again = ray_init()  # the same cell run again
    report = {"squares": squares, "dashboard": context.dashboard_url,
              "gcs": context.address_info["gcs_address"], "gcs_again": again.address_info["gcs_address"]}
    ray.shutdown()
    print("REPORT " + json.dumps(report))
""")


def test_ray_init_starts_a_local_cluster_with_its_dashboard_on_loopback_and_rejoins_it(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # A local ray.init writes an auth token to ~/.ray, which later `ray start` clusters on the
    # host would then demand: the notebook gets a home of its own.
    monkeypatch.setenv("HOME", str(tmp_path))
    temp_dir = tempfile.mkdtemp(prefix="rayi-")  # Ray's socket paths must stay under 108 bytes
    try:
        proc = subprocess.run([sys.executable, "-c", NOTEBOOK, temp_dir], capture_output=True, text=True, timeout=240)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.split("REPORT ", 1)[1])
    assert report["squares"] == [0, 1, 4, 9]
    assert report["gcs_again"] == report["gcs"]  # a second call joins, it starts no second cluster
    assert report["dashboard"].startswith("127.0.0.1:")  # reachable from this host only
