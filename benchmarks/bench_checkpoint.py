"""Checkpoint blocking time: how long one checkpoint of a ~1 GB training state stops the loop.

Peers in the same run, on the same model + AdamW state (parameters and both moments):
  * sparkgpu ``Checkpointer`` (async, the default), signed as inside a job (every file hashed,
    a MAC'd marker) and durable (files and folders fsynced before the marker): time the loop
    is blocked, for the first save (staging memory allocated) and the following ones (staging
    memory reused), and the time until the checkpoint is committed; where that time goes, phase
    by phase (``Checkpointer.last_save_phases``: staging copy, planning, writing, hashing beside
    the writes, fsync, commit); and the same save unsigned (outside a job)
  * sparkgpu ``Checkpointer(async_save=False)``, signed
  * ``torch.save`` of the model and optimizer ``state_dict()`` to one file, then fsync (the
    other peers make their data durable too)
  * ``torch.distributed.checkpoint.save`` (synchronous, FileSystemWriter defaults)
Ceilings measured in the same run:
  * one sequential write (+ fsync) of the same number of bytes from one buffer, in 64 MB
    stretches: the floor of a synchronous save that leaves all writing to disk to its fsync;
    and the same with each stretch handed to the disk as it is written, by ``fdatasync`` (what
    the Checkpointer did before) or by ``sync_file_range`` (what it does), which a save can
    come in under the plain write's time with
  * a memcpy of the same bytes into preallocated host memory: the floor of the async blocking
    time when the state lives in host memory (on a GPU it is a device-to-host copy)
  * the CPU time of hashing the same bytes on one thread, with the signed saves' BLAKE3 and with
    SHA-256 (what they hashed with before): a signed save spends it on the core beside the writes
Restore, the part of "restart -> first resumed step" after the process is up (page cache warm,
files just written):
  * ``Checkpointer.restore`` into a fresh model and optimizer, of the signed checkpoint (every
    file hashed and checked against the marker before anything is loaded)
  * ``torch.load`` + ``load_state_dict``
  * one sequential read of the same bytes into preallocated memory
Every timed save starts with the disk synced (``os.sync``, untimed) and with the files of its
own last save already removed (untimed: the Checkpointer's pruning of the older checkpoint, which
runs on a thread after the commit, is waited for; the others' old files are deleted before the
clock starts), so that no peer pays for the writes or deletes of another: on a disk mounted with
online discard a delete of 1 GB slows the writes after it. Each repeat runs the peers in an order
drawn afresh (seeded), so that no peer always follows the same one.
Per-step cost of ``maybe_save`` when no checkpoint is due, 2 gloo ranks with 5 ms steps (it
agrees on stop requests across ranks, reading the reduction one step late) next to an
``all_reduce`` of the same flags that each step waits for.

    python benchmarks/bench_checkpoint.py [--size-mb 1024] [--repeats 3] [--dir DIR] [--skip-ranks]

Writes benchmarks/results/checkpoint.json and checkpoint.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import cpu_mark, other_cpu_share  # noqa: E402
from sparkgpu.rundir.keyring import hold_job_key  # noqa: E402
from sparkgpu.train import Checkpointer  # noqa: E402
from sparkgpu.train._checkpoint_writes import WRITEOUT_BYTES, start_writeout  # noqa: E402

RESULTS = Path(__file__).parent / "results"
WIDTH = 2048
STEP_SECONDS = 0.005
STRETCH = WRITEOUT_BYTES  # the sequential writes' pieces: the stretch the Checkpointer hands to disk early


def build_state(size_mb: int):
    """A model of square Linear layers whose parameters + AdamW moments total ``size_mb``."""
    params_wanted = size_mb * 1e6 / (3 * 4)  # float32 parameter, exp_avg, exp_avg_sq
    layers = max(1, math.ceil(params_wanted / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def state_tensors(model, opt) -> list[torch.Tensor]:
    tensors = list(model.state_dict().values())
    for state in opt.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return tensors


def touch(model):
    """Changes every parameter a little, as a training step would, so each save writes new data."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)


def _fsync_file(path):
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def settled() -> None:
    """What every timed save starts from: memory the machine holds, and a synced disk.

    On a virtual machine whose balloon reports free memory back to the host, a write into
    page-cache pages the host took back costs the guest's kernel about ten times the CPU of a
    write into pages it holds (``copy_folio_from_iter_atomic`` under ``perf``); which save got
    such pages depended on how long ago other saves had freed theirs. Touching and freeing
    twice the state's size just before the clock starts gives every save pages the host
    backs, as on a machine without such a balloon. The sync: no peer pays for the writes of
    the one before it.
    """
    held = np.empty(2 * STATE_BYTES[0], dtype=np.uint8)
    held.fill(1)
    del held
    os.sync()


STATE_BYTES = [1 << 30]  # set by main() to the state's size


def timed(fn) -> float:
    settled()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def pruned(checkpointer) -> None:
    """Waits for the pruning that follows a Checkpointer's commit (on a thread of its own), so
    that its deletes land before the next peer's clock starts, not inside it."""
    checkpointer._settle()
    os.sync()


def signed(make):
    """``make()`` as inside a job: its Checkpointer signs with (and requires) a job's key."""
    hold_job_key(JOB_KEY)
    try:
        return make()
    finally:
        hold_job_key(None)


JOB_KEY = os.urandom(32)


def bench_saves(model, opt, root: Path, repeats: int, phases: dict[str, list[dict]]) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out: dict[str, list[float]] = {
        "sparkgpu_async_blocking_first": [],
        "sparkgpu_async_blocking": [],
        "sparkgpu_async_until_committed": [],
        "sparkgpu_async_until_committed_unsigned": [],
        "sparkgpu_sync": [],
        "torch_save_fsync": [],
        "dcp_save_sync": [],
        "ceiling_sequential_write": [],
        "ceiling_sequential_write_fdatasync_early": [],
        "ceiling_sequential_write_writeout_early": [],
        "ceiling_memcpy": [],
    }
    tensors = state_tensors(model, opt)
    total = sum(t.numel() for t in tensors)
    flat = torch.zeros(total, dtype=torch.float32)  # touched once: no page faults while timed

    ours = signed(lambda: Checkpointer(root / "sparkgpu_async", keep_last=1))
    ours_sync = signed(lambda: Checkpointer(root / "sparkgpu_sync", keep_last=1, async_save=False))
    unsigned = Checkpointer(root / "sparkgpu_unsigned", keep_last=1)

    def ours_async(rep):
        settled()  # as timed() does for the others
        started = time.perf_counter()
        ours.save(rep, model=model, optimizer=opt)
        key = "sparkgpu_async_blocking_first" if rep == 0 else "sparkgpu_async_blocking"
        out[key].append(ours.last_blocking_seconds)
        ours.wait()
        if rep:  # the first save is reported by its blocking time only: every peer runs `repeats` times
            out["sparkgpu_async_until_committed"].append(time.perf_counter() - started)
            phases["sparkgpu_async"].append(dict(getattr(ours, "last_save_phases", None) or {}))
        pruned(ours)

    def ours_unsigned(rep):
        settled()
        started = time.perf_counter()
        unsigned.save(rep, model=model, optimizer=opt, wait=True)
        out["sparkgpu_async_until_committed_unsigned"].append(time.perf_counter() - started)
        phases["sparkgpu_async_unsigned"].append(dict(getattr(unsigned, "last_save_phases", None) or {}))
        pruned(unsigned)

    def ours_synchronous(rep):
        # What the loop sees: the whole call, its commit included.
        out["sparkgpu_sync"].append(timed(lambda: ours_sync.save(rep, model=model, optimizer=opt)))
        phases["sparkgpu_sync"].append(dict(getattr(ours_sync, "last_save_phases", None) or {}))
        pruned(ours_sync)

    path = root / "torch_save.pt"

    def torch_save_fresh(rep):
        path.unlink(missing_ok=True)  # its last file goes before the clock starts, as DCP's folder does
        out["torch_save_fsync"].append(timed(torch_save))

    def torch_save():
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    dcp_dir = root / "dcp_sync"

    def dcp_save():
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(dcp_dir))

    def memcpy():
        offset = 0
        for t in tensors:
            n = t.numel()
            flat[offset : offset + n].copy_(t.reshape(-1))
            offset += n

    raw = root / "sequential.bin"

    def sequential_write_fresh(early: str):
        key = (
            "ceiling_sequential_write" + {"": "", "fdatasync": "_fdatasync_early", "writeout": "_writeout_early"}[early]
        )

        def peer(rep):
            raw.unlink(missing_ok=True)
            out[key].append(timed(lambda: sequential_write(early)))

        return peer

    def sequential_write(early: str = ""):
        """One buffer written in 64 MB stretches, then fsynced. ``early``: every stretch is
        handed to the disk as it is written, by ``fdatasync`` or by ``sync_file_range``
        (what the Checkpointer's streams do), or not at all."""
        data = memoryview(flat.numpy()).cast("B")
        with open(raw, "wb", buffering=0) as f:
            for offset in range(0, len(data), STRETCH):
                f.write(data[offset : offset + STRETCH])
                if early == "fdatasync":
                    os.fdatasync(f.fileno())
                elif early == "writeout":
                    start_writeout(f.fileno(), offset, STRETCH)
            os.fsync(f.fileno())

    def dcp_fresh(rep):
        shutil.rmtree(dcp_dir, ignore_errors=True)
        out["dcp_save_sync"].append(timed(dcp_save))

    peers = [
        ours_async,
        ours_unsigned,
        ours_synchronous,
        torch_save_fresh,
        dcp_fresh,
        lambda rep: out["ceiling_memcpy"].append(timed(memcpy)),
        sequential_write_fresh(""),
        sequential_write_fresh("fdatasync"),
        sequential_write_fresh("writeout"),
    ]
    touch(model)
    ours_async(0)  # the first save allocates the staging memory: reported apart, not in the draw
    order = random.Random(0)
    for rep in range(1, repeats + 1):
        touch(model)  # a training step; then every peer saves this same state
        # A fresh order each repeat: a rotation would keep each peer behind the same one, and
        # on this disk what the save before did (written, fsynced, freed) shows in the next.
        for peer in order.sample(peers, len(peers)):
            peer(rep)
    ours.close()
    ours_sync.close()
    unsigned.close()
    return out


def bench_restores(model, opt, root: Path, repeats: int, size_mb: int) -> dict:
    out: dict[str, list[float]] = {"sparkgpu_restore": [], "torch_load": [], "ceiling_sequential_read": []}
    fresh_model, fresh_opt = build_state(size_mb)
    raw = root / "sequential.bin"
    buffer = bytearray(os.path.getsize(raw))
    for _ in range(repeats):
        ckpt = signed(lambda: Checkpointer(root / "sparkgpu_async"))
        out["sparkgpu_restore"].append(timed(lambda: ckpt.restore(model=fresh_model, optimizer=fresh_opt)))
        ckpt.close()
        _assert_same(fresh_model, model)
        touch(fresh_model)

        def torch_load():
            state = torch.load(root / "torch_save.pt", weights_only=True)
            fresh_model.load_state_dict(state["model"])
            fresh_opt.load_state_dict(state["optimizer"])

        out["torch_load"].append(timed(torch_load))
        _assert_same(fresh_model, model)
        touch(fresh_model)

        def sequential_read():
            with open(raw, "rb", buffering=0) as f:
                view = memoryview(buffer)
                while view:
                    n = f.readinto(view)
                    view = view[n:]

        out["ceiling_sequential_read"].append(timed(sequential_read))
    return out


def _assert_same(restored, live):
    # Every peer saved the live state last: a restore that loaded something else is a bug.
    assert all(torch.equal(a, b) for a, b in zip(restored.state_dict().values(), live.state_dict().values()))


def _rank_overhead(rank: int, world: int, port: int, directory: str, steps: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ckpt = Checkpointer(directory, every_steps=10**9)
    group = dist.new_group(backend="gloo")
    flag = torch.zeros(2, dtype=torch.int32)

    def step():
        # A training step as the CPU sees it on a GPU: it waits while the device works.
        time.sleep(STEP_SECONDS)

    def bare(i):
        step()

    def with_maybe_save(i):
        step()
        ckpt.maybe_save(i)

    def with_blocking_all_reduce(i):
        # What agreeing on stop requests costs when each step waits for the reduction.
        step()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)

    timings = {}
    for name, loop in (
        ("bare", bare),
        ("maybe_save", with_maybe_save),
        ("blocking_all_reduce", with_blocking_all_reduce),
    ):
        for i in range(20):  # warm up
            loop(i)
        dist.barrier()
        started = time.perf_counter()
        for i in range(steps):
            loop(i)
        timings[name] = (time.perf_counter() - started) / steps
    if rank == 0:
        queue.put(
            {
                "step_seconds": STEP_SECONDS,
                "maybe_save_not_due_overhead_us": (timings["maybe_save"] - timings["bare"]) * 1e6,
                "blocking_all_reduce_overhead_us": (timings["blocking_all_reduce"] - timings["bare"]) * 1e6,
            }
        )
    ckpt.close()
    dist.destroy_process_group()


def bench_step_overhead(root: Path, steps: int = 500, world: int = 2) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_rank_overhead, args=(world, port, str(root / "overhead"), steps, queue), nprocs=world)
    result = queue.get(timeout=60)
    result.update(ranks=world, steps=steps)
    return result


def bench_hashes(model, opt, repeats: int) -> dict:
    """CPU seconds of one thread hashing the whole state, per algorithm (medians of ``repeats``)."""
    import hashlib

    from sparkgpu.train._digests import new_hasher

    views = [memoryview(t.detach().reshape(-1).numpy()).cast("B") for t in state_tensors(model, opt)]
    makers = {"blake3": new_hasher, "sha256": hashlib.sha256}
    seconds: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(repeats):
        for name, make in makers.items():
            hasher = make()
            started = time.thread_time()
            for view in views:
                hasher.update(view)
            seconds[name].append(time.thread_time() - started)
    return {name: round(statistics.median(values), 4) for name, values in seconds.items()}


def phase_medians(runs: list[dict]) -> dict:
    """The median of each phase over the repeats (seconds; bytes and files as counted)."""
    names = sorted({name for run in runs for name in run})
    return {name: statistics.median(run.get(name, 0.0) for run in runs) for name in names}


def summarise(samples: dict[str, list[float]]) -> dict:
    return {
        name: {"median_s": statistics.median(values), "min_s": min(values), "samples_s": values}
        for name, values in samples.items()
        if values
    }


def plot(summary: dict, path: Path, state_gb: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [
        ("sparkgpu_async_blocking", "sparkgpu async: blocking"),
        ("sparkgpu_async_blocking_first", "sparkgpu async: blocking (1st save)"),
        ("ceiling_memcpy", "ceiling: memcpy"),
        ("sparkgpu_async_until_committed", "sparkgpu async: until committed"),
        ("sparkgpu_sync", "sparkgpu sync"),
        ("dcp_save_sync", "dcp.save (sync)"),
        ("torch_save_fsync", "torch.save + fsync"),
        ("ceiling_sequential_write", "ceiling: one sequential write"),
    ]
    labels = [label for key, label in names if key in summary]
    values = [summary[key]["median_s"] for key, _ in names if key in summary]
    fig, ax = plt.subplots(figsize=(9, 4))
    bars = ax.barh(labels, values, color=["#2b7bba" if "sparkgpu" in label else "#999999" for label in labels])
    ax.bar_label(bars, fmt="%.3f s", padding=3)
    ax.invert_yaxis()
    ax.set_xlabel("seconds the training loop is blocked (median); sparkgpu signed, as in a job")
    ax.set_title(f"One checkpoint of {state_gb:.2f} GB (model + AdamW) in host memory, {os.cpu_count()} CPUs")
    ax.set_xlim(0, max(values) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="size of model + optimizer state")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on local disk)")
    parser.add_argument("--skip-ranks", action="store_true", help="skip the 2-rank maybe_save overhead")
    parser.add_argument("--out", default=str(RESULTS / "checkpoint.json"))
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    load_at_start = os.getloadavg()
    mark = cpu_mark()
    phases: dict[str, list[dict]] = {"sparkgpu_async": [], "sparkgpu_async_unsigned": [], "sparkgpu_sync": []}
    try:
        model, opt = build_state(args.size_mb)
        state_bytes = sum(t.numel() * t.element_size() for t in state_tensors(model, opt))
        STATE_BYTES[0] = state_bytes
        print(f"state: {state_bytes / 1e9:.2f} GB in {len(model)} layers, writing under {root}", flush=True)
        samples = bench_saves(model, opt, root, args.repeats, phases)
        other_share = other_cpu_share(mark)
        hash_cpu = bench_hashes(model, opt, args.repeats)
        samples.update(bench_restores(model, opt, root, args.repeats, args.size_mb))
        summary = summarise(samples)
        overhead = None if args.skip_ranks else bench_step_overhead(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: v["median_s"] for k, v in summary.items()}
    gbps = lambda key: state_bytes / 1e9 / med[key]  # noqa: E731
    report = {
        "question": "checkpoint blocking time, and restore time, for one model + AdamW state",
        "command": "python benchmarks/bench_checkpoint.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": "cpu (state in host memory)",
            "load_average_1min": os.getloadavg()[0],
            "load_average_at_start": [round(x, 2) for x in load_at_start],
            # Other processes' share of all cores while the saves ran (the kernel's counters).
            "other_cpu_share_during_saves": None if other_share is None else round(other_share, 3),
        },
        "state_bytes": state_bytes,
        "repeats": args.repeats,
        "signed": "sparkgpu's saves and restores as inside a job (signed), but sparkgpu_async_until_committed_unsigned",
        "results": summary,
        # One thread's CPU seconds to hash the whole state: the work a signed save adds.
        "hash_cpu_seconds": hash_cpu,
        "hash_cpu_blake3_over_sha256": round(hash_cpu["blake3"] / hash_cpu["sha256"], 3),
        # Medians over the repeats of Checkpointer.last_save_phases. hash_s runs on a helper
        # thread beside write_s; hash_wait_s is what of the hashing the writes did not hide,
        # writeback_s handing pages to the disk between the writes, fsync_s the final fsync of
        # every file.
        "phases": {name: phase_medians(runs) for name, runs in phases.items() if runs},
        "throughput_gb_per_s": {
            key: round(gbps(key), 3)
            for key in (
                "sparkgpu_async_until_committed",
                "sparkgpu_async_until_committed_unsigned",
                "sparkgpu_sync",
                "torch_save_fsync",
                "dcp_save_sync",
                "ceiling_sequential_write",
                "ceiling_sequential_write_fdatasync_early",
                "ceiling_sequential_write_writeout_early",
                "ceiling_memcpy",
                "sparkgpu_restore",
                "torch_load",
                "ceiling_sequential_read",
            )
        },
        "ratios": {
            "torch_save_fsync_over_sparkgpu_async_blocking": med["torch_save_fsync"] / med["sparkgpu_async_blocking"],
            "dcp_save_sync_over_sparkgpu_async_blocking": med["dcp_save_sync"] / med["sparkgpu_async_blocking"],
            "sparkgpu_async_blocking_over_memcpy_ceiling": med["sparkgpu_async_blocking"] / med["ceiling_memcpy"],
            "sparkgpu_sync_over_sequential_write_ceiling": med["sparkgpu_sync"] / med["ceiling_sequential_write"],
            # The goal of issue #40: committed (signed, durable) in at most 1.3x DCP's synchronous save.
            "sparkgpu_async_until_committed_over_dcp_save_sync": med["sparkgpu_async_until_committed"]
            / med["dcp_save_sync"],
            "sparkgpu_sync_over_dcp_save_sync": med["sparkgpu_sync"] / med["dcp_save_sync"],
            # Handing each 64 MB to the disk early, by sync_file_range, over by fdatasync.
            "writeout_early_over_fdatasync_early": med["ceiling_sequential_write_writeout_early"]
            / med["ceiling_sequential_write_fdatasync_early"],
            "sparkgpu_restore_over_sequential_read_ceiling": med["sparkgpu_restore"] / med["ceiling_sequential_read"],
            "torch_load_over_sparkgpu_restore": med["torch_load"] / med["sparkgpu_restore"],
        },
        "maybe_save_overhead": overhead,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    plot(summary, out.with_suffix(".png"), state_bytes / 1e9)
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        print(f"{key:<{width}}  median {value['median_s']:.3f} s  min {value['min_s']:.3f} s")
    for key, value in report["ratios"].items():
        print(f"{key}: {value:.2f}")
    print(
        "hash CPU, one thread, whole state: "
        + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in report["hash_cpu_seconds"].items())
    )
    for name, medians in report["phases"].items():
        print(f"{name} phases: " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items() if k.endswith("_s")))
    if overhead:
        print(
            f"per-step overhead, {overhead['ranks']} gloo ranks, {overhead['step_seconds'] * 1e3:.0f} ms steps: "
            f"maybe_save (not due) {overhead['maybe_save_not_due_overhead_us']:.0f} us, "
            f"blocking all_reduce {overhead['blocking_all_reduce_overhead_us']:.0f} us"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
