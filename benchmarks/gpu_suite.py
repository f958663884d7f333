"""The GPU side in one command: NCCL, host-to-device copies, nvJPEG, a ResNet-50 and an LLM fine-tune waiting on data, scoring.

Question: when a GPU machine is lent for a few minutes, what does the data path cost the GPU?
Eight parts, each in its own process (one that fails, hangs or crashes is recorded as failed
and the others still run), in this order:

  * ``preflight``: sparkgpu's node pre-flight GPU checks (``sparkgpu.launch.node.preflight``)
    on every GPU of the host, as a node runs them in a child interpreter: every device visible,
    a bf16 matmul against float64 on each, an NCCL all-reduce among them; their results and how
    long a node's whole check takes (interpreter, torch import and CUDA start-up included).
  * ``nccl``: ``torchrun --nproc-per-node=<GPU count>`` on 127.0.0.1; every rank calls
    ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))`` and ``init_process_group("nccl")``,
    as training scripts do, then all_reduces 1 MiB ... 1 GiB of float32, checks the sums and
    reports algorithm and bus bandwidth (nccl-tests' busbw = algbw x 2(n-1)/n). With one GPU
    it checks the ``cuda:LOCAL_RANK`` path and NCCL start-up; bandwidth means nothing there.
  * ``hf``: the Hugging Face stack in sparkgpu jobs on the GPU (``gpu_hf.py``): a Trainer with a
    PEFT LoRA adapter, through Accelerate's FSDP2 plugin, and through DeepSpeed ZeRO-3, each
    written as for GPUs, killed once and resumed by itself: the device it trained on, the step it
    resumed from, the time from the kill to the first resumed step, and whether every step's loss
    and the final weights equal an uninterrupted run's.
  * ``h2d``: host-to-device copies from pinned and from pageable memory, 1 MiB ... 1 GiB,
    beside the PCIe link's limit read from ``nvidia-smi`` (generation x width); a batch of
    256x3x224x224 images as uint8 and as float32 (4x the bytes), and normalising the uint8
    batch on the device.
  * ``jpeg``: nvJPEG batch decode (``torchvision.io.decode_jpeg(list, device="cuda")``) with
    RandomResizedCrop(224) + flip on the device, against the CPU in a process pool of every
    core over the same bytes and the same crop boxes: torchvision.io decode + transforms.v2,
    and the project's fused decode-and-crop (``sparkgpu.data.augment._jpeg``) where it exists.
  * ``resnet_wait``: a ResNet-50 (channels_last, bf16 autocast, SGD) trained on batches from
    ``sparkgpu.data.dataset`` over MDS shards of JPEGs (bench_images.py's images and shards),
    ``num_workers`` = cores - 1, ``device="cuda"``, decoded with the loader's fused
    ``decode={"image": data.RandomResizedCrop(224)}`` where it has one (and once with
    bench_images.py's generic ``transform=``): the fraction of each step spent in ``next()``
    when the shards are in the local cache and when they come from a volume (a plain folder as
    ``remote=``, read into a fresh, cold cache), beside the same steps on one batch already on
    the GPU (the ceiling), and the loader alone from both sources.

  * ``predict``: ``spark.gpu.predict``'s executor path on the GPU without Spark: Arrow batches
    scored by an MLP against predict_batch_udf's pandas round trip, and length-sorted batched
    generation by a small Llama against the same batches in input order.
  * ``sft``: whether the packed SFT loader (``data.sft_dataset``) keeps a GPU fed: row tokens/s
    it hands out alone, beside a Llama's bf16 training steps on one batch resident on the GPU
    (the ceiling) and the same steps fed by the loader (pinned, non-blocking copies).

Without CUDA every GPU measurement is reported as skipped with the reason, and the CPU-side
ones (the CPU JPEG paths, the loader alone) still run. Every part has a cap on its time within
``--budget-s`` (default 480 s); a part that no longer fits is reported as skipped for the
budget, and one stopped at its cap keeps what it measured before. Results:
``benchmarks/results/gpu-<part>.json`` per part (rewritten after every measurement) and
``gpu-suite.json``, which holds every run: each invocation appends its own entry to ``runs``
(its options and command, the machine, every part's record), rewrites that entry after every
part, and leaves the earlier entries and the file's other keys as they were; a table at the end.

    python benchmarks/gpu_suite.py                          # within --budget-s (480 s by default)
    python benchmarks/gpu_suite.py --only nccl,h2d
    python benchmarks/gpu_suite.py --small --out gpu-check  # small sizes, not over results/: a check
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # common.py and bench_images.py, also when this file is imported
    sys.path.insert(0, str(HERE))

from common import load_seen, machine, method, spread  # noqa: E402
from gpu_hf import MODES, llama, part_hf  # noqa: E402

RESULTS = HERE / "results"
MiB = 1 << 20

PARTS = ("preflight", "nccl", "hf", "h2d", "jpeg", "resnet_wait", "predict", "sft")
# What each part measures, named before it runs: a part stopped half-way still lists the rest.
PLANNED = {
    "preflight": ("node_checks",),
    "nccl": ("all_reduce",),
    "hf": MODES,
    "h2d": ("pinned_vs_pageable", "image_batch"),
    "jpeg": ("nvjpeg_decode", "nvjpeg_decode_crop_flip", "cpu_torchvision", "cpu_fused"),
    "resnet_wait": (
        "model_only",
        "cache_train",
        "volume_train",
        "cache_train_transform",
        "cache_loader_only",
        "volume_loader_only",
    ),
    "predict": ("tabular", "generate"),
    "sft": ("loader_only", "step_resident", "step_fed"),
}
# Parts with nothing to run without CUDA; the others keep their CPU-side measurements.
GPU_ONLY = ("preflight", "nccl", "hf", "h2d", "predict")
# Seconds each part may take; a part that finishes early leaves its time to those after it.
CAPS_S = {"preflight": 60, "nccl": 90, "hf": 200, "h2d": 60, "jpeg": 120, "resnet_wait": 210, "predict": 90, "sft": 90}
MIN_PART_S = 20  # a part is not started with less than this left of the budget
FACTS_TIMEOUT_S = 90
STOP_GRACE_S = 15  # SIGTERM first: torchrun passes it on to its ranks, SIGKILL would orphan them
NO_CUDA = "no CUDA device: torch.cuda.is_available() is False"

# Each size at full scale, then with --small (an end-to-end check, a minute on a CPU).
_SIZES: dict[str, tuple[Any, Any]] = {
    "transfer_mib": ([1, 4, 16, 64, 256, 1024], [1, 16]),  # all_reduce and host-to-device sizes
    "repeats": (5, 5),  # all_reduce samples per size
    "preflight_repeats": (3, 1),  # runs of a node's whole GPU check
    "copy_repeats": (7, 3),  # host-to-device samples per size
    "warmups": (2, 2),
    "image_batch": (256, 16),  # host-to-device of an image batch
    "jpeg_images": (4096, 32),
    "jpeg_passes": (2, 1),  # passes over the images per sample
    "jpeg_repeats": (3, 1),
    "jpeg_batch": (256, 16),  # images per nvJPEG call
    "jpeg_task": (32, 8),  # images per task of the CPU pools
    "resnet_batch": (256, 8),
    "resnet_warmup": (10, 2),
    "resnet_timed": (50, 4),
    "resnet_unique": (1024, 16),  # distinct JPEGs, repeated to fill the steps
    "predict_rows": (2_000_000, 20_000),  # tabular rows scored per sample
    "predict_prompts": (512, 16),
    "predict_new_tokens": (32, 4),
    "predict_repeats": (3, 1),
    "sft_documents": (20_000, 400),  # long-tailed lengths, 20 to 4,096 tokens (clipped to seq_len)
    "sft_seq_len": (4096, 256),
    "sft_batch": (8, 4),
    "sft_loader_s": (10.0, 1.0),  # the loader alone: a timed window of whole epochs
    "sft_steps": (30, 3),  # timed training steps per side, after 3 untimed ones
    "sft_hidden": (1024, 64),
    "sft_layers": (8, 2),
    "hf_hidden": (512, 64),  # the hf part's Llama (gpu_hf.py)
    "hf_layers": (4, 2),
    "hf_seq": (256, 32),
    "hf_batch": (8, 2),
    "hf_steps": (24, 6),
    "hf_save_steps": (8, 2),
    "hf_kill_step": (16, 4),  # the rank dies at the step after this one's checkpoint
}
SIZES = {small: {key: pair[small] for key, pair in _SIZES.items()} for small in (False, True)}
CROP = 224
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


# Formulas, kept apart so that they can be tested without a GPU.


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' all_reduce bus bandwidth: ``algbw * 2 * (n - 1) / n`` (0 for one rank)."""
    return algbw * 2 * (world_size - 1) / world_size


# PCIe transfer rate per lane (GT/s) and line encoding, by generation; gen 6 is PAM4 with
# FLIT mode (242 of every 256 bytes carry data).
_PCIE_GT_S = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
_PCIE_ENCODING = {1: 8 / 10, 2: 8 / 10, 3: 128 / 130, 4: 128 / 130, 5: 128 / 130, 6: 242 / 256}


def pcie_limit_gb_per_s(generation: int, width: int) -> float | None:
    """One direction's data rate of a PCIe link, GB/s (1e9 bytes); ``None`` for an unknown generation."""
    if generation not in _PCIE_GT_S or width <= 0:
        return None
    return _PCIE_GT_S[generation] * _PCIE_ENCODING[generation] / 8 * width


def parse_pcie_csv(text: str) -> list[dict]:
    """The link generation and width of each GPU from ``nvidia-smi --query-gpu=pcie.link.gen.*,
    pcie.link.width.* --format=csv`` (with or without its header); ``None`` where not a number."""
    rows = [[cell.strip() for cell in line.split(",")] for line in text.strip().splitlines() if line.strip()]
    if not rows:
        return []
    gen_col, width_col = 0, 1
    if any("pcie" in cell.lower() for cell in rows[0]):
        header = [cell.lower() for cell in rows.pop(0)]
        gen_col = next((i for i, cell in enumerate(header) if ".gen." in cell), 0)
        width_col = next((i for i, cell in enumerate(header) if ".width." in cell), 1)

    def number(row: list[str], col: int) -> int | None:
        return int(row[col]) if col < len(row) and row[col].isdigit() else None

    return [{"gen": number(row, gen_col), "width": number(row, width_col)} for row in rows]


def link_limit(text: str | None, gpu: int = 0) -> dict:
    """GPU ``gpu``'s link from nvidia-smi's CSV and its limit; ``"unknown"`` where it cannot be read."""
    links = parse_pcie_csv(text) if text else []
    if gpu >= len(links) or links[gpu]["gen"] is None or links[gpu]["width"] is None:
        return {"gen": None, "width": None, "limit_gb_per_s": "unknown"}
    limit = pcie_limit_gb_per_s(links[gpu]["gen"], links[gpu]["width"])
    return dict(links[gpu], limit_gb_per_s=limit if limit is not None else "unknown")


def crop_boxes(count: int, height: int, width: int, seed: int = 0):
    """RandomResizedCrop's boxes (torchvision's algorithm: scale 0.08-1, ratio 3/4-4/3, ten
    tries, then a centre crop) as int32 ``(count, 4)`` top, left, height, width, and flips."""
    import numpy as np

    rng = np.random.default_rng(seed)
    boxes = np.empty((count, 4), np.int32)
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for i in range(count):
        for _ in range(10):
            target = height * width * rng.uniform(0.08, 1.0)
            aspect = math.exp(rng.uniform(*log_ratio))
            w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                boxes[i] = (rng.integers(0, height - h + 1), rng.integers(0, width - w + 1), h, w)
                break
        else:  # torchvision's fallback: the whole image, clamped to the ratio range, centred
            if width / height < 3 / 4:
                w, h = width, round(width / (3 / 4))
            elif width / height > 4 / 3:
                w, h = round(height * 4 / 3), height
            else:
                w, h = width, height
            boxes[i] = ((height - h) // 2, (width - w) // 2, h, w)
    return boxes, rng.random(count) < 0.5


# One part's results file.


class PartRecord:
    """One part's ``gpu-<part>.json``, rewritten after every measurement, so a part stopped at
    its cap (or a suite stopped from outside) leaves what it had measured and says what it had not."""

    def __init__(self, part: str, out: Path, facts: dict, small: bool, cap_s: float):
        self.part, self.path, self.facts = part, out / f"gpu-{part}.json", facts
        self.deadline = time.monotonic() + cap_s - min(10.0, cap_s / 10)
        self.cuda: bool | None = None
        self.data: dict = {
            "part": part,
            "status": "failed",
            "error": "not finished: the part's process stopped before its end",
            "finished": False,
            "small": small,
            "measurements": {key: not_reached("measurement") for key in PLANNED[part]},
            "config": {},
            "method": {},
            "machine": facts,
        }
        self.write()

    def write(self) -> None:
        write_json(self.path, self.data)

    def measure(self, key: str, work, *, needs_cuda: bool = False) -> dict:
        """Runs ``work()`` (a dict of figures with a ``summary`` line, and an ``error`` where one of
        its checks failed) as measurement ``key``: skipped without CUDA where it needs it, or past
        the part's cap; failed, with the traceback, where it raises."""
        if needs_cuda and not self.cuda:
            entry: dict = {"status": "skipped", "reason": NO_CUDA}
        elif time.monotonic() > self.deadline:
            entry = {"status": "skipped", "reason": "budget", "detail": "this part's time cap was reached"}
        else:
            print(f"[{self.part}] {key} ...", flush=True)
            started = time.perf_counter()
            try:
                figures = work()  # with an "error" where a check failed: failed, the figures kept
                entry = {"status": "failed" if "error" in figures else "ok", **figures}
                if "error" in figures:
                    entry["traceback"] = "(no exception: a check on the results failed)"
            except Exception as error:  # recorded, and the part goes on with its next measurement
                entry = {"status": "failed", "error": f"{type(error).__name__}: {error}"[:2000]}
                entry["traceback"] = traceback.format_exc()[-6000:]
            entry["wall_s"] = time.perf_counter() - started
        print(f"[{self.part}] {key}: {entry['status']}  {describe(entry)}", flush=True)
        self.data["measurements"][key] = entry
        self.write()
        return entry

    def finish(self, error: BaseException | None = None) -> None:
        data = self.data
        for key in ("error", "traceback", "reason"):
            data.pop(key, None)
        failed = [k for k, m in data["measurements"].items() if m["status"] == "failed"]
        if error is not None:
            data.update(status="failed", error=f"{type(error).__name__}: {error}"[:2000])
            data["traceback"] = traceback.format_exc()[-6000:]
        elif failed:
            first = data["measurements"][failed[0]]
            data.update(status="failed", error=f"failed: {', '.join(failed)}: {first['error']}"[:2000])
            data["traceback"] = first.get("traceback", "")
        elif all(m["status"] == "skipped" for m in data["measurements"].values()):
            reasons = dict.fromkeys(m["reason"] for m in data["measurements"].values())
            data.update(status="skipped", reason="; ".join(reasons))
        else:
            data["status"] = "ok"
        counts = [m["status"] for m in data["measurements"].values()]
        data["summary"] = ", ".join(f"{counts.count(s)} {s}" for s in ("ok", "skipped", "failed") if s in counts)
        data["finished"] = True
        data["machine"] = load_seen(self.facts)
        self.write()


def not_reached(what: str) -> dict:
    return {"status": "skipped", "reason": f"not reached: the run stopped before this {what} began"}


def write_json(path: Path, data: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(without_paths(json.dumps(data, indent=2, default=str)))
    os.replace(partial, path)


def without_paths(text: str) -> str:
    """Results are committed: this machine's folders in tracebacks and logs become placeholders."""
    folders = {
        sys.prefix: "<venv>",
        sys.base_prefix: "<python>",
        str(HERE.parent): "<repo>",
        tempfile.gettempdir(): "<tmp>",
        str(Path.home()): "<home>",
    }
    for folder in sorted(folders, key=len, reverse=True):  # the venv before the repo holding it
        if len(folder) > 1:
            text = text.replace(folder, folders[folder])
    return text


def describe(entry: dict) -> str:
    if entry["status"] == "skipped":
        return entry["reason"] + (f" ({entry['detail']})" if entry.get("detail") else "")
    if entry["status"] == "failed":
        return entry["error"].splitlines()[0][:160] if entry["error"] else ""
    return entry.get("summary", "")


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Machine facts (in their own process: the suite's own process never touches the GPU).


def collect_facts() -> dict:
    import torch
    import torchvision

    facts: dict = {"torch": torch.__version__, "torchvision": torchvision.__version__}
    facts["cuda_available"] = torch.cuda.is_available()
    facts["gpu_count"] = torch.cuda.device_count() if facts["cuda_available"] else 0
    facts["cuda_runtime"] = torch.version.cuda
    facts["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    try:
        facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as error:  # a CPU-only torch has no NCCL
        facts["nccl"] = f"unavailable: {type(error).__name__}"
    facts["cuda_driver_api"] = cuda_driver_api_version()
    facts["gpus"] = []
    for index in range(facts["gpu_count"]):
        props = torch.cuda.get_device_properties(index)
        facts["gpus"].append(
            {
                "name": props.name,
                "memory_gib": round(props.total_memory / (1 << 30), 1),
                "capability": f"{props.major}.{props.minor}",
                "multiprocessors": props.multi_processor_count,
            }
        )
    facts["nvidia_smi"] = nvidia_smi_facts(facts["gpu_count"])
    facts["cpu_model"] = cpu_model()
    facts["cpus_usable"] = usable_cores()
    return facts


def cuda_driver_api_version() -> str | None:
    """The driver's CUDA API version (``cuDriverGetVersion``), e.g. ``"13.0"``; ``None`` without a driver."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def nvidia_smi(*arguments: str) -> str | None:
    """nvidia-smi's output, or ``None`` where it is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", *arguments], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def nvidia_smi_facts(gpu_count: int) -> dict | str:
    if shutil.which("nvidia-smi") is None:
        return "not found"
    fields = "index,name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max,power.limit,clocks.max.sm"
    facts: dict = {"query": (nvidia_smi(f"--query-gpu={fields}", "--format=csv") or "failed").strip().splitlines()}
    if gpu_count > 1:  # how the GPUs reach each other (NVLink or PCIe): what NCCL's figures rest on
        facts["topology"] = (nvidia_smi("topo", "-m") or "failed").rstrip().splitlines()
    return facts


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def filesystem_type(folder: Path) -> str | None:
    """The type of the file system holding ``folder`` (``ext4``, ``xfs``, ``tmpfs`` ...)."""
    best, kind = "", None
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            mount = fields[1]
            if str(folder).startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
                best, kind = mount, fields[2]
    except (OSError, IndexError):
        return None
    return kind


# nccl


def part_preflight(record: PartRecord, work: Path, sizes: dict, small: bool) -> None:
    """sparkgpu's node pre-flight GPU checks (visible, bf16 matmul against float64, NCCL
    all-reduce) on every GPU of this host, as a node runs them: a child interpreter each time."""
    import torch

    from sparkgpu.launch.node.preflight import check_gpus

    addresses = [str(i) for i in range(torch.cuda.device_count() if record.cuda else 0)]
    record.data["config"] = {"devices": addresses, "runs": sizes["preflight_repeats"]}
    record.data["method"] = method(
        "per run: sparkgpu.launch.node.preflight.check_gpus(all devices), wall time of the call",
        startup="included: each run starts its child interpreter, imports torch and initialises CUDA, as a node does",
        repeats=sizes["preflight_repeats"],
        statistic="median of the runs",
        check="every check passes on a healthy host",
    )

    def node_checks() -> dict:
        runs, checks = [], []
        for _ in range(sizes["preflight_repeats"]):
            started = time.perf_counter()
            checks = check_gpus(addresses)
            runs.append(time.perf_counter() - started)
        found = {
            "seconds": spread(runs),
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail, "seconds": c.seconds} for c in checks],
        }
        failed = [c for c in checks if not c.ok]
        found["summary"] = f"{len(checks)} checks in {statistics_median(runs):.2f} s, {len(failed)} failed"
        if failed:
            found["error"] = "; ".join(f"{c.name}: {c.detail}" for c in failed)
        return found

    record.measure("node_checks", node_checks, needs_cuda=True)


def part_nccl(record: PartRecord, work: Path, sizes: dict, small: bool) -> None:
    import torch

    world = torch.cuda.device_count() if record.cuda else 0
    record.data["config"] = {
        "world_size": world,
        "bytes": [mib * MiB for mib in sizes["transfer_mib"]],
        "dtype": "float32",
        "operation": "all_reduce (sum), in place",
        "launcher": f"python -m torch.distributed.run --nnodes=1 --nproc-per-node={world} --master-addr=127.0.0.1",
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
    }
    record.data["method"] = method(
        "per sample: a barrier, then `calls` all_reduce calls back to back between two "
        "torch.cuda.synchronize(), divided by `calls` (more calls for small sizes, so that a sample "
        "moves at least 256 MiB or makes 50 calls); the slowest rank's time per sample",
        startup="excluded: torchrun, NCCL init, a checked call and 2 warm-up calls per size come first",
        repeats=sizes["repeats"],
        statistic="median of the samples",
        formula="algbw = bytes / time (GB = 1e9 bytes); busbw = algbw * 2 * (n - 1) / n (nccl-tests)",
        check="every element after one all_reduce of ranks filled with rank + 1 equals n(n+1)/2, on every rank",
    )

    def all_reduce() -> dict:
        out = work / "nccl-rank0.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            f"--nproc-per-node={world}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            str(Path(__file__).resolve()),
            "--nccl-rank",
            str(out),
        ] + (["--small"] if small else [])
        returncode, log = run_stoppable(command, timeout=max(10.0, record.deadline - time.monotonic()))
        if returncode != 0 or not out.exists():
            raise RuntimeError(f"torchrun exited with {returncode}; its output ends:\n{log[-4000:]}")
        result = json.loads(out.read_text())
        largest = result["sizes"][-1]
        checks = (
            f"cuda:LOCAL_RANK {'ok' if result['cuda_local_rank_ok'] else 'WRONG'}, "
            f"sums {'correct' if result['all_correct'] else 'WRONG'}"
        )
        if world == 1:
            result["summary"] = f"1 rank: NCCL init ok, {checks}; bandwidth not meaningful with one rank"
        else:
            result["summary"] = (
                f"{world} ranks: busbw {largest['busbw_gb_per_s']:.0f} GB/s at {largest['bytes'] // MiB} MiB, {checks}"
            )
        if not (result["cuda_local_rank_ok"] and result["all_correct"]):
            result["error"] = f"a check failed: {result['summary']}"  # failed, with the figures beside it
        return result

    record.measure("all_reduce", all_reduce, needs_cuda=True)


def nccl_rank(out: str, small: bool) -> None:
    """One torchrun rank of the ``nccl`` part; rank 0 writes the results to ``out``."""
    import datetime

    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    props = torch.cuda.get_device_properties(device)
    placement = {
        "rank": rank,
        "local_rank": local_rank,
        "current_device": torch.cuda.current_device(),
        "device_name": props.name,
        "pci_bus_id": getattr(props, "pci_bus_id", None),
    }
    placements: list = [None] * world
    dist.all_gather_object(placements, placement)
    sizes = SIZES[small]
    rows = []
    for mib in sizes["transfer_mib"]:
        nbytes = mib * MiB
        x = torch.full((nbytes // 4,), float(rank + 1), device=device)
        dist.all_reduce(x)
        correct = torch.tensor([int(bool(torch.all(x == world * (world + 1) / 2)))], device=device)
        dist.all_reduce(correct, op=dist.ReduceOp.MIN)
        x.zero_()  # sums of zeros stay finite however many calls follow
        calls = max(1, min(50, (256 * MiB) // nbytes))
        for _ in range(sizes["warmups"]):
            dist.all_reduce(x)
        samples = []
        for _ in range(sizes["repeats"]):
            torch.cuda.synchronize()
            dist.barrier(device_ids=[local_rank])
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(x)
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - started) / calls)
        slowest = torch.tensor(samples, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds = spread(slowest.tolist())
        algbw = nbytes / seconds["median"] / 1e9
        rows.append(
            {
                "bytes": nbytes,
                "calls_per_sample": calls,
                "seconds": seconds,
                "algbw_gb_per_s": algbw,
                "busbw_gb_per_s": bus_bandwidth(algbw, world) if world > 1 else None,
                "correct": bool(correct.item()),
            }
        )
        del x
        torch.cuda.empty_cache()
    if rank == 0:
        buses = [p["pci_bus_id"] for p in placements]
        result = {
            "world_size": world,
            "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
            "placements": placements,
            "cuda_local_rank_ok": all(p["current_device"] == p["local_rank"] for p in placements)
            and (None in buses or len(set(buses)) == world),
            "all_correct": all(row["correct"] for row in rows),
            "sizes": rows,
        }
        if world == 1:
            result["busbw_note"] = "not meaningful with one rank: no data crosses a link (busbw = 0 by the formula)"
        write_json(Path(out), result)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_stoppable(command: list[str], timeout: float) -> tuple[int | None, str]:
    """Runs ``command`` in its own process group, stopped (SIGTERM, then SIGKILL) after ``timeout``."""
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(process)
            returncode = None
        log.seek(0)
        return returncode, log.read()


def stop(process: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


# h2d


def part_h2d(record: PartRecord, work: Path, sizes: dict, small: bool) -> None:
    import torch

    record.data["config"] = {
        "bytes": [mib * MiB for mib in sizes["transfer_mib"]],
        "image_batch": [sizes["image_batch"], 3, CROP, CROP],
        "device": "cuda:0",
    }
    record.data["method"] = method(
        "per sample: CUDA events around `calls` copies host -> device of the same buffer "
        "(tensor.copy_(non_blocking=True)); calls make a sample move at least 64 MiB",
        startup="excluded: buffers allocated, filled and copied twice before the samples",
        repeats=sizes["copy_repeats"],
        statistic="median of the samples",
        limit="PCIe generation x width from nvidia-smi (pcie.link.*.current, read before and right after "
        "the largest copy, as an idle link may run at a lower generation; and pcie.link.*.max), one direction, "
        "after line encoding; 'unknown' where nvidia-smi cannot tell",
        normalise="uint8 batch on the device -> float32, (x / 255 - mean) / std per channel, in CUDA events",
    )

    def events_time(work, calls: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def sampled(work, calls: int) -> dict:
        for _ in range(sizes["warmups"]):
            events_time(work, 1)
        return spread([events_time(work, calls) / calls for _ in range(sizes["copy_repeats"])])

    def pinned_vs_pageable() -> dict:
        query = "--query-gpu=pcie.link.gen.current,pcie.link.width.current"
        link = {
            "current_before": link_limit(nvidia_smi(query, "--format=csv")),
            "max": link_limit(nvidia_smi("--query-gpu=pcie.link.gen.max,pcie.link.width.max", "--format=csv")),
        }
        rows = []
        for mib in sizes["transfer_mib"]:
            nbytes = mib * MiB
            calls = max(1, (64 * MiB) // nbytes)
            device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            row: dict = {"bytes": nbytes, "calls_per_sample": calls}
            for kind in ("pinned", "pageable"):
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned").fill_(1)
                seconds = sampled(functools.partial(device.copy_, host, non_blocking=True), calls)
                row[f"{kind}_seconds"] = seconds
                row[f"{kind}_gb_per_s"] = nbytes / seconds["median"] / 1e9
                del host
            rows.append(row)
            del device
            torch.cuda.empty_cache()
        link["current_after_largest_copy"] = link_limit(nvidia_smi(query, "--format=csv"))
        limits = [v["limit_gb_per_s"] for v in link.values() if isinstance(v["limit_gb_per_s"], float)]
        limit = max(limits) if limits else "unknown"
        for row in rows:
            row["pinned_of_limit"] = row["pinned_gb_per_s"] / limit if limits else "unknown"
        largest = rows[-1]
        return {
            "link": link,
            "limit_gb_per_s": limit,
            "sizes": rows,
            "summary": f"{largest['bytes'] // MiB} MiB: pinned {largest['pinned_gb_per_s']:.1f} GB/s, "
            f"pageable {largest['pageable_gb_per_s']:.1f} GB/s, link limit "
            + (f"{limit:.1f} GB/s" if limits else "unknown"),
        }

    def image_batch() -> dict:
        shape = (sizes["image_batch"], 3, CROP, CROP)
        result: dict = {"shape": list(shape)}
        on_device = {}
        for dtype in (torch.uint8, torch.float32):
            name = str(dtype).replace("torch.", "")
            host = torch.empty(shape, dtype=dtype, pin_memory=True).fill_(1)
            device = torch.empty(shape, dtype=dtype, device="cuda")
            seconds = sampled(functools.partial(device.copy_, host, non_blocking=True), 1)
            nbytes = host.numel() * host.element_size()
            result[name] = {"bytes": nbytes, "copy_seconds": seconds, "gb_per_s": nbytes / seconds["median"] / 1e9}
            on_device[name] = device
        mean = torch.tensor(MEAN, device="cuda").view(1, 3, 1, 1)
        std = torch.tensor(STD, device="cuda").view(1, 3, 1, 1)
        images = on_device["uint8"]
        normalise = sampled(lambda: images.float().div_(255).sub_(mean).div_(std), 1)
        uint8, float32 = result["uint8"], result["float32"]
        uint8_path = uint8["copy_seconds"]["median"] + normalise["median"]
        result.update(
            normalise_on_device_seconds=normalise,
            bytes_ratio_float32_over_uint8=float32["bytes"] / uint8["bytes"],
            copy_time_ratio_float32_over_uint8=float32["copy_seconds"]["median"] / uint8["copy_seconds"]["median"],
            uint8_copy_plus_normalise_seconds=uint8_path,
            float32_copy_over_uint8_copy_plus_normalise=float32["copy_seconds"]["median"] / uint8_path,
            summary=f"batch {shape[0]}: uint8 {uint8['copy_seconds']['median'] * 1e3:.2f} ms "
            f"+ normalise {normalise['median'] * 1e3:.2f} ms vs float32 {float32['copy_seconds']['median'] * 1e3:.2f} ms",
        )
        return result

    record.measure("pinned_vs_pageable", pinned_vs_pageable, needs_cuda=True)
    record.measure("image_batch", image_batch, needs_cuda=True)


# jpeg


def _pool_worker_start() -> None:
    """One torch thread per process, as DataLoader gives its workers; the decoders imported."""
    import torch
    import torchvision.io  # noqa: F401
    import torchvision.transforms.v2.functional  # noqa: F401

    torch.set_num_threads(1)


def _cpu_torchvision_task(task) -> int:
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2 import functional as F

    encoded, boxes, flips = task
    crops = []
    for data, (top, left, height, width), flip in zip(encoded, boxes.tolist(), flips.tolist()):
        image = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        crop = F.resized_crop(image, top, left, height, width, [CROP, CROP], antialias=True)
        crops.append(F.horizontal_flip(crop) if flip else crop)
    return len(torch.stack(crops))


def _cpu_fused_task(task) -> int:
    from sparkgpu.data.augment import _jpeg

    encoded, boxes, flips = task
    return len(_jpeg.decode_crops(encoded, boxes, flips, (CROP, CROP), **_fused_options()))


@functools.lru_cache(maxsize=1)
def _fused_options() -> dict:
    """One decoding thread per pool process, as the torchvision path has, where the call takes ``threads=``."""
    import inspect

    from sparkgpu.data.augment import _jpeg

    return {"threads": 1} if "threads" in inspect.signature(_jpeg.decode_crops).parameters else {}


def _fused_facts() -> dict:
    from sparkgpu.data.augment import _jpeg

    facts: dict = {"threads_per_process": _fused_options().get("threads", "the function's default")}
    if hasattr(_jpeg, "native_available"):
        facts["native"] = bool(_jpeg.native_available())
        if not facts["native"] and hasattr(_jpeg, "native_unavailable_reason"):
            facts["native_unavailable_reason"] = _jpeg.native_unavailable_reason()
    return facts


def make_jpegs(folder: Path, count: int, workers: int) -> tuple[list[bytes], list[tuple[str, int]]]:
    """bench_images.py's JPEGs (500x375, smooth content + noise, quality 90: about 110 KB)."""
    import bench_images

    bench_images.make_images(folder, count, 90, workers, 24.0)
    files = bench_images.image_files(folder)
    return [Path(path).read_bytes() for path, _ in files], files


def part_jpeg(record: PartRecord, work: Path, sizes: dict, small: bool) -> None:
    import multiprocessing

    import numpy as np

    import bench_images

    cores = usable_cores()
    count, passes, batch = sizes["jpeg_images"], sizes["jpeg_passes"], sizes["jpeg_batch"]
    started = time.perf_counter()
    encoded, _ = make_jpegs(work / "jpeg-images", count, cores)
    boxes, flips = crop_boxes(count, bench_images.HEIGHT, bench_images.WIDTH)
    record.data["config"] = {
        "images": count,
        "image_size": [bench_images.WIDTH, bench_images.HEIGHT],
        "mean_jpeg_kb": float(np.mean([len(e) for e in encoded]) / 1e3),
        "quality": 90,
        "passes_per_sample": passes,
        "gpu_batch": batch,
        "pool_processes": cores,
        "pool_task_images": sizes["jpeg_task"],
        "make_seconds": time.perf_counter() - started,
    }
    record.data["method"] = method(
        f"per sample: {passes} pass(es) over the {count} JPEGs in memory, decode + crop to the same "
        "RandomResizedCrop boxes (computed once, torchvision's algorithm) resized to 224x224 with "
        "antialias + the same flips, to uint8 (3, 224, 224); GPU: nvJPEG batches of gpu_batch then "
        "transforms.v2.functional per image on the device, ended by torch.cuda.synchronize(); CPU: a "
        "process pool of every core (one torch thread each), tasks of pool_task_images, each stacking "
        "its crops and returning their count (bytes in, nothing back, as bench_images.py's ceiling)",
        startup="excluded: one warm-up batch on the GPU, one warm-up task per pool process before the samples",
        repeats=sizes["jpeg_repeats"],
        statistic="median of the samples",
        per_core="CPU images/s divided by the pool's processes; the GPU paths use one CPU core to drive it",
    )
    total = count * passes
    tasks = [
        (encoded[i : i + sizes["jpeg_task"]], boxes[i : i + sizes["jpeg_task"]], flips[i : i + sizes["jpeg_task"]])
        for i in range(0, count, sizes["jpeg_task"])
    ]

    def rates(seconds: list[float], processes: int) -> dict:
        timing = spread(seconds)
        rate = total / timing["median"]
        return {"images": total, "seconds": timing, "images_per_s": rate, "images_per_s_per_core": rate / processes}

    def gpu(crop: bool):
        def measure() -> dict:
            import torch
            from torchvision.io import ImageReadMode, decode_jpeg
            from torchvision.transforms.v2 import functional as F

            tensors = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in encoded]
            box_list, flip_list = boxes.tolist(), flips.tolist()

            def one_pass(images_in_pass: int = count) -> None:
                for first in range(0, images_in_pass, batch):
                    images = decode_jpeg(tensors[first : first + batch], mode=ImageReadMode.RGB, device="cuda")
                    if not crop:
                        continue
                    out = torch.empty((len(images), 3, CROP, CROP), dtype=torch.uint8, device="cuda")
                    for i, image in enumerate(images):
                        top, left, height, width = box_list[first + i]
                        cropped = F.resized_crop(image, top, left, height, width, [CROP, CROP], antialias=True)
                        out[i] = F.horizontal_flip(cropped) if flip_list[first + i] else cropped

            one_pass(batch)  # nvJPEG's handles and buffers, the resize kernels
            torch.cuda.synchronize()
            seconds = []
            for _ in range(sizes["jpeg_repeats"]):
                begun = time.perf_counter()
                for _ in range(passes):
                    one_pass()
                torch.cuda.synchronize()
                seconds.append(time.perf_counter() - begun)
            result = rates(seconds, 1)
            on_gpu = decode_jpeg(tensors[0], mode=ImageReadMode.RGB, device="cuda").cpu()
            on_cpu = decode_jpeg(tensors[0], mode=ImageReadMode.RGB)
            result["max_abs_diff_vs_cpu_decode"] = int((on_gpu.int() - on_cpu.int()).abs().max())
            result["summary"] = f"{result['images_per_s']:,.0f} images/s on one GPU"
            return result

        return measure

    def cpu(task_fn, facts=None):
        def measure() -> dict:
            import torch

            threads = torch.get_num_threads()
            _pool_worker_start()  # imported here once, the forked processes find the modules loaded
            context = multiprocessing.get_context("fork")  # as DataLoader's workers start
            with concurrent.futures.ProcessPoolExecutor(
                cores, mp_context=context, initializer=_pool_worker_start
            ) as pool:
                list(pool.map(task_fn, tasks[:cores]))  # every process started, its imports done
                seconds = []
                for _ in range(sizes["jpeg_repeats"]):
                    begun = time.perf_counter()
                    done = sum(sum(pool.map(task_fn, tasks)) for _ in range(passes))
                    seconds.append(time.perf_counter() - begun)
                    assert done == total, (done, total)
            torch.set_num_threads(threads)
            result = rates(seconds, cores)
            result["processes"] = cores
            result.update(facts() if facts else {})
            result["summary"] = (
                f"{result['images_per_s']:,.0f} images/s on {cores} cores "
                f"({result['images_per_s_per_core']:,.0f} per core)"
            )
            if result.get("native") is False:
                result["summary"] += "; its Python fallback, the native path is not built"
            return result

        return measure

    gpu_decode = record.measure("nvjpeg_decode", gpu(crop=False), needs_cuda=True)
    gpu_full = record.measure("nvjpeg_decode_crop_flip", gpu(crop=True), needs_cuda=True)
    cpu_tv = record.measure("cpu_torchvision", cpu(_cpu_torchvision_task))
    try:
        from sparkgpu.data.augment import _jpeg  # noqa: F401

        fused = record.measure("cpu_fused", cpu(_cpu_fused_task, _fused_facts))
    except Exception as error:  # the fused path is optional: a project without it says so
        fused = {
            "status": "skipped",
            "reason": f"sparkgpu.data.augment._jpeg not available: {type(error).__name__}: {error}",
        }
        record.data["measurements"]["cpu_fused"] = fused
        print(f"[jpeg] cpu_fused: skipped  {fused['reason']}", flush=True)
        record.write()
    ratios = {}
    for name, entry in (("cpu_torchvision", cpu_tv), ("cpu_fused", fused)):
        if gpu_full["status"] == "ok" and entry["status"] == "ok":
            ratios[f"nvjpeg_decode_crop_flip_over_{name}"] = gpu_full["images_per_s"] / entry["images_per_s"]
    if gpu_decode["status"] == "ok" and gpu_full["status"] == "ok":
        ratios["crop_flip_share_of_gpu_time"] = 1 - gpu_decode["seconds"]["median"] / gpu_full["seconds"]["median"]
    record.data["ratios"] = ratios


# resnet_wait


def evict_from_page_cache(folder: Path) -> bool:
    """Asks the kernel to drop ``folder``'s files from the page cache, so reading them is cold."""
    try:
        for path in folder.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)  # dirty pages are not dropped
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    except (OSError, AttributeError):
        return False
    return True


def timed_steps(loader_or_batches, step, sync, warmup: int, timed: int, batch: int) -> dict:
    """Runs ``warmup + timed`` steps; per timed step, the time in ``next()`` and the whole step."""
    started = time.perf_counter()
    iterator = iter(loader_or_batches)
    waits, steps, startup = [], [], None
    for number in range(warmup + timed):
        begun = time.perf_counter()
        item = next(iterator, None)
        got = time.perf_counter()
        if item is None:
            raise RuntimeError(f"the batches ended after {number} steps; {warmup + timed} were expected")
        if startup is None:
            startup = got - started
        step(item)
        sync()
        ended = time.perf_counter()
        if number >= warmup:
            waits.append(got - begun)
            steps.append(ended - begun)
    total, waited = sum(steps), sum(waits)
    return {
        "steps": timed,
        "warmup_steps": warmup,
        "startup_s": startup,
        "timed_s": total,
        "wait_s": waited,
        "wait_fraction": waited / total,
        "steps_per_s": timed / total,
        "images_per_s": timed * batch / total,
        "step_seconds": spread(steps),
        "wait_seconds": spread(waits),
    }


def part_resnet_wait(record: PartRecord, work: Path, sizes: dict, small: bool) -> None:
    import bench_images
    import torch

    cuda = bool(record.cuda)
    batch, warmup, timed = sizes["resnet_batch"], sizes["resnet_warmup"], sizes["resnet_timed"]
    rows, workers = (warmup + timed) * batch, max(1, usable_cores() - 1)
    started = time.perf_counter()
    _, files = make_jpegs(work / "resnet-images", sizes["resnet_unique"], usable_cores())
    # The unique JPEGs repeated to one epoch of exactly the steps run: decoding costs the same.
    epoch = [files[i % len(files)] for i in range(rows)]
    shards = work / "mds"
    bench_images.write_mds(epoch, shards)
    fused, why_not = fused_decode_available()
    record.data["config"] = {
        "model": "torchvision.models.resnet50(weights=None), channels_last, bf16 autocast, SGD(lr=0.1, momentum=0.9)",
        "batch_size": batch,
        "warmup_steps": warmup,
        "timed_steps": timed,
        "samples": rows,
        "unique_jpegs": len(files),
        "shard_mb": sum(p.stat().st_size for p in shards.rglob("*") if p.is_file()) / 1e6,
        "num_workers": workers,
        "pin_memory": cuda,
        "device": "cuda" if cuda else None,
        "decode": FUSED_DECODE if fused else TRANSFORM_DECODE,
        "decode_of_cache_train_transform": TRANSFORM_DECODE,
        "on_device": "uint8 batch -> float32, (x / 255 - mean) / std, channels_last",
        "work_filesystem": filesystem_type(work),
        "make_seconds": time.perf_counter() - started,
    }
    record.data["method"] = method(
        "per step: the time in next() (the wait) and from next() to the end of forward, backward and "
        "SGD step plus torch.cuda.synchronize() (the step); wait_fraction = sum of waits / sum of steps "
        "over the timed steps. The synchronize ends every step so that time in next() is time the GPU had "
        "nothing queued; without it next() would overlap queued GPU work and overstate the wait",
        startup="construction to first batch reported apart as startup_s; warm-up steps (worker start, "
        "cuDNN autotuning, the first shards) excluded",
        repeats=1,
        statistic="one run of the timed steps per source (the budget allows no repeats)",
        sources="cache: local= the shards' folder, on this machine's disk, just written (in the page cache). "
        "volume: remote= the same folder as a volume (fsspec file system), local= a fresh cache folder, the "
        "volume's files dropped from the page cache first (posix_fadvise), so the epoch reads cold and copies "
        "every shard into the cache; a loopback volume, not an object store's latency",
        ceiling="model_only: the same steps on one batch already on the GPU (no wait)",
        loader_only="the loader alone from each source with the same settings, each batch on the device "
        "(where there is one) and nothing else done: the most it could feed",
    )
    if cuda:
        torch.backends.cudnn.benchmark = True
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model_step = None

    def training_step():
        nonlocal model_step
        if model_step is None:
            model_step = make_train_step()
        return model_step

    def loader(source: str, use_fused: bool):
        from sparkgpu import data

        options = dict(
            batch_size=batch,
            shuffle=True,
            seed=0,
            drop_last=True,
            num_workers=workers,
            pin_memory=cuda,
            device="cuda" if cuda else None,
        )
        if use_fused:
            options["decode"] = {"image": data.RandomResizedCrop(CROP)}
        else:
            options["transform"] = bench_images.sparkgpu_transform
        if source == "cache":
            return data.dataset(local=str(shards), **options), None
        cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
        evicted = evict_from_page_cache(shards)
        return data.dataset(remote=str(shards), local=str(cache), **options), {
            "page_cache_dropped": evicted,
            "cache": cache,
        }

    def run(source: str, train: bool, use_fused: bool = fused):
        def measure() -> dict:
            ds, notes = loader(source, use_fused)
            try:
                step = training_step() if train else (lambda batch: None)
                result = timed_steps(ds, step, sync, warmup, timed, batch)
                result["loader_stats"] = ds.stats()  # the loader's own wait figures, warm-up included
            finally:
                ds.close()
                if notes:  # the volume's cache: gone, so the next volume run is cold too
                    shutil.rmtree(notes.pop("cache"), ignore_errors=True)
            result.update(notes or {})
            result["summary"] = (
                f"wait {result['wait_fraction']:.0%} of step time, {result['images_per_s']:,.0f} images/s"
                if train
                else f"{result['images_per_s']:,.0f} images/s from the loader alone"
            )
            return result

        return measure

    def model_only() -> dict:
        step = training_step()
        images = torch.randint(0, 256, (batch, 3, CROP, CROP), dtype=torch.uint8, device="cuda")
        labels = torch.randint(0, 10, (batch,), device="cuda")
        result = timed_steps(_repeat({"image": images, "label": labels}), step, sync, warmup, timed, batch)
        result["summary"] = f"{result['images_per_s']:,.0f} images/s with the batch already on the GPU"
        return result

    entries = {
        "model_only": record.measure("model_only", model_only, needs_cuda=True),
        "cache_train": record.measure("cache_train", run("cache", True), needs_cuda=True),
        "volume_train": record.measure("volume_train", run("volume", True), needs_cuda=True),
    }
    if fused or not cuda:
        entries["cache_train_transform"] = record.measure(
            "cache_train_transform", run("cache", True, use_fused=False), needs_cuda=True
        )
    else:
        entries["cache_train_transform"] = {
            "status": "skipped",
            "reason": f"the runs above already decode with transform= ({why_not})",
        }
        record.data["measurements"]["cache_train_transform"] = entries["cache_train_transform"]
    entries |= {
        "cache_loader_only": record.measure("cache_loader_only", run("cache", False)),
        "volume_loader_only": record.measure("volume_loader_only", run("volume", False)),
    }
    ok = {k: v for k, v in entries.items() if v["status"] == "ok"}
    ratios = {f"{k}_wait_fraction": v["wait_fraction"] for k, v in ok.items() if "_train" in k}
    if "model_only" in ok:
        for key in ("cache_train", "volume_train", "cache_train_transform"):
            if key in ok:
                ratios[f"{key}_of_model_only"] = ok[key]["images_per_s"] / ok["model_only"]["images_per_s"]
    record.data["ratios"] = ratios


FUSED_DECODE = (
    'fused: decode={"image": sparkgpu.data.RandomResizedCrop(224)}, the path the loader\'s docs recommend '
    "(crop and flip decided from the JPEG header, only the crop decoded)"
)
TRANSFORM_DECODE = (
    "generic: transform=bench_images.sparkgpu_transform (the whole JPEG decoded with torchvision.io, "
    "then transforms.v2 RandomResizedCrop(224) + flip)"
)


def fused_decode_available() -> tuple[bool, str]:
    """Whether the loader takes ``decode={"image": data.RandomResizedCrop(...)}``; if not, why."""
    import inspect

    from sparkgpu import data

    try:
        data.RandomResizedCrop  # noqa: B018
    except AttributeError as error:
        return False, f"sparkgpu.data.RandomResizedCrop not available: {error}"
    if "decode" not in inspect.signature(data.dataset).parameters:
        return False, "sparkgpu.data.dataset takes no decode="
    return True, ""


def _repeat(item):
    while True:
        yield item


def make_train_step():
    """ResNet-50 (channels_last, bf16 autocast, SGD) on the GPU: ``step(batch)``, batch of uint8 images."""
    import torch
    import torchvision

    model = torchvision.models.resnet50(weights=None).to("cuda", memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mean = torch.tensor(MEAN, device="cuda").view(1, 3, 1, 1)
    std = torch.tensor(STD, device="cuda").view(1, 3, 1, 1)

    def step(batch) -> None:
        images = batch["image"].to("cuda", non_blocking=True)
        labels = batch["label"].to("cuda", non_blocking=True)
        x = images.float().div_(255).sub_(mean).div_(std).contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def part_predict(record: PartRecord, work: Path, sizes: dict, small: bool) -> None:
    """spark.gpu.predict's executor path on the GPU, without Spark: Arrow batches as Spark hands
    them (10,000 rows) scored by an MLP, against predict_batch_udf's data path (each batch to
    pandas, to numpy, to the device, back); and batched generation by a small Llama with its
    prompts sorted by length, against the same batches in input order."""
    import numpy as np
    import pyarrow as pa
    import torch

    sys.path.insert(0, str(HERE.parent))
    from sparkgpu.predict import GenerationConfig, resolve_model
    from sparkgpu.predict.executor.generation import generate_completions
    from sparkgpu.predict.executor.scoring import ScoringPlan, score_partition

    rows, features, batch = sizes["predict_rows"], 32, 8192
    record.data["config"] = {"rows": rows, "features": features, "batch_size": batch, "spark_batch_rows": 10_000}
    record.data["method"] = method(
        "wall time to score every row (tabular) or generate every completion, torch.cuda.synchronize() at the end",
        startup="excluded: one untimed pass per side first (model on the device, CUDA kernels loaded)",
        repeats=sizes["predict_repeats"],
        statistic="median",
    )
    rng = np.random.default_rng(0)
    data = rng.normal(size=(rows, features)).astype(np.float32)
    names = [f"f{i}" for i in range(features)]
    batches = [
        pa.RecordBatch.from_arrays([pa.array(data[s : s + 10_000, j]) for j in range(features)], names=names)
        for s in range(0, rows, 10_000)
    ]
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(features, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 1),
    )

    def timed(fn) -> list[float]:
        fn()
        out = []
        for _ in range(sizes["predict_repeats"]):
            started = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - started)
        return out

    def tabular() -> dict:
        plan = ScoringPlan(
            source=resolve_model(model),
            task="predict",
            input_cols=tuple(names),
            output_col="prediction",
            result_type=pa.float32(),
            batch_size=batch,
            chunk_rows=batch * 8,
            use_cuda=True,
        )
        on_device = model.to("cuda").eval()

        def ours():
            for _ in score_partition(plan, iter(batches)):
                pass

        def pandas_path():  # predict_batch_udf: Arrow -> pandas -> numpy -> the model -> pandas -> Arrow
            for record_batch in batches:
                frame = record_batch.to_pandas()
                x = frame.to_numpy(np.float32)
                outputs = []
                with torch.inference_mode():
                    for s in range(0, len(x), batch):
                        outputs.append(on_device(torch.from_numpy(x[s : s + batch]).to("cuda")).cpu().numpy()[:, 0])
                frame["prediction"] = np.concatenate(outputs)
                pa.RecordBatch.from_pandas(frame)

        ours_s, pandas_s = timed(ours), timed(pandas_path)
        ratio = statistics_median(pandas_s) / statistics_median(ours_s)
        return {
            "ours_rows_per_s": spread([rows / t for t in ours_s], higher_is_better=True),
            "pandas_path_rows_per_s": spread([rows / t for t in pandas_s], higher_is_better=True),
            "ratio": ratio,
            "summary": f"{rows / statistics_median(ours_s):,.0f} rows/s, {ratio:.2f}x the pandas path",
        }

    def generate() -> dict:
        from transformers import LlamaConfig, LlamaForCausalLM

        vocab, count, new = 512, sizes["predict_prompts"], sizes["predict_new_tokens"]
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=512,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        lm = LlamaForCausalLM(config).to("cuda").eval()

        class Words:  # a tokenizer of numbers: "17 4 99" -> [17, 4, 99]
            pad_token_id, eos_token, pad_token, padding_side = 0, "2", "0", "left"

            def __call__(self, texts, add_special_tokens=True):
                return {"input_ids": [[int(w) for w in t.split()] for t in texts]}

            def decode(self, ids, skip_special_tokens=True):
                return " ".join(str(int(i)) for i in ids)

        prompts = [
            " ".join(str(int(v)) for v in rng.integers(3, vocab, size=int(n))) for n in rng.integers(4, 200, size=count)
        ]
        settings = GenerationConfig(max_new_tokens=new, batch_size=32, extra={"min_new_tokens": new})
        tokens = count * new

        def ours():
            generate_completions(lm, Words(), prompts, prompts, settings, device="cuda")

        def in_order():  # the same batches without sorting by length
            for s in range(0, count, 32):
                generate_completions(lm, Words(), prompts[s : s + 32], prompts[s : s + 32], settings, device="cuda")

        ours_s, order_s = timed(ours), timed(in_order)
        ratio = statistics_median(order_s) / statistics_median(ours_s)
        return {
            "ours_tokens_per_s": spread([tokens / t for t in ours_s], higher_is_better=True),
            "in_order_tokens_per_s": spread([tokens / t for t in order_s], higher_is_better=True),
            "ratio": ratio,
            "summary": f"{tokens / statistics_median(ours_s):,.0f} new tokens/s, {ratio:.2f}x unsorted batches",
        }

    record.measure("tabular", tabular, needs_cuda=True)
    record.measure("generate", generate, needs_cuda=True)


def part_sft(record: PartRecord, work: Path, sizes: dict, small: bool) -> None:
    """The SFT loader against what a training step consumes: the loader alone (on any machine),
    a Llama's training steps on one batch resident on the GPU, and the same steps fed by the loader."""
    import numpy as np
    import pyarrow as pa
    import torch

    sys.path.insert(0, str(HERE.parent))
    from sparkgpu import data

    seq_len, batch = sizes["sft_seq_len"], sizes["sft_batch"]
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(5.0, 1.2, sizes["sft_documents"]).astype(int), 20, seq_len)
    ids = [rng.integers(3, 32000, n, dtype=np.int32) for n in lengths.tolist()]
    masks = [np.r_[np.zeros(n // 3, np.uint8), np.ones(n - n // 3, np.uint8)] for n in lengths.tolist()]
    url = data.to_mds(pa.table({"input_ids": ids, "loss_mask": masks}), str(work / "sft"), progress=False).url
    record.data["config"] = {
        "documents": len(lengths),
        "tokens": int(lengths.sum()),
        "seq_len": seq_len,
        "batch_size": batch,
        "model": f"LlamaForCausalLM, hidden {sizes['sft_hidden']}, {sizes['sft_layers']} layers, bf16, sdpa",
    }
    record.data["method"] = method(
        "row tokens (batch x seq_len) per second: the loader over whole epochs for a window; training "
        "steps (forward, backward, AdamW) with torch.cuda.synchronize() at the end",
        startup="excluded: the loader's first batch, and 3 untimed training steps per side",
        repeats=1,
        workers="none (num_workers=0), one process",
    )

    def loader():
        return data.sft_dataset(local=url, seq_len=seq_len, batch_size=batch, shuffle=True, rank=0, world_size=1)

    def loader_only() -> dict:
        rows = loader()
        first, count = None, 0
        while first is None or time.perf_counter() - first < sizes["sft_loader_s"]:
            for item in rows:
                if first is None:
                    first = time.perf_counter()
                    continue
                count += item["input_ids"].numel()
        rate = count / (time.perf_counter() - first)
        rows.close()
        return {"row_tokens_per_s": rate, "summary": f"{rate:,.0f} row tokens/s"}

    def steps(fed: bool) -> dict:
        model = llama(sizes["sft_hidden"], sizes["sft_layers"], seq_len, attention="sdpa")
        model = model.to("cuda", dtype=torch.bfloat16).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        rows = loader()
        source = iter(rows)

        def next_batch() -> dict:
            nonlocal source
            try:
                item = next(source)
            except StopIteration:  # a new epoch
                source = iter(rows)
                item = next(source)
            keys = ("input_ids", "labels", "position_ids")
            return {k: item[k].pin_memory().to("cuda", non_blocking=True) for k in keys}

        resident = next_batch()
        for index in range(3 + sizes["sft_steps"]):
            if index == 3:
                torch.cuda.synchronize()
                started = time.perf_counter()
            inputs = next_batch() if fed else resident
            loss = model(**inputs).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        rate = sizes["sft_steps"] * batch * seq_len / (time.perf_counter() - started)
        rows.close()
        return {"row_tokens_per_s": rate, "summary": f"{rate:,.0f} row tokens/s"}

    alone = record.measure("loader_only", loader_only)
    resident = record.measure("step_resident", lambda: steps(fed=False), needs_cuda=True)
    fed = record.measure("step_fed", lambda: steps(fed=True), needs_cuda=True)
    if all(entry["status"] == "ok" for entry in (alone, resident, fed)):
        record.data["ratios"] = {
            "loader alone / resident steps": alone["row_tokens_per_s"] / resident["row_tokens_per_s"],
            "fed steps / resident steps": fed["row_tokens_per_s"] / resident["row_tokens_per_s"],
        }
        record.write()


def statistics_median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


PART_FUNCTIONS = {
    "preflight": part_preflight,
    "nccl": part_nccl,
    "hf": part_hf,
    "h2d": part_h2d,
    "jpeg": part_jpeg,
    "resnet_wait": part_resnet_wait,
    "predict": part_predict,
    "sft": part_sft,
}


def run_part_here(args) -> None:
    """The ``--part`` process: one part, its results file rewritten after every measurement."""
    facts = json.loads(Path(args.facts).read_text())
    record = PartRecord(args.part, Path(args.out), facts, args.small, args.cap_s)
    try:
        import torch

        record.cuda = torch.cuda.is_available()
        record.data["cuda_available"] = record.cuda
        work = Path(tempfile.mkdtemp(prefix=f"{args.part}-", dir=args.work_dir))
        PART_FUNCTIONS[args.part](record, work, SIZES[args.small], args.small)
    except Exception as error:
        record.finish(error)
        raise
    record.finish()


# The suite.


def skipped_part(part: str, reason: str, facts: dict, detail: str | None = None) -> dict:
    entry = {"status": "skipped", "reason": reason} | ({"detail": detail} if detail else {})
    return {
        "part": part,
        **entry,
        "measurements": {key: dict(entry) for key in PLANNED[part]},
        "machine": facts,
    }


def run_facts(work: Path) -> dict:
    returncode, log = run_stoppable([sys.executable, str(Path(__file__).resolve()), "--facts-only"], FACTS_TIMEOUT_S)
    lines = [line for line in log.splitlines() if line.startswith("FACTS ")]
    if returncode == 0 and lines:
        return json.loads(lines[-1][len("FACTS ") :])
    return {"status": "failed", "error": f"the facts process exited with {returncode}", "traceback": log[-4000:]}


def run_part_process(part: str, args, cap: float, facts_path: Path, work: Path, facts: dict) -> dict:
    out = Path(args.out)
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--part",
        part,
        "--facts",
        str(facts_path),
        "--out",
        str(out),
        "--work-dir",
        str(work),
        "--cap-s",
        f"{cap:.0f}",
    ] + (["--small"] if args.small else [])
    started = time.perf_counter()
    errors = work / f"{part}.stderr"
    with open(errors, "w") as stderr:
        process = subprocess.Popen(command, stderr=stderr, start_new_session=True)
        try:
            returncode: int | None = process.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            stop(process)
            returncode = None
        except BaseException:  # Ctrl-C: the part's processes go too
            stop(process)
            raise
    tail = errors.read_text(errors="replace")[-6000:]
    path = out / f"gpu-{part}.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        record = {"part": part, "measurements": {key: not_reached("measurement") for key in PLANNED[part]}}
        record["machine"] = facts
    if returncode is None:
        record.update(status="failed", error=f"timed out: stopped at this part's cap of {cap:.0f} s")
        record["traceback"] = "(stopped from outside; the part's error output ends:)\n" + tail
    elif not record.get("finished"):
        record.update(status="failed", error=f"the part's process exited with {returncode} before finishing")
        record["traceback"] = record.get("traceback") or tail
    elif returncode != 0 and record["status"] != "failed":
        record["exit"] = f"the part's process exited with {returncode} after writing its results"
    record.pop("finished", None)
    record["wall_s"] = time.perf_counter() - started
    record["cap_s"] = cap
    write_json(path, record)
    return record


def table(records: dict) -> str:
    lines = [f"{'part':12s} {'measurement':26s} {'status':8s} result"]
    for part, record in records.items():
        lines.append(f"{part:12s} {'(part)':26s} {record['status']:8s} {describe(record)}")
        for key, entry in record.get("measurements", {}).items():
            lines.append(f"{'':12s} {key:26s} {entry['status']:8s} {describe(entry)}")
    return "\n".join(lines)


def suite_command(small: bool, selected: list[str], budget_s: float) -> str:
    """The command line of a run, from its options (no folder of this machine goes in)."""
    words = ["python", "benchmarks/gpu_suite.py", "--budget-s", f"{budget_s:g}"]
    if selected != list(PARTS):
        words += ["--only", ",".join(selected)]
    return " ".join(words + (["--small"] if small else []))


class SuiteFile:
    """``gpu-suite.json``: every run's entry, this invocation's appended last and rewritten as it goes.

    The file is read once, before this run writes anything: the earlier entries of ``runs`` and the
    file's other keys are written back exactly as read, so a run never edits another's record.
    """

    def __init__(self, path: Path):
        self.path = path
        try:
            self.document = json.loads(path.read_text())
        except FileNotFoundError:
            self.document = {"suite": "gpu", "runs": []}
        except ValueError as error:
            raise SystemExit(
                f"{path.name} is not JSON ({error}): move it aside, or pass another --out, before running the suite"
            ) from None
        if not isinstance(self.document.get("runs", []), list):
            raise SystemExit(f"{path.name}: 'runs' is not a list; move the file aside or pass another --out")
        self.earlier = list(self.document.get("runs", []))

    def write(self, run: dict) -> None:
        write_json(self.path, {**self.document, "runs": [*self.earlier, run]})


def run_suite(args) -> dict:
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    selected = [p for p in PARTS if p in args.only]
    suite_file = SuiteFile(out / "gpu-suite.json")
    suite: dict = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": suite_command(args.small, selected, args.budget_s),
        "options": {"small": args.small, "only": selected, "budget_s": args.budget_s},
        "parts": {},
    }
    for part in PARTS:
        reason = not_reached("part") if part in selected else {"status": "skipped", "reason": "not selected (--only)"}
        suite["parts"][part] = {"part": part, **reason}
    with tempfile.TemporaryDirectory(prefix="sparkgpu-gpu-suite-", dir=args.work_dir) as tmp:
        work = Path(tmp)
        facts = machine()
        facts["gpu"] = run_facts(work)
        suite["machine"] = facts
        suite_file.write(suite)
        facts_path = work / "facts.json"
        write_json(facts_path, facts)
        cuda = facts["gpu"].get("cuda_available")  # None: unknown, the parts find out themselves
        print(
            f"CUDA: {cuda}, GPUs: {facts['gpu'].get('gpu_count')}, "
            f"{', '.join(g['name'] for g in facts['gpu'].get('gpus', []))}",
            flush=True,
        )
        for index, part in enumerate(selected):
            left = args.budget_s - (time.monotonic() - started)
            later = sum(CAPS_S[p] for p in selected[index + 1 :] if not (cuda is False and p in GPU_ONLY))
            cap = min(left, max(CAPS_S[part], left - later))
            if cuda is False and part in GPU_ONLY:
                record = skipped_part(part, NO_CUDA, facts)
                write_json(out / f"gpu-{part}.json", record)
            elif cap < MIN_PART_S:
                detail = f"{left:.0f} s of --budget-s {args.budget_s:.0f} left, a part needs at least {MIN_PART_S} s"
                record = skipped_part(part, "budget", facts, detail)
                write_json(out / f"gpu-{part}.json", record)
            else:
                print(f"== {part} (cap {cap:.0f} s)", flush=True)
                record = run_part_process(part, args, cap, facts_path, work, facts)
            print(f"== {part}: {record['status']}  {describe(record)}", flush=True)
            suite["parts"][part] = record
            suite["seconds"] = time.monotonic() - started
            suite["machine"] = load_seen(facts)
            suite_file.write(suite)
    suite["seconds"] = time.monotonic() - started
    suite_file.write(suite)
    print(table(suite["parts"]), flush=True)
    return suite


def parse_only(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown part(s) {', '.join(unknown) or '(none)'}; pick from {','.join(PARTS)}"
        )
    return names


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="small sizes: an end-to-end check in about a minute")
    parser.add_argument(
        "--only", type=parse_only, default=list(PARTS), help=f"comma-separated parts of {','.join(PARTS)}"
    )
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds for the whole suite (default 480)")
    parser.add_argument("--out", default=str(RESULTS), help="folder for gpu-<part>.json and gpu-suite.json")
    parser.add_argument("--work-dir", default=None, help="where images, shards and caches go (default: system temp)")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--facts", help=argparse.SUPPRESS)
    parser.add_argument("--cap-s", type=float, default=600.0, help=argparse.SUPPRESS)
    parser.add_argument("--facts-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nccl-rank", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.nccl_rank:
        nccl_rank(args.nccl_rank, args.small)
    elif args.facts_only:
        print("FACTS " + json.dumps(collect_facts()), flush=True)
    elif args.part:
        run_part_here(args)
    else:
        run_suite(args)


if __name__ == "__main__":
    main()
