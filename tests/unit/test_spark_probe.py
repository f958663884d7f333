"""The executor side of the capacity probe: which executor a task runs on and which GPUs it has.

The discovery scripts here are real executables; the executor command lines are Spark's.
"""

from __future__ import annotations

import json

import pytest

from sparkgpu.errors import ConfigurationError
from sparkgpu.launch.backends.spark.executor import probe as spark_probe
from sparkgpu.launch.backends.spark.executor.probe import executor_identity


def test_identity_outside_an_executor_is_unknown_but_usable():
    identity = executor_identity()  # pytest's parent is a shell, not an executor JVM
    assert identity.executor_id == "unknown" and identity.host and identity.resources_file is None


def test_identity_reads_the_executor_command_line():
    argv = [
        "/usr/bin/java",
        "-cp",
        "x",
        "org.apache.spark.executor.CoarseGrainedExecutorBackend",
        "--driver-url",
        "spark://d",
        "--executor-id",
        "3",
        "--hostname",
        "10.0.0.7",
        "--cores",
        "16",
        "--resourcesFile",
        "/r.json",
    ]
    assert spark_probe._arg(argv, "--executor-id") == "3" and spark_probe._arg(argv, "--cores") == "16"
    assert spark_probe._arg(argv, "--resourcesFile") == "/r.json" and spark_probe._arg(argv, "--missing") is None


def test_assigned_addresses_come_from_the_resources_file_then_the_discovery_script(tmp_path):
    resources = tmp_path / "resources.json"
    resources.write_text(
        json.dumps([{"id": {"componentName": "spark.executor", "resourceName": "gpu"}, "addresses": ["4", "5"]}])
    )
    identity = spark_probe.ExecutorIdentity("1", "h", 8, str(resources), 1)
    assert spark_probe._assigned_gpu_addresses(identity, None) == ["4", "5"]
    script = tmp_path / "discover.sh"
    script.write_text('#!/bin/sh\necho \'{"name": "gpu", "addresses": ["0", "1", "2"]}\'\n')
    script.chmod(0o755)
    no_file = spark_probe.ExecutorIdentity("1", "h", 8, None, 1)
    assert spark_probe._assigned_gpu_addresses(no_file, str(script)) == ["0", "1", "2"]
    assert spark_probe._assigned_gpu_addresses(no_file, None) == []


def write_script(tmp_path, body: str):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return script


@pytest.mark.parametrize(
    "body, says",
    [
        (
            "echo 'nvidia-smi: command not found' >&2\nexit 3\n",
            r"failed .* with exit code 3 .*nvidia-smi: command not found",
        ),
        ("echo 'no GPUs here'\n", r"did not print Spark's resource JSON .*no GPUs here"),
        ('echo \'{"name": "gpu"}\'\n', r"did not print Spark's resource JSON .*KeyError"),
    ],
)
def test_a_broken_discovery_script_is_an_error_naming_it_and_its_output_not_zero_gpus(tmp_path, body, says):
    script = write_script(tmp_path, body)
    with pytest.raises(ConfigurationError, match=f"the GPU discovery script {script} .*{says}"):
        list(spark_probe.probe_executor(spark_probe.ProbeOptions(discovery_script=str(script)), iter(())))


def test_a_missing_discovery_script_or_an_unreadable_resources_file_is_named(tmp_path):
    no_file = spark_probe.ExecutorIdentity("1", "h", 8, None, 1)
    with pytest.raises(ConfigurationError, match=f"{tmp_path / 'gone.sh'} does not exist on executor 1 on h"):
        spark_probe._assigned_gpu_addresses(no_file, str(tmp_path / "gone.sh"))
    broken = tmp_path / "resources.json"
    broken.write_text("{not json")
    identity = spark_probe.ExecutorIdentity("1", "h", 8, str(broken), 1)
    with pytest.raises(ConfigurationError, match=f"resources file {broken} is unreadable"):
        spark_probe._assigned_gpu_addresses(identity, None)
    script = write_script(tmp_path, 'echo \'{"name": "gpu", "addresses": ["7"]}\'\n')
    assert spark_probe._assigned_gpu_addresses(identity, str(script)) == ["7"]  # the script still answers
