"""Checkpoint blocking time inside a Hugging Face Trainer: the Trainer's own save vs the same save sealed into the job.

One process, one Trainer over a Llama built from a config (no hub), AdamW state included:

  * ``trainer``: ``Trainer._save_checkpoint`` alone (model safetensors, optimizer, scheduler, RNG,
    trainer state), as ``save_steps`` runs it
  * ``sealed``: the same save followed by what sparkgpu adds inside a job (the rank's
    ``JobCheckpointCallback.on_save``: the folder listed, then on a thread every file linked or
    copied into the job's checkpoint store with its SHA-256, and the MAC'd marker); blocking
    time until training may go on, and ``sealed_committed`` until the marker is written
  * ceiling: one sequential read + write + fsync of the same bytes (a copy that must be durable;
    the sealed side needs none: a restore hashes every byte, and hard-links where it can)

Both sides save into the same file system, alternate between repeats, and make a fresh folder
each repeat. The time from a rank's SIGKILL to the first resumed step (ours vs the Trainer's
own ``resume_from_checkpoint``) is not measured by this script yet.

    python benchmarks/bench_hf_resume.py [--hidden 512] [--layers 8] [--repeats 3] [--dir DIR]

Writes benchmarks/results/hf_resume.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_seen, machine, method, spread  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "hf_resume.json"


def _trainer(hidden: int, layers: int, output_dir: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    args = TrainingArguments(output_dir=output_dir, report_to="none", use_cpu=True, max_steps=1)
    ids = torch.randint(0, 32000, (2, 16))
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids])
    trainer.train()  # one step: the optimizer has its moments
    return trainer


def _folder_bytes(folder: str) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    opts = parser.parse_args()

    from sparkgpu.hf.resume import seal_checkpoint
    from sparkgpu.store import Store
    from sparkgpu.train import sealed_files
    from sparkgpu.train.checkpoint_directory import SigningKey

    facts = machine()
    root = Path(tempfile.mkdtemp(prefix="bench-hf-", dir=opts.dir))
    key = SigningKey(os.urandom(32), "bench")
    sealed_files.job_key_for_sealing = lambda: key  # what a rank of a job holds
    trainer = _trainer(opts.hidden, opts.layers, str(root / "out"))
    times: dict[str, list[float]] = {"trainer": [], "sealed": [], "sealed_committed": [], "ceiling": []}
    size = 0
    try:
        for repeat in range(opts.repeats):
            order = ("trainer", "sealed") if repeat % 2 == 0 else ("sealed", "trainer")
            for side in order:
                shutil.rmtree(root / "out", ignore_errors=True)
                shutil.rmtree(root / "store", ignore_errors=True)
                trainer.state.global_step = 100 + repeat
                folder = str(root / "out" / f"checkpoint-{trainer.state.global_step}")
                start = time.perf_counter()
                trainer._save_checkpoint(trainer.model, None)
                pending = None
                if side == "sealed":
                    store = Store(root / "store", durable=False)
                    pending = seal_checkpoint(store, folder, trainer.state.global_step, background=True)
                times[side].append(time.perf_counter() - start)
                if pending is not None:
                    pending.wait()
                    times["sealed_committed"].append(time.perf_counter() - start)
                size = _folder_bytes(folder)
            # Ceiling: the same bytes read and written once, as one file.
            blob = root / "blob"
            start = time.perf_counter()
            with open(blob, "wb") as out:
                for path in sorted(Path(folder).rglob("*")):
                    if path.is_file():
                        out.write(path.read_bytes())
                out.flush()
                os.fsync(out.fileno())
            times["ceiling"].append(time.perf_counter() - start)
            blob.unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    spreads = {side: spread(values) for side, values in times.items()}
    result = {
        "question": "checkpoint blocking time inside a Trainer: its own save vs the save sealed into the job",
        "checkpoint_bytes": size,
        "model": {"hidden": opts.hidden, "layers": opts.layers},
        "blocking_s": spreads,
        "sealed_over_trainer": spreads["sealed"]["median"] / spreads["trainer"]["median"],
        "method": method(
            "Trainer._save_checkpoint, plus the seal's blocking part on the sealed side, wall clock",
            startup="excluded: the Trainer is built and stepped once before timing",
            repeats=opts.repeats,
            order="alternating between repeats",
            processes="one; torch threads as the machine gives",
        ),
        "not_measured": "SIGKILL of a rank -> first resumed step, ours vs the Trainer's resume_from_checkpoint",
        "machine": load_seen(facts),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v["median"] for k, v in spreads.items()}, indent=2))


if __name__ == "__main__":
    main()
