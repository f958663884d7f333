"""`databricks air run` workload files: each field mapped onto sparkgpu's job options, each misuse refused."""

import textwrap

import pytest

from sparkgpu.errors import ConfigurationError
from sparkgpu.spec.jobfile import JobFile
from sparkgpu.spec.jobfile_air import unmet_requirements


@pytest.fixture
def project(tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "train.py").write_text("print('training')\n")
    return tmp_path


def load(project, text, name="train.yaml"):
    path = project / name
    path.write_text(textwrap.dedent(text))
    return JobFile.load(path)


def test_a_workload_maps_onto_the_options_of_a_job_file(project):
    job = load(
        project,
        """
        experiment_name: ctr-training
        environment:
          version: '4'
          dependencies: [torch, "pyyaml>=5"]
        compute:
          num_accelerators: 16
          accelerator_type: GPU_8xH100
        code_source:
          type: snapshot
          snapshot:
            root_path: repo
        env_variables: {BATCH_SIZE: 32, LR: "1e-4"}
        command: torchrun --nproc_per_node=8 --nnodes=2 $CODE_SOURCE_PATH/train.py --lr $LR --out ${CODE_SOURCE_PATH}/out
        """,
    )
    root = str(project / "repo")
    assert job.script == f"{root}/train.py"
    assert job.args == ("--lr", "1e-4", "--out", f"{root}/out")
    assert job.env == {"CODE_SOURCE_PATH": root, "BATCH_SIZE": "32", "LR": "1e-4"}
    # max_restarts: air's max_retries, whose default is 3
    assert job.options == {
        "experiment": "ctr-training",
        "gpus": 16,
        "accelerator_type": "GPU_8xH100",
        "max_restarts": 3,
    }
    fn = job.build()
    assert (fn.name, fn.experiment, fn.resources.gpus, fn.resources.gpu_type, fn.accelerator_type) == (
        "train",
        "ctr-training",
        16,
        "H100",
        "GPU_8xH100",
    )


def test_the_short_forms_python_a_relative_script_and_no_code_source(project):
    (project / "train.py").write_text("")
    job = load(
        project,
        """
        experiment_name: e
        compute: {num_accelerators: 1, accelerator_type: GPU_1xA10}
        command: |
          TOKENIZERS_PARALLELISM=false python -u train.py \\
            --epochs 3
        """,
    )
    assert job.script == str(project / "train.py")  # the code root is the workload file's folder
    assert job.args == ("--epochs", "3")
    assert job.env == {"CODE_SOURCE_PATH": str(project), "TOKENIZERS_PARALLELISM": "false"}
    assert load(
        project,
        """
        experiment_name: e
        compute: {num_accelerators: 1, accelerator_type: GPU_1xA10}
        code_source: {root_path: repo}
        command: python3 train.py
        """,
    ).script == str(project / "repo" / "train.py")


def test_torchrun_options_map_or_are_set_by_sparkgpu(project):
    job = load(
        project,
        """
        experiment_name: e
        compute: {num_accelerators: 8, accelerator_type: GPU_8xH100}
        code_source: {type: snapshot, snapshot: {root_path: repo}}
        command: >-
          torchrun --standalone --nproc-per-node gpu --max_restarts=3 --master_port=29500
          --rdzv_backend c10d $CODE_SOURCE_PATH/train.py
        """,
    )
    assert job.options["max_restarts"] == 3 and job.build().policy.max_restarts == 3


def test_pool_id_runs_on_that_remote_pool(project):
    job = load(
        project,
        """
        experiment_name: e
        compute: {num_accelerators: 8, accelerator_type: GPU_8xH100, pool_id: h100-reserved}
        code_source: {root_path: repo}
        command: python $CODE_SOURCE_PATH/train.py
        """,
    )
    assert job.options["pool"] == "h100-reserved" and job.build().resources.remote


@pytest.mark.parametrize(
    "air, sparkgpu", [("BEST_EFFORT", "best_effort"), ("NORMAL", "normal"), ("CRITICAL", "critical")]
)
def test_priority_class_maps_to_priority(project, air, sparkgpu):
    job = load(
        project,
        f"""
        experiment_name: e
        compute: {{num_accelerators: 8, accelerator_type: GPU_8xH100, pool_id: p, priority_class: {air}}}
        code_source: {{root_path: repo}}
        command: python $CODE_SOURCE_PATH/train.py
        """,
    )
    assert job.options["priority"] == sparkgpu


BASE = "experiment_name: e\ncode_source: {root_path: repo}\n"
COMPUTE = "compute: {num_accelerators: 2, accelerator_type: GPU_1xA10}\n"


@pytest.mark.parametrize(
    "text, match",
    [
        (
            BASE + COMPUTE + "command: python train.py\nenv_vars: {A: 1}\n",
            r"'env_vars' \(did you mean 'env_variables'\?\)",
        ),
        (
            BASE + "compute: {num_accelerator: 2, accelerator_type: GPU_1xA10}\ncommand: python train.py\n",
            r"'num_accelerator' \(did you mean 'num_accelerators'\?\) in compute",
        ),
        ("experiment_name: e\n" + COMPUTE, "field\\(s\\) command are required"),
        (BASE + "compute: {num_accelerators: 2}\ncommand: python train.py\n", "compute.accelerator_type is required"),
        (
            BASE + "compute: {num_accelerators: 2, accelerator_type: GPU_1xV100}\ncommand: python train.py\n",
            "compute.unknown accelerator_type 'GPU_1xV100'",
        ),
        (
            BASE + "compute: {num_accelerators: two, accelerator_type: GPU_1xA10}\ncommand: python train.py\n",
            "compute.num_accelerators must be a number",
        ),
        (
            BASE + "compute: {num_accelerators: 12, accelerator_type: GPU_8xH100}\ncommand: python train.py\n",
            "multiple of the 8 GPUs per node of GPU_8xH100, got 12",
        ),
        (BASE + COMPUTE + "command: python train.py | tee log.txt\n", "shell operator '\\|'"),
        (BASE + COMPUTE + "command: pip install x && python train.py\n", "shell operator '&&'"),
        (BASE + COMPUTE + "command: python train.py > out.log\n", "shell operator '>'"),
        (
            BASE + COMPUTE + "command: |\n  pip install x\n  python train.py\n",
            "command line 1 'pip install x' runs 'pip'",
        ),
        (BASE + COMPUTE + "command: python train.py --at $(date)\n", "command substitution"),
        (BASE + COMPUTE + "command: bash run.sh\n", "runs 'bash'"),
        (BASE + COMPUTE + "command: python -m trainer\n", "passes '-m' to python"),
        (BASE + COMPUTE + "command: python train.sh\n", "not a .py file"),
        (BASE + COMPUTE + "command: python train.py --data $DATA_DIR\n", r"uses \$DATA_DIR, which is not known"),
        (
            BASE + COMPUTE + "command: torchrun --nproc_per_node=4 train.py\n",
            "starts 4 rank\\(s\\) per node, but compute gives 1 GPU\\(s\\) per node .* --nproc_per_node=1",
        ),
        (
            BASE + "compute: {num_accelerators: 16, accelerator_type: GPU_8xH100}\n"
            "command: torchrun --nproc_per_node=8 --nnodes=1 train.py\n",
            "asks for 1 node\\(s\\), but compute gives 2",
        ),
        (BASE + COMPUTE + "command: torchrun --no-python train.py\n", "passes '--no-python' to torchrun"),
        (BASE + COMPUTE + "command: torchrun --nnodes=1:4 train.py\n", "takes a number here"),
        (BASE + COMPUTE + "command: python missing.py\n", "missing.py' does not exist"),
        (BASE + COMPUTE + "command: python 'train.py\n", "does not parse"),
        (
            BASE + "compute: {num_accelerators: 8, accelerator_type: GPU_8xH100, priority_class: CRITICAL}\n"
            "command: python train.py\n",
            "priority_class needs compute.pool_id",
        ),
        (
            BASE + "compute: {num_accelerators: 8, accelerator_type: GPU_8xH100, pool_id: p, priority_class: urgent}\n"
            "command: python train.py\n",
            "must be one of BEST_EFFORT, NORMAL, CRITICAL, got 'urgent'",
        ),
        (
            BASE
            + "compute: {num_accelerators: 8, accelerator_type: GPU_8xH100, pool_id: p, priority_class: critical}\n"
            "command: python train.py\n",
            "did you mean 'CRITICAL'",
        ),
        (
            "experiment_name: e\ncode_source: {type: git, root_path: repo}\n" + COMPUTE + "command: python train.py\n",
            "code_source.type 'git' is not supported",
        ),
        (
            "experiment_name: e\ncode_source: {type: snapshot, snapshot: {path: repo}}\n"
            + COMPUTE
            + "command: python train.py\n",
            r"'path' \(did you mean 'root_path'\?\) in code_source.snapshot",
        ),
        (
            "experiment_name: e\ncode_source: {root_path: nowhere}\n" + COMPUTE + "command: python train.py\n",
            "nowhere' is not a folder",
        ),
        (BASE + COMPUTE + "env_variables: [A]\ncommand: python train.py\n", "env_variables must be a mapping"),
    ],
)
def test_what_sparkgpu_cannot_run_is_refused_naming_the_fix(project, text, match):
    with pytest.raises(ConfigurationError, match=match) as err:
        load(project, text)
    assert "train.yaml" in str(err.value)


def test_dependencies_are_checked_against_this_environment(project):
    text = BASE + COMPUTE + "command: python train.py\nenvironment:\n  dependencies: DEPS\n"
    load(project, text.replace("DEPS", '[pyyaml, "torch>=1", "--index-url https://pypi.org/simple", "--no-deps"]'))
    with pytest.raises(ConfigurationError) as err:
        load(project, text.replace("DEPS", '[pyyaml, "torch>=999", surely-not-installed-pkg]'))
    message = str(err.value)
    assert "torch>=999 (installed: " in message and "surely-not-installed-pkg (not installed)" in message
    assert message.endswith("Install them here: pip install 'torch>=999' surely-not-installed-pkg")
    assert "pyyaml" not in message  # met

    with pytest.raises(ConfigurationError, match="pip option '--editable' is not supported"):
        load(project, text.replace("DEPS", '["--editable ."]'))
    with pytest.raises(ConfigurationError, match="'not a requirement!' is not a requirement sparkgpu can check"):
        load(project, text.replace("DEPS", '["not a requirement!"]'))
    load(project, text.replace("DEPS", '["pyyaml >= 1", "surely-not-installed-pkg; python_version < \'3\'"]'))


def test_dependencies_from_a_requirements_file_and_its_requirements_txt(project):
    (project / "deps").mkdir()
    (project / "deps" / "requirements.txt").write_text("# pinned\nnumpy>=1  # arrays\nsurely-not-installed-pkg==1.0\n")
    (project / "deps" / "requirements.yaml").write_text(
        "version: '4'\ndependencies:\n  - --index-url https://pypi.org/simple\n  - -r requirements.txt\n  - pyyaml\n"
    )
    text = BASE + COMPUTE + "command: python train.py\nenvironment: {dependencies: deps/requirements.yaml}\n"
    with pytest.raises(ConfigurationError, match=r"surely-not-installed-pkg==1.0 \(not installed\)") as err:
        load(project, text)
    assert "numpy" not in str(err.value)
    (project / "deps" / "requirements.yaml").write_text("dependencies: [pyyaml]\npython: '3.11'\n")
    with pytest.raises(ConfigurationError, match=r"unknown field\(s\) 'python' in requirements file"):
        load(project, text)
    with pytest.raises(ConfigurationError, match="cannot read environment.dependencies file"):
        load(project, text.replace("deps/requirements.yaml", "deps/missing.yaml"))


def test_wheels_and_markers():
    import yaml

    assert unmet_requirements([f"/Workspace/wheels/PyYAML-{yaml.__version__}-py3-none-any.whl"]) == []
    assert unmet_requirements(["https://x/wheels/PyYAML-0.1-py3-none-any.whl"]) == [
        f"https://x/wheels/PyYAML-0.1-py3-none-any.whl (installed: {yaml.__version__})"
    ]
    assert unmet_requirements(["surely-not-installed-pkg; python_version < '3'"]) == []  # not for this Python


def test_a_sparkgpu_job_file_is_not_taken_for_a_workload(project):
    job = load(project, "script: repo/train.py\nexperiment: e\ngpus: 1\n")
    assert job.options == {"experiment": "e", "gpus": 1}
    with pytest.raises(ConfigurationError, match=r"unknown field\(s\) 'compute'"):
        load(project, "script: repo/train.py\ncompute: {num_accelerators: 1}\n")


# -- the optional fields: each mapped, or refused with why and what to do -------------------
WORKLOAD = BASE + COMPUTE + "command: python train.py\n"


@pytest.fixture
def secrets_dir(tmp_path, monkeypatch):
    """A secrets folder of the user's own, with one secret readable by its owner only."""
    root = tmp_path / "secrets"
    (root / "my_scope").mkdir(parents=True, mode=0o700)
    token = root / "my_scope" / "hf_token"
    token.write_text("hf_s3cr3t_value\n")
    token.chmod(0o600)
    monkeypatch.setenv("SPARKGPU_SECRETS_DIR", str(root))
    return root


@pytest.fixture
def usage_policy(tmp_path, monkeypatch):
    from sparkgpu.config import reset_settings

    path = tmp_path / "policy.yaml"
    path.write_text("name: ml-platform\nmax_gpus_per_job: 64\n")
    monkeypatch.setenv("SPARKGPU_USAGE_POLICY", str(path))
    reset_settings()
    return path


def _me():
    from sparkgpu.config import settings

    return settings().user


@pytest.mark.parametrize(
    "fields, check",
    [
        ("mlflow_run_name: lr-1e-4\n", lambda job: job.run_name == "lr-1e-4"),
        (
            "mlflow_experiment_directory: /Users/me@example.com/\n",
            lambda job: job.options["experiment"] == "/Users/me@example.com/e",
        ),
        ("max_retries: 5\n", lambda job: job.options["max_restarts"] == 5 and job.build().policy.max_restarts == 5),
        ("max_retries: 0\n", lambda job: job.options["max_restarts"] == 0),
        ("", lambda job: job.options["max_restarts"] == 3),  # air's default, for air files only
        ("timeout_minutes: 90\n", lambda job: job.options["timeout"] == 5400 and job.build().policy.timeout == 5400),
        (
            "parameters: {lr: 0.001, layers: [64, 64], optimizer: {name: adamw}}\n",
            lambda job: job.parameters == {"lr": 0.001, "layers": [64, 64], "optimizer": {"name": "adamw"}},
        ),
        ("permissions: []\n", lambda job: job.options["gpus"] == 2),
        (
            "permissions: [{user_name: ME@example.com, level: CAN_MANAGE}]\n",  # the launching user: nothing to grant
            lambda job: job.options["gpus"] == 2,
        ),
        ("usage_policy_name: ML-Platform\n", lambda job: job.options["gpus"] == 2),
        ("usage_policy_id: ml-platform\n", lambda job: job.options["gpus"] == 2),
        (
            "secrets: {HF_TOKEN: my_scope/hf_token}\n",
            lambda job: (
                job.secret_values == {"HF_TOKEN": "hf_s3cr3t_value"}
                and str(job.secret_refs["HF_TOKEN"]) == "my_scope/hf_token"
                and "hf_s3cr3t_value" not in repr(job)
            ),
        ),
    ],
    ids=lambda value: value.split(":")[0] if isinstance(value, str) else "",
)
def test_each_optional_field_maps_onto_sparkgpu(project, secrets_dir, usage_policy, fields, check):
    (project / "train.py").write_text("print('training')\n")
    job = load(project, WORKLOAD.replace("train.py\n", "train.py\n" + fields.replace("ME", _me()), 1))
    assert check(job)


def test_air_s_default_of_three_retries_is_for_workload_files_only(project):
    (project / "job.yaml").write_text("script: repo/train.py\n")
    assert JobFile.load(project / "job.yaml").max_restarts == 0  # sparkgpu's own job file: @distributed's default
    assert load(project, WORKLOAD).max_restarts == 3


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            "mlflow_artifact_location: s3://bucket/artifacts\n",
            "mlflow_artifact_location is not supported.*artifact root",
        ),
        ("mlflow_experiment_directory: Users/me\n", "must be a folder such as /Users"),
        ("max_retries: -1\n", "max_retries must be a number of retries"),
        ("timeout_minutes: 0\n", "timeout_minutes must be a number of minutes above 0"),
        ("parameters: [1, 2]\n", "parameters must be a mapping"),
        ("usage_policy_name: finance\n", "'finance' is not a usage policy configured here.*known: 'ml-platform'"),
        ("usage_policy_name: ml-platform\nusage_policy_id: ml-platform\n", "not both"),
        (
            "permissions: [{group_name: data-engineering, level: CAN_VIEW}]\n",
            "cannot be granted: a sparkgpu job is reachable only by the OS user who launched it",
        ),
        ("permissions: [{level: CAN_VIEW}]\n", "needs exactly one of user_name, group_name"),
        ("secrets: {HF_TOKEN: hf_token}\n", r"secrets.HF_TOKEN must be 'scope/key'"),
        ("secrets: {HF_TOKEN: my_scope/missing}\n", "has no file .*missing.*umask 077"),
        ("secrets: {HF_TOKEN: my_scope/hf_token}\nenv_variables: {HF_TOKEN: x}\n", "both env_variables and secrets"),
    ],
    ids=lambda value: value.split(":")[0] if isinstance(value, str) and value.endswith("\n") else "",
)
def test_each_optional_field_is_refused_naming_why_and_the_fix(project, secrets_dir, usage_policy, fields, match):
    (project / "train.py").write_text("print('training')\n")
    with pytest.raises(ConfigurationError, match=match):
        load(project, WORKLOAD.replace("train.py\n", "train.py\n" + fields, 1))


def test_a_secret_file_readable_by_others_is_refused(project, secrets_dir):
    (secrets_dir / "my_scope" / "hf_token").chmod(0o644)
    (project / "train.py").write_text("")
    with pytest.raises(ConfigurationError, match="readable by others \\(mode 0644\\).*chmod 600") as caught:
        load(project, WORKLOAD + "secrets: {HF_TOKEN: my_scope/hf_token}\n")
    assert "hf_s3cr3t_value" not in str(caught.value)


def test_a_script_that_reads_a_secret_from_the_environment_is_told_the_runtime_call(project, secrets_dir):
    (project / "repo" / "train.py").write_text("import os\ntoken = os.environ['HF_TOKEN']\n")
    with pytest.raises(ConfigurationError, match=r"sparkgpu.runtime.secret\('HF_TOKEN'\)"):
        load(project, WORKLOAD + "secrets: {HF_TOKEN: my_scope/hf_token}\n")


def test_an_idempotency_token_is_the_jobs_idempotency_key(project):
    (project / "train.py").write_text("")
    job = load(project, WORKLOAD + "idempotency_token: nightly-2026-12-02\n")
    assert job.idempotency_key == "nightly-2026-12-02"
    assert job.build(callbacks=[]).idempotency_key == "nightly-2026-12-02"


def test_a_multi_line_command_folds_its_set_up_lines_in(project):
    (project / "repo" / "src").mkdir()
    (project / "repo" / "src" / "train.py").write_text("")
    job = load(
        project,
        BASE
        + COMPUTE
        + """command: |
  # set up, then train
  set -euo pipefail
  cd $CODE_SOURCE_PATH/src
  export WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
  EPOCHS=3

  python train.py --epochs $EPOCHS --mode $WANDB_MODE  # the program, last
""",
    )
    assert job.script == str(project / "repo" / "src" / "train.py")  # relative to the folder `cd` moved to
    assert job.cwd == str(project / "repo" / "src")
    assert job.args == ("--epochs", "3", "--mode", "offline")
    assert job.env["WANDB_MODE"] == "offline" and job.env["TOKENIZERS_PARALLELISM"] == "false"
    assert "EPOCHS" not in job.env  # a shell variable, not exported


@pytest.mark.parametrize(
    "command, match",
    [
        ("echo starting\n  python train.py", "command line 1 'echo starting' runs 'echo'"),
        ("python train.py\n  python train.py --again", "command line 2 .* comes after the program"),
        ("cd\n  python train.py", "command line 1 'cd' is not `cd DIR`"),
        ("export $X\n  python train.py", "command line 1 .* exports"),
        ("# nothing\n  set -e", "runs no program"),
    ],
)
def test_a_multi_line_command_that_does_more_than_set_up_is_refused_naming_the_line(project, command, match):
    (project / "train.py").write_text("")
    with pytest.raises(ConfigurationError, match=match):
        load(project, BASE + COMPUTE + f"command: |\n  {command}\n")


@pytest.mark.parametrize(
    "overrides, check",
    [
        (["compute.num_accelerators=2"], lambda job: job.options["gpus"] == 2),
        (
            ["max_retries=7", "timeout_minutes=1.5"],
            lambda job: (job.options["max_restarts"], job.options["timeout"]) == (7, 90),
        ),
        (["parameters.optimizer.lr=0.01"], lambda job: job.parameters == {"optimizer": {"lr": 0.01}}),
        (["env_variables.BATCH=64"], lambda job: job.env["BATCH"] == "64"),
    ],
)
def test_overrides_set_fields_by_dotted_path_typed_as_yaml(project, overrides, check):
    (project / "train.py").write_text("")
    path = project / "train.yaml"
    path.write_text(BASE + "compute: {num_accelerators: 1, accelerator_type: GPU_1xA10}\ncommand: python train.py\n")
    assert check(JobFile.load(path, overrides=overrides))


def test_an_override_of_an_unknown_path_is_refused_with_the_known_ones(project):
    (project / "train.py").write_text("")
    path = project / "train.yaml"
    path.write_text(WORKLOAD)
    with pytest.raises(
        ConfigurationError,
        match=r"'compute.num_accelerator' is not a field \(did you mean 'compute.num_accelerators'\?\); known: .*compute.pool_id",
    ):
        JobFile.load(path, overrides=["compute.num_accelerator=2"])
    with pytest.raises(ConfigurationError, match="give FIELD.PATH=VALUE"):
        JobFile.load(path, overrides=["max_retries"])
