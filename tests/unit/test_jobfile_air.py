"""`databricks air run` workload files: each field mapped onto sparkgpu's job options, each misuse refused."""

import textwrap

import pytest

from sparkgpu.errors import ConfigurationError
from sparkgpu.jobfile import JobFile
from sparkgpu.jobfile_air import unmet_requirements


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
    assert job.options == {"experiment": "ctr-training", "gpus": 16, "accelerator_type": "GPU_8xH100"}
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
        (BASE + COMPUTE + "command: |\n  pip install x\n  python train.py\n", "several commands"),
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
