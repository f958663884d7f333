"""`sparkgpu run` flags for workload files (--override, --dry-run, --watch/--detach) and `sparkgpu result`."""

import pytest

from sparkgpu import cli
from sparkgpu.rundir.keyring import save_key
from sparkgpu.config import settings
from tests.unit.test_cli import finished_job, run_cli

WORKLOAD = """\
experiment_name: ctr
compute: {num_accelerators: 1, accelerator_type: GPU_1xA10}
env_variables: {BATCH_SIZE: "32"}
parameters: {lr: 0.001}
secrets: {HF_TOKEN: hub/token}
command: python train.py
"""


@pytest.fixture
def workload(tmp_path, monkeypatch):
    from sparkgpu.config import reset_settings

    secrets = tmp_path / "secrets" / "hub"
    secrets.mkdir(parents=True, mode=0o700)
    (secrets / "token").write_text("hf_never_printed")
    (secrets / "token").chmod(0o600)
    monkeypatch.setenv("SPARKGPU_SECRETS_DIR", str(tmp_path / "secrets"))
    monkeypatch.setenv("SPARKGPU_SIMULATE_GPUS", "A10:2")
    reset_settings()
    (tmp_path / "train.py").write_text("print('never runs')\n")
    path = tmp_path / "train.yaml"
    path.write_text(WORKLOAD)
    return path


def nothing_written():
    return not settings().staging_root.exists() or not any(settings().staging_root.iterdir())


def test_dry_run_prints_the_plan_and_the_mapped_fields_never_a_secret(workload, capsys):
    code, out, err = run_cli(capsys, "run", str(workload), "--dry-run")
    assert code == 0, err
    assert "backend=local" in out
    assert "max_restarts: 3" in out and "air's max_retries, 3 when the workload gives none" in out
    assert "parameters ($HYPERPARAMETERS_PATH): lr" in out
    assert "secrets (sparkgpu.runtime.secret(NAME), never in the environment): HF_TOKEN <- hub/token" in out
    assert "hf_never_printed" not in out + err
    assert nothing_written()


def test_override_sets_a_field_by_dotted_path(workload, capsys):
    code, out, err = run_cli(
        capsys, "run", str(workload), "--override", "compute.num_accelerators=2", "--override", "max_retries=0",
        "--dry-run",
    )  # fmt: skip
    assert code == 0, err
    assert "gpus: 2" in out and "ranks_per_node=2" in out and "max_restarts: 0" in out


@pytest.mark.parametrize(
    "argv, match",
    [
        (
            ["--override", "compute.gpus=2"],
            "'compute.gpus' is not a field (did you mean 'compute'?); known: experiment_name",
        ),
        (["--override", "timeout_minutes=soon"], "timeout_minutes must be a number of minutes above 0, got 'soon'"),
        (["--override", "max_retries"], "give FIELD.PATH=VALUE"),
    ],
)
def test_bad_overrides_exit_2_naming_the_known_fields(workload, capsys, argv, match):
    code, _, err = run_cli(capsys, "run", str(workload), *argv, "--dry-run")
    assert code == cli.EXIT_USAGE and match in err
    assert nothing_written()


def test_override_of_a_script_is_refused(tmp_path, capsys):
    (tmp_path / "train.py").write_text("")
    code, _, err = run_cli(capsys, "run", str(tmp_path / "train.py"), "--override", "gpus=2")
    assert code == cli.EXIT_USAGE and "--override sets fields of a job file" in err


def test_watch_and_detach_exclude_each_other(workload, capsys):
    with pytest.raises(SystemExit) as err:
        cli.main(["run", str(workload), "--watch", "--detach"])
    assert err.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_result_prints_each_ranks_result_of_a_job_that_ended(capsys):
    finished_job("ok-job", ["ok"])
    save_key("ok-job", b"k" * 32)  # the key finished_job signed the run dir with
    code, out, err = run_cli(capsys, "result", "ok-job")
    assert code == 0, err
    assert out.splitlines()[0].startswith("[rank0] ") and out.splitlines()[1].startswith("[rank1] ")


def test_result_of_a_failed_job_prints_its_remote_traceback_and_exits_1(capsys):
    finished_job("bad-job", ["raise"])
    save_key("bad-job", b"k" * 32)
    code, _, err = run_cli(capsys, "result", "bad-job")
    assert code == cli.EXIT_FAILED and "job bad-job failed: WorkerFailedError" in err


def test_result_of_a_job_that_has_not_ended_is_refused(capsys):
    from sparkgpu.rundir.directory import RunDir

    RunDir(settings().staging_root / "new-job").create(
        {"job_id": "new-job", "resources": {"gpus": 1}}, b"", b"k" * 32, []
    )
    code, _, err = run_cli(capsys, "result", "new-job")
    assert code == cli.EXIT_USAGE and "has not ended (not started)" in err
