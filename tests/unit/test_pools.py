"""The pools file and the choice of a pool by GPU type, name or id (no cluster needed)."""

from __future__ import annotations

import textwrap

import pytest

from sparkgpu.config import reset_settings, settings
from sparkgpu.api.decorator import distributed
from sparkgpu.errors import CapacityError, ConfigurationError
from sparkgpu.spec.pools import Pool, choose_pool, configured_pools, load_pools
from sparkgpu.spec import Resources

POOLS = """\
pools:
  a10:
    url: sc://a10.example:15002
    gpu_type: a10g
    gpus_per_node: 4
  h100-team:
    url: sc://h100-team.example:15002
    gpu_type: H100
    gpus_per_node: 8
    reserved: true
    id: 0415-abc
  h100:
    url: sc://h100.example:15002
    gpu_type: H100
    gpus_per_node: 8
"""


def write(tmp_path, text: str, name: str = "pools.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def pools(tmp_path):
    return load_pools(write(tmp_path, POOLS))


def test_pools_load_in_file_order_with_catalog_names(pools):
    assert [p.name for p in pools] == ["a10", "h100-team", "h100"]
    assert pools[0] == Pool("a10", "sc://a10.example:15002", "A10", 4)
    assert pools[1].reserved and pools[1].pool_id == "0415-abc" and not pools[2].reserved


@pytest.mark.parametrize(
    "body, line, words",
    [
        ("pools:\n  a:\n    url: http://x:1\n    gpu_type: A10\n    gpus_per_node: 1\n", 3, ["url", "sc://host:15002"]),
        (
            "pools:\n  a:\n    url: sc://x:1\n    gpu_type: V100\n    gpus_per_node: 1\n",
            4,
            ["gpu_type", "'V100'", "'H100'"],
        ),
        (
            "pools:\n  a:\n    url: sc://x:1\n    gpu_type: A10\n    gpus_per_node: 0\n",
            5,
            ["gpus_per_node", "positive"],
        ),
        (
            "pools:\n  a:\n    url: sc://x:1\n    gpu_type: A10\n    gpus_per_node: 1\n    reserved: maybe\n",
            6,
            ["reserved", "true or false"],
        ),
        (
            "pools:\n  a:\n    url: sc://x:1\n    gpu_type: A10\n    gpus_per_node: 1\n    gpu: 2\n",
            6,
            ["unknown field", "'gpu'"],
        ),
        ("pools:\n  a:\n    url: sc://x:1\n    gpus_per_node: 1\n", 2, ["needs gpu_type:"]),
        ("pool:\n  a: {}\n", 1, ["unknown top-level", "'pool'"]),
        (
            "pools:\n  a:\n    url: sc://x:1\n    gpu_type: A10\n    gpus_per_node: 1\n    id: b\n"
            "  b:\n    url: sc://y:1\n    gpu_type: A10\n    gpus_per_node: 1\n",
            7,
            ["pool 'b': 'b' is already the name or id of pool 'a'", "unique"],
        ),
    ],
)
def test_an_invalid_pools_file_names_its_line_and_field(tmp_path, body, line, words):
    path = write(tmp_path, body)
    with pytest.raises(ConfigurationError) as info:
        load_pools(path)
    message = str(info.value)
    assert f"{path}' line {line}:" in message, message
    for word in words:
        assert word in message


def test_a_pools_file_that_does_not_parse_or_exist_says_so(tmp_path):
    with pytest.raises(ConfigurationError, match="not valid YAML at line 3"):
        load_pools(write(tmp_path, "pools:\n  a: [\n"))
    with pytest.raises(ConfigurationError, match="fix SPARKGPU_POOLS"):
        load_pools(tmp_path / "missing.yaml")


def test_the_gpu_type_chooses_a_shared_pool_before_a_reserved_one(pools):
    assert choose_pool(Resources(8, "H100", remote=True), pools=pools).name == "h100"
    assert choose_pool(Resources(8, "H100", remote=True), pools=pools, reserved=True).name == "h100-team"
    assert choose_pool(Resources(1, "A10G", remote=True), pools=pools).name == "a10"
    # Without a shared pool of the type, a reserved one serves.
    assert choose_pool(Resources(8, "H100", remote=True), pools=pools[:2]).name == "h100-team"


def test_a_pool_is_named_by_its_name_or_id(pools):
    assert choose_pool(Resources(8, "H100", remote=True), "h100-team", pools=pools).name == "h100-team"
    assert choose_pool(Resources(8, "H100", remote=True), "0415-abc", pools=pools).name == "h100-team"
    assert choose_pool(Resources(2, "cpu", remote=True), "a10", pools=pools).name == "a10"  # CPU ranks run anywhere


def test_no_fitting_pool_names_every_pool_and_its_gpu_type(pools):
    with pytest.raises(CapacityError) as info:
        choose_pool(Resources(8, "H200", remote=True), pools=pools)
    message = str(info.value)
    assert "no pool has H200 GPUs" in message
    assert "a10 (A10, 4 per node, shared)" in message and "h100-team (H100, 8 per node, reserved)" in message
    with pytest.raises(CapacityError, match="no reserved pool has A10 GPUs.*DATABRICKS_USE_RESERVED_GPU_POOL"):
        choose_pool(Resources(1, "A10", remote=True), pools=pools, reserved=True)
    with pytest.raises(ConfigurationError, match="there is no pool 'nope'.*h100 \\(H100"):
        choose_pool(Resources(8, "H100", remote=True), "nope", pools=pools)
    with pytest.raises(ConfigurationError, match="pool 'a10' has A10 GPUs.*gpu_type='H100'"):
        choose_pool(Resources(8, "H100", remote=True), "a10", pools=pools)


def test_pool_settings_read_the_databricks_variables_as_aliases(tmp_path, monkeypatch):
    path = write(tmp_path, POOLS)
    monkeypatch.setenv("SPARKGPU_POOLS", str(path))
    monkeypatch.setenv("DATABRICKS_REMOTE_GPU_POOL_ID", "0415-abc")
    monkeypatch.setenv("DATABRICKS_USE_RESERVED_GPU_POOL", "true")
    reset_settings()
    s = settings()
    assert (s.pools_path, s.pool, s.use_reserved_pool) == (str(path), "0415-abc", True)
    assert [p.name for p in configured_pools()] == ["a10", "h100-team", "h100"]
    monkeypatch.setenv("SPARKGPU_POOL", "h100")  # the project's own name wins
    monkeypatch.setenv("SPARKGPU_USE_RESERVED_POOL", "0")
    reset_settings()
    assert (settings().pool, settings().use_reserved_pool) == ("h100", False)


def test_without_a_pools_file_nothing_changes(monkeypatch):
    monkeypatch.delenv("SPARKGPU_POOLS", raising=False)
    reset_settings()
    assert configured_pools() is None


def test_distributed_pool_needs_remote_and_the_spark_backend():
    with pytest.raises(ConfigurationError, match="add remote=True"):
        distributed(gpus=1, gpu_type="H100", pool="h100")
    with pytest.raises(ConfigurationError, match="drop backend='local'"):
        distributed(gpus=1, gpu_type="H100", remote=True, backend="local", pool="h100")
