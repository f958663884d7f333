"""The capacity probe on real Spark Python workers (Connect ``local[2]``): what an executor
refuses reaches the client as a ConfigurationError that names the fix."""

from __future__ import annotations

import io

import pytest

from sparkgpu import ConfigurationError
from sparkgpu.launch.backends.spark.capacity import _probe

pytestmark = [pytest.mark.integration, pytest.mark.spark]


def test_a_broken_gpu_discovery_script_is_named_before_anything_launches(spark, tmp_path):
    script = tmp_path / "getGpus.sh"
    script.write_text("#!/bin/sh\necho 'nvidia-smi: command not found' >&2\nexit 3\n")
    script.chmod(0o755)
    confs = {"spark.executor.resource.gpu.discoveryScript": str(script)}
    with pytest.raises(
        ConfigurationError,
        match=r"the GPU discovery script .*getGpus.sh failed on .* exit code 3 "
        r".*nvidia-smi: command not found.*\(reported by an executor\)",
    ):
        _probe(spark, confs, tasks=1, timeout=120, out=io.StringIO())
