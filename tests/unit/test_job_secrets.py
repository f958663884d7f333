"""Job secrets: sealed under the job key, opened only with it, held in memory, read by name."""

import pytest

from sparkgpu import job_secrets, runtime
from sparkgpu.errors import SparkGPUError
from sparkgpu.spec.jobfile import ScriptRunner

KEY = bytes(range(32))


def test_sealed_secrets_hold_no_plaintext_and_open_only_under_the_job_key():
    values = {"HF_TOKEN": "hf_" + "x" * 40, "WANDB_API_KEY": "w" * 40}
    sealed = job_secrets.seal(KEY, values)
    assert b"hf_" not in sealed and b"x" * 8 not in sealed and b"HF_TOKEN" not in sealed
    assert job_secrets.unseal(KEY, sealed) == values
    assert job_secrets.seal(KEY, values) != sealed  # a fresh nonce each time
    with pytest.raises(SparkGPUError, match="do not verify under its key"):
        job_secrets.unseal(bytes(32), sealed)
    tampered = bytearray(sealed)
    tampered[20] ^= 1
    with pytest.raises(SparkGPUError, match="do not verify under its key"):
        job_secrets.unseal(KEY, bytes(tampered))
    with pytest.raises(SparkGPUError, match="only in a rank of the job"):
        job_secrets.unseal(None, sealed)


def test_the_runner_opens_its_secrets_with_the_ranks_key_and_the_script_reads_them_by_name(tmp_path, monkeypatch):
    from sparkgpu.rundir import keyring as _keyring

    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys\n"
        "from sparkgpu import runtime\n"
        "with open(sys.argv[1], 'w') as f:\n"
        "    f.write(str(runtime.secret('HF_TOKEN') == 'hf_value' and 'hf_value' not in str(os.environ)))\n"
    )
    out = tmp_path / "out.txt"
    monkeypatch.setenv("SPARKGPU_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(_keyring, "_held", KEY)  # what the rank's entrypoint holds
    ScriptRunner.from_path(script, [str(out)])(sealed_secrets=job_secrets.seal(KEY, {"HF_TOKEN": "hf_value"}))
    assert out.read_text() == "True"
    with pytest.raises(KeyError, match="no secret 'OTHER'; it has: HF_TOKEN"):
        runtime.secret("OTHER")
    job_secrets.hold({})


def test_parameters_reach_the_script_through_a_file_in_the_run_dir(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys, yaml\n"
        "with open(os.environ['HYPERPARAMETERS_PATH']) as f:\n"
        "    params = yaml.safe_load(f)\n"
        "with open(sys.argv[1], 'w') as f:\n"
        "    f.write(repr((os.environ['HYPERPARAMETERS_PATH'], params)))\n"
    )
    out = tmp_path / "out.txt"
    monkeypatch.setenv("SPARKGPU_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.delenv("HYPERPARAMETERS_PATH", raising=False)
    ScriptRunner.from_path(script, [str(out)], parameters={"lr": 0.1, "layers": [2, 2]})()
    assert out.read_text() == repr((str(tmp_path / "run" / "parameters.yaml"), {"lr": 0.1, "layers": [2, 2]}))
