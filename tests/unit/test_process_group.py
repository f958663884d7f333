"""RankProcessGroup: torch's init/destroy inside a rank, on a real one-rank gloo group."""

import datetime
import logging
import socket

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from sparkgpu.errors import ConfigurationError
from sparkgpu.launch.rank.process_group import RankProcessGroup

ORIGINAL_INIT, ORIGINAL_DESTROY = c10d.init_process_group, c10d.destroy_process_group


@pytest.fixture
def group(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    pg = RankProcessGroup("gloo", datetime.timedelta(seconds=30))
    pg.install()
    pg.create()
    yield pg
    pg.close()


def test_replaces_both_entry_points_and_puts_them_back(group):
    assert dist.init_process_group is c10d.init_process_group is not ORIGINAL_INIT
    assert dist.destroy_process_group is c10d.destroy_process_group is not ORIGINAL_DESTROY
    group.close()
    assert not dist.is_initialized()
    assert dist.init_process_group is ORIGINAL_INIT and c10d.destroy_process_group is ORIGINAL_DESTROY


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"backend": "gloo"},
        {"backend": "GLOO", "init_method": "env://", "rank": 0, "world_size": 1},
        {"backend": "cpu:gloo", "timeout": datetime.timedelta(seconds=1)},
        {"backend": None, "store": dist.HashStore()},
    ],
)
def test_a_second_init_with_a_fitting_backend_reuses_the_group(group, kwargs, caplog):
    before = c10d._get_default_group()
    with caplog.at_level(logging.DEBUG, logger="sparkgpu.launch.rank.process_group"):
        assert dist.init_process_group(**kwargs) is None
        dist.init_process_group(**kwargs)
    assert c10d._get_default_group() is before
    assert sum("reusing the job's gloo process group" in r.message for r in caplog.records) == 1


def test_nccl_on_a_cpu_rank_gets_the_jobs_gloo_with_one_warning(group):
    with pytest.warns(RuntimeWarning, match="init_process_group\\('nccl'\\) on a CPU rank.*'gloo'"):
        dist.init_process_group("nccl")
    dist.init_process_group("cuda:nccl,cpu:gloo")  # no second warning (pytest.warns would not see it here)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert dist.get_backend() == "gloo" and t.item() == 1.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"backend": "gloo", "world_size": 8}, r"world_size=8\) .*world_size 1: leave world_size out"),
        ({"rank": 3}, r"rank=3\) .*leave rank out"),
        ({"backend": "mpi"}, r"init_process_group\('mpi'\) .*without a backend, or with 'gloo'"),
    ],
)
def test_what_the_group_cannot_be_is_a_clear_error(group, kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        dist.init_process_group(**kwargs)


def test_destroying_the_default_group_waits_for_the_end_of_the_rank(group):
    dist.destroy_process_group()
    assert group.destroy_deferred and dist.is_initialized()
    t = torch.full((1,), 2.0)
    dist.all_reduce(t)  # sparkgpu's teardown (checkpoint commits, callbacks) still has its group
    dist.init_process_group("gloo")  # a framework that sets up again after a destroy
    assert not group.destroy_deferred
    dist.destroy_process_group(dist.group.WORLD)
    group.close()
    assert not dist.is_initialized()


def test_subgroups_are_destroyed_at_once(group):
    sub = dist.new_group([0])
    dist.destroy_process_group(sub)
    assert sub not in c10d._world.pg_names
    assert dist.is_initialized()


def test_init_before_the_jobs_group_exists_is_torchs_own(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    pg = RankProcessGroup("gloo", datetime.timedelta(seconds=30))
    pg.install()
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        assert dist.is_initialized() and dist.get_backend() == "gloo"
    finally:
        pg.close()
    assert not dist.is_initialized() and dist.init_process_group is ORIGINAL_INIT
