"""The node agent's torch elastic configuration on the torch versions sparkgpu supports."""

import dataclasses

from torch.distributed.launcher.api import LaunchConfig

from sparkgpu.launch.node.agent import _shutdown_grace


@dataclasses.dataclass
class _LaunchConfigOf211:
    min_nodes: int = 1


@dataclasses.dataclass
class _LaunchConfigWithShutdownTimeout:
    min_nodes: int = 1
    shutdown_timeout: int = 30


def test_the_shutdown_grace_goes_only_to_a_torch_that_takes_it():
    # torch 2.11's LaunchConfig has no shutdown_timeout: passing it failed every job's first
    # attempt on a GPU machine with that torch (its restarts, started another way, ran).
    assert _shutdown_grace(_LaunchConfigOf211, 10) == {}
    assert _shutdown_grace(_LaunchConfigWithShutdownTimeout, 10) == {"shutdown_timeout": 10}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, **_shutdown_grace(LaunchConfig, 10))
    assert getattr(config, "shutdown_timeout", 10) == 10
