"""One signature check for every place that runs a payload, the generated ``_air.py`` included."""

import json
import os
import subprocess
import sys

import pytest

from sparkgpu.rundir.key_handover import KEY_DIR_ENV, hand_to_ranks
from sparkgpu.rundir.serialization import serialize_payload
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.signature import verifier_source, verify_payload

KEY = bytes(range(32))


def plain(x):
    return x + 1


def stage(tmp_path, hydrate: bytes = b"X = 1\n") -> RunDir:
    rd = RunDir(tmp_path / "job-1")
    rd.create({"job_id": "job-1"}, serialize_payload(plain, (41,), {}, []), KEY, [], {"_hydrate.py": hydrate})
    return rd


def test_verify_payload_returns_every_signed_file_once_checked(tmp_path):
    rd = stage(tmp_path)
    files = verify_payload(rd.path, KEY)
    assert sorted(files) == ["_air.py", "_hydrate.py", "payload.pkl", "spec.json"]
    assert files["_hydrate.py"] == b"X = 1\n" and json.loads(files["spec.json"])["signed_files"] == ["_hydrate.py"]
    assert verify_payload(rd.path, None) is None and verify_payload(rd.path, b"") is None
    assert verify_payload(rd.path, b"k" * 32) is None


@pytest.mark.parametrize("name", ["_air.py", "spec.json", "payload.pkl", "_hydrate.py", "payload.sig"])
def test_any_changed_or_missing_file_fails_the_check(tmp_path, name):
    rd = stage(tmp_path)
    path = rd.path / name
    original = path.read_bytes()
    path.write_bytes(original + b"0")
    assert verify_payload(rd.path, KEY) is None
    path.unlink()
    assert verify_payload(rd.path, KEY) is None


def test_the_entrypoint_carries_the_one_check_verbatim(tmp_path):
    air = stage(tmp_path).air.read_text()
    assert verifier_source() in air
    assert "hmac.new(" not in air.replace(verifier_source(), "")  # no second copy of the check


# The rank's own check, as on a worker where sparkgpu is not importable yet (-I -S): a shipped
# _hydrate.py runs only as signed. The test's module writes a marker when it runs.
@pytest.mark.parametrize(
    "tamper, key, runs",
    [
        (False, KEY, True),
        (True, KEY, False),
        (False, b"k" * 32, False),
        (False, None, False),
    ],
)
def test_the_generated_entrypoint_runs_a_shipped_module_only_when_signed(tmp_path, tamper, key, runs):
    marker = tmp_path / "ran"
    rd = stage(tmp_path, f"open({str(marker)!r}, 'w').close()\n".encode())
    if tamper:
        hydrate = rd.path / "_hydrate.py"
        hydrate.write_bytes(hydrate.read_bytes() + b"# changed after staging\n")
    env = {k: v for k, v in os.environ.items() if k != KEY_DIR_ENV}
    if key is not None:
        env[KEY_DIR_ENV] = str(hand_to_ranks(key, 1))  # as a node agent hands it to its rank
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(rd.air)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0  # without sparkgpu importable, a rank that gets past the check stops at its import
    assert marker.exists() is runs
    refused = "refusing to run: the payload is unsigned or was modified" in done.stderr
    assert refused is not runs
