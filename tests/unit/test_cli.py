"""The `sparkgpu` command in-process: subcommand registry, jobs, logs, usage, refusals before launch."""

import contextlib
import io
import json
import time

import pytest

from sparkgpu import cli
from sparkgpu.config import reset_settings, settings
from sparkgpu.errors import SparkGPUError
from sparkgpu.rundir.serialization import serialize_payload
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.launch.client.supervisor import Supervisor
from sparkgpu.spec import JobSpec, Resources, RunPolicy
from sparkgpu.usage.ledger import UsageLedger, UsageRecord
from sparkgpu.usage.rates import RateCard
from tests.fakes.backend import ScriptedBackend


def finished_job(job_id, script, gpus=2, **policy):
    """A run dir left by the real supervisor driving a scripted backend."""
    job = JobSpec(
        job_id=job_id,
        name="train",
        resources=Resources(gpus, "cpu"),
        policy=RunPolicy(**policy),
        backend="fake",
        tags={"team": "ml"},
    )
    rd = RunDir(settings().staging_root / job_id)
    rd.create(job.to_dict(), serialize_payload(lambda: 1, (), {}, []), b"k" * 32, [])
    with contextlib.suppress(SparkGPUError):  # failed jobs are part of what `sparkgpu jobs` shows
        Supervisor(job, rd, ScriptedBackend(script), b"k" * 32, [], out=io.StringIO()).run()
    return rd


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_every_registered_command_is_in_the_help(capsys):
    code, out, _ = run_cli(capsys)
    assert code == cli.EXIT_USAGE
    for command in ("run", "jobs", "logs", "usage"):
        assert command in out


def test_other_areas_register_subcommands_through_the_list(monkeypatch, capsys):
    import sys
    import types

    module = types.ModuleType("sparkgpu_test_plugin")

    def register(subparsers):
        p = subparsers.add_parser("hello")
        p.add_argument("--name", default="world")
        p.set_defaults(handler=lambda args: print(f"hello {args.name}") or 0)

    module.register = register
    monkeypatch.setitem(sys.modules, "sparkgpu_test_plugin", module)
    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, ("sparkgpu_test_plugin", "register")])
    assert run_cli(capsys, "hello", "--name", "spark")[:2] == (0, "hello spark\n")


def test_jobs_lists_status_attempts_restarts_and_duration(capsys):
    finished_job("ok-job", ["ok"])
    finished_job("flaky-job", ["raise", "ok"], max_restarts=1)
    finished_job("bad-job", ["raise"])
    RunDir(settings().staging_root / "staged-job").create(
        JobSpec("staged-job", "x", Resources(1, "cpu")).to_dict(), b"", b"k" * 32, []
    )
    code, out, _ = run_cli(capsys, "jobs")
    assert code == 0
    lines = {line.split()[1]: line for line in out.splitlines() if "-job" in line}
    assert "succeeded" in lines["ok-job"] and "2 x cpu" in lines["ok-job"]
    assert "succeeded" in lines["flaky-job"] and " 2 " in lines["flaky-job"] and " 1 " in lines["flaky-job"]
    assert "failed" in lines["bad-job"] and "team=ml" in lines["bad-job"]
    assert "staged" in lines["staged-job"]

    code, out, _ = run_cli(capsys, "jobs", "--json", "--status", "succeeded")
    jobs = {j["job_id"]: j for j in map(json.loads, out.splitlines())}
    assert set(jobs) == {"ok-job", "flaky-job"}
    assert jobs["flaky-job"]["attempts"] == 2 and jobs["flaky-job"]["restarts"] == 1
    assert jobs["ok-job"]["duration_s"] >= 0 and jobs["ok-job"]["started_at"] <= time.time()


def test_logs_of_one_rank_all_ranks_and_an_earlier_attempt(capsys):
    finished_job("flaky-20260101-000000-abcdef", ["raise", "ok"], max_restarts=1)
    code, out, _ = run_cli(capsys, "logs", "flaky-2026")  # a unique prefix is enough
    assert (code, out) == (0, "attempt 1 rank 0\n")
    assert run_cli(capsys, "logs", "flaky-2026", "--rank", "1", "--attempt", "0")[1] == "attempt 0 rank 1\n"
    assert run_cli(capsys, "logs", "flaky-2026", "--all")[1] == "[rank0] attempt 1 rank 0\n[rank1] attempt 1 rank 1\n"
    # A finished job: --follow prints what is there and returns.
    assert run_cli(capsys, "logs", "flaky-2026", "--follow")[:2] == (0, "attempt 1 rank 0\n")


def test_following_a_spark_attempts_rank_asks_its_client_to_read_that_ranks_logs_live(capsys):
    rd = finished_job("spark-20260101-000000-abcdef", ["ok"])
    rd.file(RunLayout.spark(0)).mkdir(parents=True)  # an attempt on Spark: its client reads node 0's logs live
    before = time.time()
    assert run_cli(capsys, "logs", "spark-2026", "--rank", "1", "--follow")[0] == 0
    request = json.loads(rd.file("attempts/0/spark/follow").read_text())
    assert request["ranks"] == [1] and before + 29 <= request["until"] <= time.time() + 30


@pytest.mark.parametrize(
    "argv, match",
    [
        (["logs", "nope"], "no job 'nope'"),
        (["logs", "job-"], "matches 2 jobs"),
        (["logs", "job-a", "--rank", "5"], "has ranks 0..1"),
        (["logs", "job-a", "--attempt", "3"], r"has attempts \[0\]"),
    ],
)
def test_logs_errors_say_what_exists(capsys, argv, match):
    import re

    finished_job("job-a", ["ok"])
    finished_job("job-b", ["ok"])
    code, _, err = run_cli(capsys, *argv)
    assert code == cli.EXIT_USAGE and re.search(match, err)


def _policy(tmp_path, monkeypatch, text):
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    monkeypatch.setenv("SPARKGPU_USAGE_POLICY", str(path))
    reset_settings()


def test_run_refused_by_policy_writes_nothing(tmp_path, monkeypatch, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    _policy(tmp_path, monkeypatch, "name: ml-platform\nmax_gpus_per_job: 1\nrequired_tags: [team]\n")
    code, _, err = run_cli(capsys, "run", str(script), "--gpus", "2", "--gpu-type", "cpu")
    assert code == cli.EXIT_POLICY
    assert "refused by 'ml-platform' before launch" in err and "2 GPUs asked for, at most 1 per job" in err
    assert "required tag(s) team missing" in err
    assert not settings().staging_root.exists() or not any(settings().staging_root.iterdir())


def test_run_refused_by_a_spent_budget(tmp_path, monkeypatch, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    _policy(tmp_path, monkeypatch, "budgets:\n  team=ml: 1 GPU-hours per 1d\n")
    now = time.time()
    UsageLedger(settings().usage_ledger_uri).append(
        [
            UsageRecord.priced(
                job_id="earlier",
                job_name="x",
                attempt=0,
                user="ana",
                tags={"team": "ml"},
                backend="local",
                gpu_type="cpu",
                gpus=2,
                simulated=False,
                status="succeeded",
                started_at=now - 3600,
                ended_at=now - 1800,
                rates=RateCard(),
            )
        ]
    )
    code, _, err = run_cli(capsys, "run", str(script), "--gpus", "1", "--gpu-type", "cpu", "--tag", "team=ml")
    assert code == cli.EXIT_POLICY and "1.00 GPU-hours of 1.00 GPU-hours" in err


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    code, out, _ = run_cli(
        capsys, "run", str(script), "--gpus", "2", "--gpu-type", "cpu", "--dry-run", "--", "--lr", "1"
    )
    assert code == 0 and "backend=local" in out and "ranks_per_node=2" in out
    assert not settings().staging_root.exists() or not any(settings().staging_root.iterdir())


@pytest.mark.parametrize(
    "argv, match",
    [
        (["run", "missing.py"], "does not exist"),
        (["run", "notes.txt"], "neither a Python script nor a job file"),
        (["run", "x.py", "--log-ranks", "odd"], "--log-ranks must be the ranks"),
        (["usage", "--since", "last tuesday"], "neither a duration"),
        (["jobs", "--", "extra"], None),
    ],
)
def test_bad_input_exits_2_with_the_fix(tmp_path, monkeypatch, capsys, argv, match):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    if match is None:
        with pytest.raises(SystemExit) as err:
            cli.main(argv)
        assert err.value.code == 2
        return
    code, _, err = run_cli(capsys, *argv)
    assert code == cli.EXIT_USAGE and match in err


def test_usage_table_json_budgets_and_plot(tmp_path, monkeypatch, capsys):
    _policy(tmp_path, monkeypatch, "name: p\nbudgets:\n  team=ml: 10 GPU-hours per 30d\n")
    now = time.time()
    UsageLedger(settings().usage_ledger_uri).append(
        [
            UsageRecord.priced(
                job_id="j1",
                job_name="x",
                attempt=0,
                user="ana",
                tags={"team": "ml"},
                backend="local",
                gpu_type="H100",
                gpus=8,
                simulated=False,
                status="succeeded",
                started_at=now - 3600,
                ended_at=now - 2700,
                rates=RateCard({"H100": 4.0}),
            )
        ]
    )
    code, out, err = run_cli(capsys, "usage", "--by", "team,gpu_type", "--budgets", "--plot", str(tmp_path / "u.png"))
    assert code == 0
    assert "ml" in out and "H100" in out and "2.00" in out and "$8.00" in out
    assert "team=ml" in out and "20%" in out  # the budget line: 2 of 10 GPU-hours
    assert (tmp_path / "u.png").read_bytes()[:4] == b"\x89PNG" and "wrote" in err
    code, out, _ = run_cli(capsys, "usage", "--json", "--by", "user")
    assert [json.loads(line) for line in out.splitlines()] == [
        {"user": "ana", "jobs": 1, "attempts": 1, "gpus_max": 8, "gpu_hours": 2.0, "cost_usd": 8.0}
    ]


def test_jobs_shows_a_running_job_whose_client_died_as_lost(capsys):
    import subprocess
    import sys

    from tests.unit.test_resume import client_record, dead_pid

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        for job_id, pid in (("alive-job", live.pid), ("orphan-job", dead_pid())):
            rd = finished_job(job_id, ["ok"])
            state = json.loads(rd.state_file.read_text())
            state.update(status="running", client=client_record(pid))
            rd.state_file.write_text(json.dumps(state))
        code, out, _ = run_cli(capsys, "jobs", "--json")
    finally:
        live.kill()
        live.wait()
    jobs = {j["job_id"]: j["status"] for j in map(json.loads, out.splitlines())}
    assert jobs == {"alive-job": "running", "orphan-job": "lost"}


def test_resume_refuses_a_job_whose_client_is_alive_and_names_force(capsys):
    import subprocess
    import sys

    from tests.unit.test_resume import client_record

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        rd = finished_job("driven-job", ["ok"])
        state = json.loads(rd.state_file.read_text())
        state.update(status="running", client=client_record(live.pid))
        rd.state_file.write_text(json.dumps(state))
        code, _, err = run_cli(capsys, "resume", "driven-job")
    finally:
        live.kill()
        live.wait()
    assert code == cli.EXIT_USAGE
    assert f"pid {live.pid}" in err and "--force" in err


def test_tracking_flush_names_a_job_that_does_not_exist(capsys):
    code, _, err = run_cli(capsys, "tracking", "flush", "no-such-job")
    assert code == cli.EXIT_USAGE and "no job 'no-such-job'" in err and "sparkgpu jobs" in err
