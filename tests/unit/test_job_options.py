"""The job options are defined once (sparkgpu.spec.options); every way to give one must take each."""

import inspect

import pytest

from sparkgpu import cli
from sparkgpu.api.decorator import distributed
from sparkgpu.errors import ConfigurationError
from sparkgpu.spec.options import JOB_OPTIONS, PYTHON_ONLY_KEYWORDS
from sparkgpu.spec.jobfile import JobFile
from sparkgpu.spec.priority import Priority

SAMPLE = {  # a value of every option, as a job file writes it
    "name": "nightly",
    "gpus": 2,
    "gpu_type": "cpu",
    "accelerator_type": None,
    "remote": False,
    "pool": None,
    "max_runtime": "2h",
    "checkpoint_grace": "5m",
    "timeout": 7200,
    "max_restarts": 2,
    "priority": "BEST_EFFORT",  # databricks' spelling
    "capacity_wait": "30m",
    "min_gpus": None,  # remote jobs only: tests/unit/test_elastic.py gives it
    "elastic_wait": None,
    "preflight": False,
    "tags": {"team": "ml"},
    "log_ranks": [0, 1],
    "experiment": "ctr",
    "register_as": "main.ml.ctr",
    "ship_environment": False,
}


def test_the_sample_covers_every_option():
    assert set(SAMPLE) == {o.name for o in JOB_OPTIONS}


def test_distributed_takes_every_option_and_nothing_else_a_file_could_not_give():
    keywords = set(inspect.signature(distributed).parameters)
    assert {o.name for o in JOB_OPTIONS} <= keywords
    assert keywords - {o.name for o in JOB_OPTIONS} == PYTHON_ONLY_KEYWORDS


def test_a_job_file_gives_every_option_to_the_job(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    job = JobFile.from_dict(
        {"script": "train.py", **{k: v for k, v in SAMPLE.items() if v is not None}},
        base_dir=tmp_path,
        source="job file 'x.yaml'",
    )
    fn = job.build()
    assert (fn.name, fn.resources.gpus, fn.resources.gpu_type) == ("nightly", 2, "cpu")
    assert (fn.policy.max_runtime, fn.policy.checkpoint_grace, fn.policy.timeout, fn.policy.max_restarts) == (
        7200,
        300,
        7200,
        2,
    )
    assert fn.tags == {"team": "ml"} and fn.log_ranks == (0, 1)
    assert fn.policy.priority is Priority.BEST_EFFORT and fn.policy.capacity_wait == 1800
    assert (fn.experiment, fn.register_as, fn.ship_environment) == ("ctr", "main.ml.ctr", False)


def test_the_command_line_has_a_flag_for_every_option_and_overrides_the_file(tmp_path):
    (tmp_path / "train.py").write_text("")
    parser = cli.build_parser()
    flags = {
        a for action in parser._subparsers._group_actions[0].choices["run"]._actions for a in action.option_strings
    }
    for option in JOB_OPTIONS:
        assert option.cli_flag in flags, option.name
    args = parser.parse_args(
        [
            "run",
            str(tmp_path / "train.py"),
            "--gpus",
            "3",
            "--gpu-type",
            "cpu",
            "--tag",
            "a=b",
            "--experiment",
            "exp",
            "--register-as",
            "main.ml.m",
            "--no-ship-environment",
            "--log-ranks",
            "none",
            "--priority",
            "critical",
        ]
    )
    args.passthrough = []
    job = cli._load_job(args)
    assert (job.gpus, job.gpu_type, job.tags, job.experiment, job.register_as) == (
        3,
        "cpu",
        {"a": "b"},
        "exp",
        "main.ml.m",
    )
    assert job.ship_environment is False and job.build().log_ranks == ()
    assert job.build().policy.priority is Priority.CRITICAL


@pytest.mark.parametrize(
    "field, value",
    [
        ("gpus", "two"),
        ("remote", "yes"),
        ("tags", ["ml"]),
        ("experiment", 3),
        ("ship_environment", "no"),
        ("log_ranks", "odd"),
        ("max_runtime", [1]),
        ("priority", 2),
    ],
)
def test_a_wrong_shape_names_the_field_and_what_it_takes(tmp_path, field, value):
    (tmp_path / "train.py").write_text("")
    option = next(o for o in JOB_OPTIONS if o.name == field)
    with pytest.raises(ConfigurationError, match=f"field '{field}' must be the") as info:
        JobFile.from_dict({"script": "train.py", field: value}, base_dir=tmp_path)
    assert option.help in str(info.value)


def test_help_of_the_run_command_is_the_schema_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for option in JOB_OPTIONS:
        assert " ".join(option.help.split())[:40] in out, option.name


def test_a_file_or_help_gives_the_defaults_distributed_applies(capsys):
    job = JobFile(script="train.py")
    assert job.gpus is None  # every GPU of the host, as distributed() without gpus
    for option in JOB_OPTIONS:
        assert getattr(job, option.name) == inspect.signature(distributed).parameters[option.name].default
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "every GPU of this host" in out and "(default 1)" not in out
    assert "(default 60s)" in out and "(default main)" in out


@pytest.mark.parametrize("value, ranks", [("none", ()), ("main", (0,)), ("all", None), ("0,2", (0, 2)), ([1], (1,))])
def test_every_spelling_of_log_ranks_in_a_file_reaches_the_job(tmp_path, value, ranks):
    (tmp_path / "train.py").write_text("print('trained')\n")
    path = tmp_path / "job.yaml"
    path.write_text(
        f"script: train.py\ngpus: 1\ngpu_type: cpu\nlog_ranks: {value if isinstance(value, str) else list(value)}\n"
    )
    assert JobFile.load(path).build(callbacks=[]).log_ranks == ranks


@pytest.mark.parametrize("value", ["some", [True], "0,x", 3])
def test_a_wrong_log_ranks_names_what_it_takes(value):
    with pytest.raises(ConfigurationError, match=r"log_ranks=.*use 'main', 'all', 'none'"):
        distributed(gpus=1, gpu_type="cpu", log_ranks=value)(lambda: None)
