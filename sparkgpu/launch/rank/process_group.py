"""The rank's default process group, which training code written for torchrun may set up again.

sparkgpu creates the job's process group before the user's function runs: its own callbacks,
checkpoints and ``runtime.is_distributed()`` rely on it, and functions written for sparkgpu
never create one. Code written for torchrun (the Databricks docs' ``setup()``, HF Accelerate,
Lightning, DeepSpeed) calls ``dist.init_process_group("nccl")`` and, at the end,
``dist.destroy_process_group()`` itself. For the rank's lifetime, :class:`RankProcessGroup`
replaces exactly two functions, in both places they are reachable
(``torch.distributed`` and ``torch.distributed.distributed_c10d``), and puts them back when
the rank ends:

- ``init_process_group``: once the job's group exists, a call whose backend fits it returns
  without doing anything (one debug log line); ``init_method``, ``store``, ``timeout`` and
  the like are ignored, as the group is already connected. ``"nccl"`` asked on a CPU rank
  means the job's ``gloo`` (one warning). A backend the group does not have, or a ``rank`` /
  ``world_size`` other than the job's, raises :class:`~sparkgpu.errors.ConfigurationError`.
- ``destroy_process_group``: of the default group, deferred to the end of the rank, so that
  sparkgpu's own teardown (pending checkpoint commits, callbacks) still has it and a later
  ``init_process_group`` finds it again; ``dist.is_initialized()`` stays ``True``.
  Subgroups (``dist.new_group``) are destroyed at once, as torch does.
"""

from __future__ import annotations

import datetime
import logging
import warnings

from sparkgpu.errors import ConfigurationError

__all__ = ["RankProcessGroup"]

_logger = logging.getLogger(__name__)
_PATCHED = ("init_process_group", "destroy_process_group")


def _backend_names(backend: str) -> set[str]:
    """``"nccl"`` -> {"nccl"}; ``"cpu:gloo,cuda:nccl"`` -> {"gloo", "nccl"}."""
    return {part.rpartition(":")[2].strip().lower() for part in backend.split(",") if part.strip()}


class RankProcessGroup:
    """Creates the job's default process group and shares it with user code for the rank's life.

    Args:
        backend: ``"nccl"`` on GPU ranks, ``"gloo"`` on CPU ranks.
        timeout: How long the group waits for every rank to join, and for collectives.
        device: The rank's CUDA device (``torch.device``); ``None`` on CPU ranks.
    """

    def __init__(self, backend: str, timeout: datetime.timedelta, device=None):
        self.backend = backend
        self.timeout = timeout
        self.device = device
        self.destroy_deferred = False
        self._originals: dict[str, object] = {}
        self._reuse_logged = False
        self._nccl_warned = False

    # -- lifetime -------------------------------------------------------------------------
    def install(self) -> None:
        """Puts the replacements in place: before the user's modules are unpickled, so that
        ``from torch.distributed import init_process_group`` binds them too."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        if self._originals:
            return
        for name in _PATCHED:
            self._originals[name] = getattr(c10d, name)
        replacements = {
            "init_process_group": self._init_process_group,
            "destroy_process_group": self._destroy_process_group,
        }
        for module in (dist, c10d):
            for name, replacement in replacements.items():
                setattr(module, name, replacement)

    def create(self) -> None:
        """Joins the job's group (every rank of the job must call this)."""
        kwargs = {"timeout": self.timeout}
        if self.device is not None:
            kwargs["device_id"] = self.device
        self._original("init_process_group")(self.backend, **kwargs)
        # init returns on a rank once its own connections are up, not its peers': without this,
        # a rank whose function ends (or raises) at once leaves while a peer is still connecting,
        # and that peer fails with "Connection closed by peer" instead of running.
        import torch.distributed as dist

        dist.barrier()

    def close(self) -> None:
        """Leaves the group (also when user code destroyed it: that was deferred until now)
        and puts torch's functions back."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        try:
            if dist.is_available() and dist.is_initialized():
                self._original("destroy_process_group")()
        finally:
            for module in (dist, c10d):
                for name, original in self._originals.items():
                    setattr(module, name, original)
            self._originals.clear()

    # -- the replacements -----------------------------------------------------------------
    def _init_process_group(
        self,
        backend=None,
        init_method=None,
        timeout=None,
        world_size=-1,
        rank=-1,
        store=None,
        group_name="",
        pg_options=None,
        device_id=None,
        **kwargs,
    ):
        import torch.distributed as dist

        if not dist.is_initialized():  # user code before the job's group exists: torch's own call
            return self._original("init_process_group")(
                backend, init_method, timeout, world_size, rank, store, group_name, pg_options, device_id, **kwargs
            )
        self._check_backend(backend)
        for name, asked, actual in (("world_size", world_size, dist.get_world_size()), ("rank", rank, dist.get_rank())):
            if asked not in (-1, None) and int(asked) != actual:
                raise ConfigurationError(
                    f"init_process_group({name}={asked}) inside a sparkgpu job whose process group is already set "
                    f"up with {name} {actual}: leave {name} out (the job sets RANK, WORLD_SIZE and LOCAL_RANK like "
                    "torchrun), or ask the job for the number of GPUs your code expects"
                )
        self.destroy_deferred = False
        if not self._reuse_logged:
            self._reuse_logged = True
            _logger.debug(
                "init_process_group(%r) inside a sparkgpu rank: reusing the job's %s process group",
                backend,
                dist.get_backend(),
            )
        return None  # as torch's own init_process_group

    def _check_backend(self, backend) -> None:
        import torch.distributed as dist

        if backend is None:
            return
        have = _backend_names(dist.get_backend_config())
        asked = _backend_names(str(backend))
        if self.device is None and "nccl" in asked and have == {"gloo"}:
            if not self._nccl_warned:
                self._nccl_warned = True
                warnings.warn(
                    "init_process_group('nccl') on a CPU rank: the job's process group uses 'gloo', which "
                    "the call gets instead",
                    RuntimeWarning,
                    stacklevel=3,
                )
            asked = (asked - {"nccl"}) | {"gloo"}
        if not asked <= have:
            hint = (
                " For collectives on CPU tensors in a GPU job, make a subgroup: dist.new_group(backend='gloo')."
                if "gloo" in asked and "nccl" in have
                else ""
            )
            raise ConfigurationError(
                f"init_process_group({backend!r}) inside a sparkgpu job whose process group is already set up with "
                f"{dist.get_backend_config()!r}: call init_process_group() without a backend, or with "
                f"{dist.get_backend()!r}.{hint}"
            )

    def _destroy_process_group(self, group=None):
        import torch.distributed as dist

        if group is None or group is dist.GroupMember.WORLD:
            self.destroy_deferred = True
            _logger.debug("destroy_process_group() inside a sparkgpu rank: the job's group stays until the rank ends")
            return None
        return self._original("destroy_process_group")(group)

    def _original(self, name: str):
        """torch's own function, whether or not the replacements are installed."""
        import torch.distributed.distributed_c10d as c10d

        return self._originals.get(name) or getattr(c10d, name)
