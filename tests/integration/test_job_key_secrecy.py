"""A running job's key is in no process's environment or command line, on every path that starts ranks.

A co-tenant of the same user reads ``/proc/<pid>/environ`` and ``/proc/<pid>/cmdline`` of any
process for as long as it runs (``ps e``). The job's rank 0, once every rank is up, scans them
all as such a co-tenant would; the test then looks for the key (from the client's keyring) in
what it found. Each rank also checks that its key file is gone.
"""

from __future__ import annotations

import pytest

from sparkgpu import distributed
from sparkgpu.launch.backends.local.backend import LocalBackend
from sparkgpu.rundir.keyring import load_key


def scan_for_secrets(out_path: str) -> dict:
    """Runs in each rank: what a same-user scanner of /proc sees, and what is left of this rank's key file."""
    import os

    import torch.distributed as dist

    from sparkgpu import runtime

    dist.barrier()  # every rank has taken its key
    seen = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for name in ("environ", "cmdline"):
            try:
                with open(f"/proc/{pid}/{name}", "rb") as f:
                    seen.append(f.read())
            except OSError:  # the process ended meanwhile
                continue
    with open(f"/proc/{os.getpid()}/environ", "rb") as f:
        started_with = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    key_dir = started_with.get(b"SPARKGPU_JOB_KEY_DIR", b"").decode()
    if runtime.get_global_rank() == 0:
        with open(out_path, "wb") as f:
            f.write(b"\n".join(seen))
    dist.barrier()
    return {
        "key_dir": key_dir,
        "key_files_left": sorted(os.listdir(key_dir)) if key_dir and os.path.isdir(key_dir) else [],
        "env_names": sorted(k for k in os.environ if "KEY" in k),
    }


@pytest.mark.parametrize(
    "path, backend, launcher",
    [
        ("forked", lambda: LocalBackend(standby=False), b"sparkgpu.launch.node.agent"),
        ("exec", lambda: LocalBackend(standby=False), b"sparkgpu.launch.node.agent"),
        ("warm_pool", lambda: "warm_pool", b"sparkgpu.launch.backends.local.zygote"),
    ],
)
def test_a_running_jobs_key_is_in_no_environment_or_command_line(tmp_path, monkeypatch, path, backend, launcher):
    if path == "exec":  # each rank a new interpreter, as for a job that ships its environment
        monkeypatch.setenv("SPARKGPU_FORK_RANKS", "0")
    job = distributed(gpus=2, gpu_type="cpu", backend=backend())(scan_for_secrets)
    out = tmp_path / "proc.bin"
    results = job.distributed(str(out))
    key = load_key(job.last_job_id)
    scanned = out.read_bytes()
    assert launcher in scanned  # the scan did see the process that started the ranks
    for secret in (key.hex().encode(), key.hex().upper().encode(), key):
        assert secret not in scanned, f"the job key is readable in /proc ({path})"
    assert all(r["env_names"] == [] for r in results)  # and user code sees no key variable
    if path != "warm_pool":  # the agent's command line names the run dir
        assert job.last_job_id.encode() in scanned
    if path == "exec":  # the agent hands each new interpreter a file, gone once read
        assert all(r["key_dir"] and r["key_files_left"] == [] for r in results), results
    else:  # forked ranks take it in memory: no file, and no folder named to them
        assert all(r["key_dir"] == "" for r in results), results
