"""A node's pre-flight check: before any rank starts, what would fail the job hours in.

* ``cache_disk``: the folder the ranks cache data in (``SPARKGPU_CACHE_DIR`` as the ranks get
  it, else this node's setting) can be created and written (a probe file written, synced to
  disk, read back and removed) and has ``SPARKGPU_PREFLIGHT_FREE`` free (default 5 GiB).
* ``gpus`` (real GPUs only): the devices the node was given are visible to CUDA; ``compute``:
  each multiplies two bf16 matrices and matches a float64 reference (a device that computes
  wrong answers fails here, not as a loss curve gone bad); ``nccl``: an all-reduce among the
  node's GPUs (``torch.cuda.nccl``) sums right. These run in a child interpreter, so CUDA is
  never initialised in the agent or the Spark worker, which fork.

The staging store's reachability is checked before this (a node that cannot read its job's
files ends as ``store-unreachable``); rendezvous with the other nodes is the agent's, bounded
by ``init_timeout``.

The local backend's agent runs the check (``--preflight``); on Spark the node task runs it
before the barrier's first exchange, so a failing node is named and left out before any
node starts a rank (:mod:`sparkgpu.launch.backends.spark.executor.node`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from sparkgpu._util.sizes import human_bytes
from sparkgpu.config import settings
from sparkgpu.errors import PreflightError

__all__ = [
    "CheckResult",
    "PreflightReport",
    "check_cache_disk",
    "check_compute",
    "check_gpus",
    "relative_error",
    "run_preflight",
    "cache_dir_of",
    "COMPUTE_TOLERANCE",
]

#: Largest relative (Frobenius) error of the bf16 product against float64 that passes: bf16
#: rounding of the inputs alone gives about 0.3% on random matrices; a wrong answer is near 100%.
COMPUTE_TOLERANCE = 0.02
_PROBE_BYTES = 1 << 20
_GPU_TIMEOUT = 120.0


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One check on one node: its name, whether it passed, what it found (and, failed, the fix)."""

    name: str
    ok: bool
    detail: str
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class PreflightReport:
    """A node's checks, in the order they ran."""

    checks: tuple[CheckResult, ...] = ()

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.ok]

    @property
    def ok(self) -> bool:
        return not self.failed

    def reason(self) -> str:
        """The failed checks in one sentence: ``"cache_disk: ...; compute: ..."``."""
        return "; ".join(f"{c.name}: {c.detail}" for c in self.failed)

    def error(self, where: str, *, replaceable: bool) -> PreflightError:
        """The :class:`PreflightError` that names ``where`` (``"node 1 (executor 3 on host h)"``)."""
        return PreflightError(f"{where} failed its pre-flight check: {self.reason()}", replaceable=replaceable)

    def to_json(self) -> list[dict]:
        return [dataclasses.asdict(c) for c in self.checks]

    @classmethod
    def from_json(cls, items: Sequence[Mapping]) -> "PreflightReport":
        return cls(tuple(CheckResult(**dict(item)) for item in items))


def cache_dir_of(rank_env: Mapping[str, str]) -> Path:
    """The cache folder the node's ranks will use: theirs, else this node's setting."""
    return Path(rank_env.get("SPARKGPU_CACHE_DIR") or settings().cache_dir).expanduser()


def check_cache_disk(path: Path, free_bytes: int) -> CheckResult:
    """``path`` can be created and written, and its disk has ``free_bytes`` free."""
    start = time.monotonic()
    fix = "mount the node's cache disk there, or set SPARKGPU_CACHE_DIR to a writable folder on a local disk"
    if path.exists() and not path.is_dir():
        return CheckResult("cache_disk", False, f"{path} is a file, not a folder: {fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".sparkgpu-preflight-{os.getpid()}"
        data = os.urandom(_PROBE_BYTES)
        try:
            with open(probe, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            if probe.read_bytes() != data:
                return CheckResult("cache_disk", False, f"{path} read back other bytes than were written: {fix}")
        finally:
            probe.unlink(missing_ok=True)
        free = shutil.disk_usage(path).free
    except OSError as exc:
        return CheckResult("cache_disk", False, f"cannot write {path} ({exc}): {fix}", time.monotonic() - start)
    seconds = time.monotonic() - start
    if free < free_bytes:
        return CheckResult(
            "cache_disk",
            False,
            f"{path} has {human_bytes(free)} free, less than the {human_bytes(free_bytes)} the check wants "
            "(SPARKGPU_PREFLIGHT_FREE): free space there, point SPARKGPU_CACHE_DIR at a larger disk, or lower it",
            seconds,
        )
    return CheckResult("cache_disk", True, f"{path} writable, {human_bytes(free)} free", seconds)


def relative_error(result, reference) -> float:
    """``||result - reference|| / ||reference||`` (Frobenius), in float64; ``inf`` for non-finite results."""
    import torch

    result, reference = result.double(), reference.double()
    if not bool(torch.isfinite(result).all()):
        return float("inf")
    return float(torch.linalg.norm(result - reference) / torch.linalg.norm(reference))


def check_compute(device: str, size: int = 2048) -> CheckResult:
    """A bf16 matrix product on ``device`` against a float64 reference (``"cuda:0"``; ``"cpu"`` runs too)."""
    import torch

    start = time.monotonic()
    generator = torch.Generator().manual_seed(20261204)
    a = torch.randn(size, size, generator=generator)
    b = torch.randn(size, size, generator=generator)
    reference = a.double() @ b.double()
    lhs, rhs = a.to(device, torch.bfloat16), b.to(device, torch.bfloat16)
    product = lhs @ rhs  # once to warm up, once timed
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    timed = time.monotonic()
    product = lhs @ rhs
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    elapsed = max(time.monotonic() - timed, 1e-9)
    error = relative_error(product.cpu(), reference)
    rate = 2 * size**3 / elapsed / 1e12
    seconds = time.monotonic() - start
    if not error <= COMPUTE_TOLERANCE:
        return CheckResult(
            "compute",
            False,
            f"{device} multiplied two bf16 matrices with a relative error of {error:.3g} against float64 (at most "
            f"{COMPUTE_TOLERANCE:g} passes): the device computes wrong answers; take the node out of service",
            seconds,
        )
    return CheckResult("compute", True, f"{device} bf16 matmul error {error:.2g}, {rate:.1f} TFLOP/s", seconds)


def _check_nccl(count: int) -> CheckResult:
    import torch
    import torch.cuda.nccl as nccl

    start = time.monotonic()
    tensors = [torch.full((1 << 20,), float(i + 1), device=f"cuda:{i}") for i in range(count)]
    if not nccl.is_available(tensors):
        return CheckResult("nccl", False, "this torch has no NCCL for these devices: install a CUDA build of torch")
    nccl.all_reduce(tensors)
    torch.cuda.synchronize()
    want = count * (count + 1) / 2
    wrong = [i for i, t in enumerate(tensors) if not bool((t == want).all())]
    seconds = time.monotonic() - start
    if wrong:
        return CheckResult(
            "nccl",
            False,
            f"an all-reduce among the node's {count} GPUs gave wrong sums on cuda:{wrong}: check the GPUs' "
            "interconnect (nvidia-smi topo -m) and the driver",
            seconds,
        )
    return CheckResult("nccl", True, f"all-reduce among {count} GPUs", seconds)


def _gpu_main(expected: int) -> list[CheckResult]:
    """In the child interpreter: the checks of the devices ``CUDA_VISIBLE_DEVICES`` names."""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible != expected:
        return [
            CheckResult(
                "gpus",
                False,
                f"CUDA sees {visible} of the {expected} GPUs the node was given "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}): the driver lost a device "
                "or its GPUs are held by another container; nvidia-smi on the host says which",
            )
        ]
    results = [CheckResult("gpus", True, f"{visible} visible")]
    results += [check_compute(f"cuda:{i}") for i in range(visible)]
    if visible > 1:
        results.append(_check_nccl(visible))
    return results


def check_gpus(addresses: Sequence[str], timeout: float = _GPU_TIMEOUT) -> list[CheckResult]:
    """The GPU checks of ``addresses`` in a child interpreter, which sees only them."""
    start = time.monotonic()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(addresses)}
    command = [sys.executable, "-m", "sparkgpu.launch.node.preflight", str(len(addresses))]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return [
            CheckResult(
                "gpus",
                False,
                f"the GPU checks of devices {','.join(addresses)} did not finish in {timeout:g}s: a device hangs",
                time.monotonic() - start,
            )
        ]
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    if done.returncode != 0 or not lines:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        return [
            CheckResult(
                "gpus",
                False,
                f"the GPU checks of devices {','.join(addresses)} failed (exit {done.returncode}): {tail}",
                time.monotonic() - start,
            )
        ]
    return list(PreflightReport.from_json(json.loads(lines[-1])).checks)


def run_preflight(
    rank_env: Mapping[str, str], gpu_addresses: Sequence[str] = (), *, simulated: bool = False
) -> PreflightReport:
    """The node's checks: its cache disk, and its GPUs when they are real.

    Args:
        rank_env: The environment the node's ranks get (their ``SPARKGPU_CACHE_DIR``).
        gpu_addresses: The GPU addresses the node was given; none for a CPU job.
        simulated: The GPUs are ``SPARKGPU_SIMULATE_GPUS``'s (their ranks run on CPU): no GPU check.
    """
    checks = [check_cache_disk(cache_dir_of(rank_env), settings().preflight_free_bytes)]
    if gpu_addresses and not simulated:
        checks += check_gpus(gpu_addresses)
    return PreflightReport(tuple(checks))


if __name__ == "__main__":  # the GPU checks' child: python -m sparkgpu.launch.node.preflight N
    print(json.dumps(PreflightReport(tuple(_gpu_main(int(sys.argv[1])))).to_json()), flush=True)
