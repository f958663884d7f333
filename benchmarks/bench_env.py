"""Environment shipping: bytes and seconds to snapshot, stage and rehydrate this project's venv.

Runs, on the same installed distributions:
  * sparkgpu: stage into an empty store (first run), stage again with nothing changed (second
    run), stage after "installing" one more package (it is excluded from the first two runs),
    then rehydrate into an empty worker cache (cold), again (warm: cached), and on a worker
    that already has this image (everything skipped but code and editable installs).
  * venv-pack, the tool PySpark's documentation recommends for shipping a venv to executors:
    one uncompressed tar of the same files per run (it has no deduplication), and its
    extraction with tarfile.
Ceilings measured in the same run: reading and sha256-hashing the same files, reading them
and writing them as one file (what a first stage into a local store must at least do), and
copying them file by file (what a cold rehydration must at least write).

    python benchmarks/bench_env.py [--full] [--keep-one NAME]

By default the GPU stack (torch, torchvision, triton, nvidia-*, cuda-*) is left out so the
run takes a couple of minutes on a small machine; the JSON also gives the size of the full
venv and an estimate for it from the measured byte rates. ``--full`` measures everything.
Writes benchmarks/results/env.json and env.png.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
GPU_STACK = ["torch", "torchvision", "torchaudio", "triton", "nvidia-*", "cuda-*"]


def _timed(fn):
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def _stage_run(snapshot_kwargs: dict, store: str, index: Path) -> dict:
    from sparkgpu.env import snapshot_environment, stage_snapshot

    snapshot = snapshot_environment(**snapshot_kwargs)
    staged = stage_snapshot(snapshot, store, pack_index=index)
    report = staged.report
    return {
        "seconds": report.seconds,
        "uploaded_bytes": report.uploaded_bytes,
        "skipped_bytes": report.skipped_bytes,
        "uploaded": list(report.uploaded),
        "steps": {s.name: {"seconds": s.seconds, "bytes": s.bytes, "items": s.items} for s in report.steps},
        "_manifest": staged.manifest,
        "_snapshot": snapshot,
    }


def _hydrate_run(manifest: dict, cache: Path, installed) -> dict:
    from sparkgpu.env import hydrate_environment

    overlay = hydrate_environment(manifest, cache, installed=installed)
    r = overlay.report
    return {
        "seconds": r.seconds,
        "fetched_bytes": r.fetched_bytes,
        "extracted": len(r.extracted),
        "cached": len(r.cached),
        "skipped": len(r.skipped),
        "steps": r.steps,
    }


def _files_of(snapshot) -> list:
    return [f for c in snapshot.components for f in c.files]


def _hash_ceiling(files) -> float:
    started = time.perf_counter()
    for f in files:
        sha = hashlib.sha256()
        with open(f.source, "rb") as fh:
            while chunk := fh.read(1 << 20):
                sha.update(chunk)
    return time.perf_counter() - started


def _concat_ceiling(files, target: Path) -> float:
    """Reading the same files and writing them as one sequential file: the floor of a first stage."""
    started = time.perf_counter()
    with open(target, "wb") as out:
        for f in files:
            with open(f.source, "rb") as fh:
                shutil.copyfileobj(fh, out, 1 << 20)
    elapsed = time.perf_counter() - started
    target.unlink()
    return elapsed


def _copy_ceiling(files, target: Path) -> float:
    started = time.perf_counter()
    for f in files:
        dest = target / f.arcname
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f.source, dest)
    return time.perf_counter() - started


def _venv_pack(prefix: Path, excluded: list[str], out: Path) -> dict:
    """One venv-pack run (tar, no compression) and its extraction; None when venv-pack is missing."""
    exe = shutil.which("venv-pack", path=str(Path(sys.executable).parent))
    if exe is None:
        return {"error": "venv-pack is not installed (pip install venv-pack)"}
    site = f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
    args = [exe, "-p", str(prefix), "-o", str(out), "--format", "tar", "--force", "--quiet"]
    for pattern in excluded:
        stem = pattern.replace("-", "_")
        args += ["--exclude", f"{site}/{stem}/*", "--exclude", f"{site}/{stem}-*"]
        if pattern.endswith("-*"):  # nvidia-* wheels install into one nvidia/ namespace folder
            args += ["--exclude", f"{site}/{pattern[:-2]}/*"]
    result, pack = _timed(lambda: subprocess.run(args, capture_output=True, text=True))
    if result.returncode != 0:
        return {"error": result.stderr.strip()[-500:]}
    target = out.with_suffix(".d")

    def extract():
        with tarfile.open(out) as tar:
            tar.extractall(target, filter="tar")

    _, unpack = _timed(extract)
    size = out.stat().st_size
    shutil.rmtree(target, ignore_errors=True)
    out.unlink()
    return {"pack_seconds": pack, "bytes_per_run": size, "unpack_seconds": unpack}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="include the GPU stack (several GB)")
    parser.add_argument("--keep-one", default="rich", help="package left out of the first runs, then 'installed'")
    parser.add_argument("--out", default=str(RESULTS / "env.json"))
    args = parser.parse_args()

    from sparkgpu.env import snapshot_environment

    excluded = [] if args.full else list(GPU_STACK)
    full = snapshot_environment(code_paths=[])
    work = Path(tempfile.mkdtemp(prefix="bench-env-"))
    try:
        store, index = str(work / "store"), work / "pack-index.json"
        base = {"code_paths": [], "exclude": excluded + [args.keep_one]}
        first = _stage_run(base, store, index)
        second = _stage_run(base, store, index)
        third = _stage_run({"code_paths": [], "exclude": excluded}, store, index)
        manifest, snapshot = third.pop("_manifest"), third.pop("_snapshot")
        for run in (first, second):
            run.pop("_manifest"), run.pop("_snapshot")
        measured_bytes, files = snapshot.size, _files_of(snapshot)

        cold = _hydrate_run(manifest, work / "cache", installed={})
        warm = _hydrate_run(manifest, work / "cache", installed={})
        same_image = _hydrate_run(manifest, work / "cache-same-image", installed=None)

        venv_pack = _venv_pack(Path(sys.prefix), excluded, work / "venv.tar")
        hash_s = _hash_ceiling(files)
        concat_s = _concat_ceiling(files, work / "concat.bin")
        copy_s = _copy_ceiling(files, work / "copy")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    scale = full.size / measured_bytes
    results = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "measured": {
            "gpu_stack_excluded": not args.full,
            "distributions": len(snapshot.components),
            "files": len(files),
            "bytes": measured_bytes,
        },
        "full_venv": {
            "distributions": len(full.components),
            "files": sum(len(c.files) for c in full.components),
            "bytes": full.size,
            "scan_seconds": full.scan_seconds,
        },
        "sparkgpu": {
            "stage_first": first,
            "stage_second_unchanged": second,
            f"stage_after_installing_{args.keep_one}": third,
            "hydrate_cold": cold,
            "hydrate_warm": warm,
            "hydrate_on_same_image": same_image,
        },
        "venv_pack_tar": venv_pack,
        "ceilings": {
            "read_and_sha256_seconds": hash_s,
            "read_and_write_one_file_seconds": concat_s,
            "copy_files_seconds": copy_s,
        },
        "ratios": {
            "first_stage_vs_read_and_hash": first["seconds"] / hash_s,
            "first_stage_vs_read_and_write_one_file": first["seconds"] / concat_s,
            "cold_hydrate_vs_copy": cold["seconds"] / copy_s,
            "second_stage_vs_venv_pack_run": (
                second["seconds"] / venv_pack["pack_seconds"] if "pack_seconds" in venv_pack else None
            ),
        },
        "full_venv_estimate_seconds": {
            "stage_first": first["seconds"] * scale,
            "hydrate_cold": cold["seconds"] * scale,
            "note": "measured seconds scaled by bytes (full / measured); file counts differ, so this is rough",
        },
        "command": "python benchmarks/bench_env.py" + (" --full" if args.full else ""),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    _plot(results, Path(args.out).with_suffix(".png"))
    gb = measured_bytes / 1e9
    print(
        f"measured {len(snapshot.components)} distributions, {len(files)} files, {gb:.2f} GB "
        f"(full venv {full.size / 1e9:.2f} GB)"
    )
    for label, run in (("stage first", first), ("stage unchanged", second), (f"stage +{args.keep_one}", third)):
        print(f"  {label:18s} {run['seconds']:7.2f} s  uploaded {run['uploaded_bytes'] / 1e6:9.1f} MB")
    for label, run in (("hydrate cold", cold), ("hydrate warm", warm), ("hydrate same image", same_image)):
        print(f"  {label:18s} {run['seconds']:7.2f} s  fetched  {run['fetched_bytes'] / 1e6:9.1f} MB")
    print(f"  venv-pack (tar)    {json.dumps(venv_pack)}")
    print(f"  ceilings: read+sha256 {hash_s:.2f} s, read+write one file {concat_s:.2f} s, copy files {copy_s:.2f} s")


def _plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    s, vp, c = results["sparkgpu"], results["venv_pack_tar"], results["ceilings"]
    stage_keys = [k for k in s if k.startswith("stage")]
    labels = ["stage: first", "stage: unchanged", "stage: +1 package"]
    values = [s[k]["seconds"] for k in stage_keys]
    colors = ["tab:blue"] * 3
    if "pack_seconds" in vp:
        labels.append("venv-pack (every run)")
        values.append(vp["pack_seconds"])
        colors.append("tab:orange")
    labels += [
        "read + sha256 (ceiling)",
        "read + write one file (ceiling)",
        "hydrate: cold",
        "hydrate: warm",
        "hydrate: same image",
    ]
    values += [
        c["read_and_sha256_seconds"],
        c["read_and_write_one_file_seconds"],
        s["hydrate_cold"]["seconds"],
        s["hydrate_warm"]["seconds"],
        s["hydrate_on_same_image"]["seconds"],
    ]
    colors += ["tab:gray", "tab:gray", "tab:green", "tab:green", "tab:green"]
    if "unpack_seconds" in vp:
        labels.append("venv-pack unpack")
        values.append(vp["unpack_seconds"])
        colors.append("tab:orange")
    labels.append("copy files (ceiling)")
    values.append(c["copy_files_seconds"])
    colors.append("tab:gray")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.barh(labels[::-1], values[::-1], color=colors[::-1])
    ax.set_xlabel("seconds")
    m = results["measured"]
    ax.set_title(f"Environment shipping, {m['bytes'] / 1e9:.2f} GB in {m['files']} files")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
