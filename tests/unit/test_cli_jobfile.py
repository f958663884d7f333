"""Job files: every field validated, errors naming the field, the script run as __main__."""

import os
import sys

import pytest

from sparkgpu.errors import ConfigurationError
from sparkgpu.spec.jobfile import JobFile, ScriptRunner


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(
        "import os, sys\n"
        "out = os.environ['OUT_FILE']\n"
        "with open(out, 'w') as f:\n"
        "    f.write(repr((__name__, sys.argv[1:], os.path.basename(sys.argv[0]))))\n"
    )
    return path


def write(tmp_path, text, name="job.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_full_yaml_job_file(tmp_path, script):
    path = write(
        tmp_path,
        """
script: train.py
args: [--epochs, 3]
name: ctr-nightly
gpus: 2
gpu_type: cpu
max_runtime: 7d
checkpoint_grace: 5m
timeout: 8d
max_restarts: 2
tags: {team: ml, project: ctr}
env: {OUT_FILE: /tmp/x}
log_ranks: all
""",
    )
    job = JobFile.load(path)
    assert job.script == str(script) and job.args == ("--epochs", "3")
    fn = job.build()
    assert fn.name == "ctr-nightly" and fn.resources.gpus == 2 and fn.resources.gpu_type == "cpu"
    assert fn.policy.max_runtime == 7 * 86400 and fn.policy.checkpoint_grace == 300
    assert fn.policy.max_restarts == 2 and fn.tags == {"team": "ml", "project": "ctr"} and fn.log_ranks is None


def test_toml_and_json_work_too(tmp_path, script):
    assert JobFile.load(write(tmp_path, 'script = "train.py"\ngpus = 3\n', "job.toml")).gpus == 3
    assert JobFile.load(write(tmp_path, '{"script": "train.py", "gpu_type": "cpu"}', "job.json")).gpu_type == "cpu"


@pytest.mark.parametrize(
    "text, match",
    [
        ("script: train.py\ngpu: 2\n", r"unknown field\(s\) 'gpu' \(did you mean 'gpus'\?\)"),
        ("gpus: 2\n", "field 'script' is required"),
        ("script: train.py\ngpus: eight\n", "field 'gpus' must be the number of GPUs"),
        ("script: train.py\nargs: --lr 1\n", "field 'args' must be the list of arguments"),
        ("script: train.py\ntags: [ml]\n", "field 'tags' must be the mapping of tags"),
        ("script: train.py\nremote: yes please\n", "field 'remote' must be"),
        ("script: train.py\nmax_runtime: a week\n", "max_runtime='a week' is not a duration"),
        ("script: train.py\ngpu_type: V100\n", "unknown gpu_type 'V100'"),
        ("script: missing.py\n", "script '.*missing.py' does not exist"),
        ("script: train.py\n  gpus: [\n", "is not valid YAML at line"),
        ("- script: train.py\n", "must hold a mapping"),
    ],
)
def test_bad_job_files_name_the_file_and_the_field(tmp_path, script, text, match):
    with pytest.raises(ConfigurationError, match=match) as err:
        JobFile.load(write(tmp_path, text))
    assert "job.yaml" in str(err.value)


def test_command_line_values_override_the_file(tmp_path, script):
    job = JobFile.load(write(tmp_path, "script: train.py\ngpus: 2\ntags: {team: ml}\n"))
    job = job.with_overrides(gpus=4, gpu_type=None, tags={"project": "ctr"})
    assert job.gpus == 4 and job.gpu_type is None and job.tags == {"team": "ml", "project": "ctr"}


def test_the_runner_runs_the_script_as_main_with_its_arguments(tmp_path, script, monkeypatch):
    out = tmp_path / "out.txt"
    monkeypatch.setenv("OUT_FILE", "overridden by the job's env")  # undone after the test
    runner = ScriptRunner.from_path(script, ["--lr", "0.1"], {"OUT_FILE": str(out)})
    argv_before = sys.argv[:]
    assert runner() is None
    assert out.read_text() == repr(("__main__", ["--lr", "0.1"], "train.py"))
    assert sys.argv == argv_before  # the caller's argv is restored


def test_a_worker_without_the_file_runs_the_code_shipped_with_the_job(tmp_path, script, monkeypatch):
    out = tmp_path / "out.txt"
    monkeypatch.setenv("OUT_FILE", "overridden by the job's env")
    runner = ScriptRunner.from_path(script, [], {"OUT_FILE": str(out)})
    script.write_text("raise SystemExit('this is not the code the job was launched with')\n")
    monkeypatch.setenv("SPARKGPU_RUN_DIR", str(tmp_path / "run"))
    runner()
    assert out.read_text().startswith("('__main__'")
    assert len(list((tmp_path / "run" / "scripts").glob("*/train.py"))) == 1


def test_exit_codes_of_the_script(tmp_path):
    ok = tmp_path / "ok.py"
    ok.write_text("import sys\nsys.exit(0)\n")
    ScriptRunner.from_path(ok)()
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(SystemExit) as err:
        ScriptRunner.from_path(bad)()
    assert err.value.code == 3


def test_the_runner_pickles_by_reference(script):
    import cloudpickle

    runner = ScriptRunner.from_path(script, ["a"])
    data = cloudpickle.dumps(runner)
    assert b"sparkgpu.spec.jobfile" in data and cloudpickle.loads(data) == runner
    assert os.path.basename(runner.path) == "train.py" and runner.__name__ == "train"
