"""Checkpoint blocking time inside a Hugging Face Trainer: the Trainer's own save vs the same save sealed into the job.

One process, one Trainer over a Llama built from a config (no hub), AdamW state included:

  * ``trainer``: ``Trainer._save_checkpoint`` alone (model safetensors, optimizer, scheduler, RNG,
    trainer state), as ``save_steps`` runs it
  * ``sealed``: the same save followed by what sparkgpu adds inside a job (the rank's
    ``JobCheckpointCallback.on_save``: the folder listed, then on a thread every file linked or
    copied into the job's checkpoint store with its SHA-256, and the MAC'd marker); blocking
    time until training may go on, and ``sealed_committed`` until the marker is written
  * ceiling: one sequential read + write of the same bytes into one file, no fsync: neither side
    syncs (the Trainer's save does not, and the seal's store is written with ``durable=False``:
    a restore hashes every byte)

Both sides save into the same file system, alternate between repeats, and make a fresh folder
each repeat.

``--part restart``: SIGKILL of a rank -> the first resumed step, in a 2-rank gloo job launched
by ``@distributed(max_restarts=1)`` for both sides, the same tiny Llama, the same token blocks,
the same step of the kill; rank 1 kills itself at the step after the checkpoint of step
``--kill-step`` is complete:

  * ``sparkgpu``: the plain Trainer inside the job, ``train_dataset`` the token loader
    (``data.token_dataset`` over MDS shards): the next attempt restores the newest sealed
    checkpoint by itself (copied out and hashed) and the loader's saved position; no batch is read again
  * ``trainer_map_style``: ``SPARKGPU_HF_RESUME=0`` and the resume written by hand as the
    transformers examples do (``train(resume_from_checkpoint=get_last_checkpoint(output_dir))``),
    ``train_dataset`` the same blocks as a map-style ``datasets.Dataset``
    (``load_dataset("parquet", ..., split="train")``, as the examples load data): the Trainer
    skips the batches of the epoch before the checkpoint by index (Accelerate's
    ``skip_first_batches`` over its sampler), reading none of them
  * ``trainer_streaming``: the same, the blocks streamed instead
    (``load_dataset(..., streaming=True)``, the documented way for data that is not loaded
    whole): an iterable dataset has no index, so the Trainer reads and drops every batch of the
    epoch before the checkpoint to find its place

Timed from the kill (rank 1's clock, just before SIGKILL) to the end of the first step of the
restarted attempt (rank 0's clock): failure detection, the restart, imports, model build, the
restore and the replay are inside for both.

    python benchmarks/bench_hf_resume.py [--part blocking|restart|all] [--hidden 512] [--layers 8]
        [--repeats 3] [--kill-step 300] [--dir DIR] [--out FILE]
    python benchmarks/bench_hf_resume.py --part restart --kill-step 5 --repeats 1 --out /tmp/hf.json  # a check

Writes benchmarks/results/hf_resume.json (a part run alone keeps the other part's figures).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_seen, machine, method, separated, spread  # noqa: E402

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


def measure_blocking(opts) -> dict:
    """The Trainer's own save vs the same save sealed into the job, blocking time."""
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
            # Ceiling: the same bytes read and written once, as one file; no fsync, as neither side syncs.
            blob = root / "blob"
            start = time.perf_counter()
            with open(blob, "wb") as out:
                for path in sorted(Path(folder).rglob("*")):
                    if path.is_file():
                        out.write(path.read_bytes())
            times["ceiling"].append(time.perf_counter() - start)
            blob.unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    spreads = {side: spread(values) for side, values in times.items()}
    print(json.dumps({k: v["median"] for k, v in spreads.items()}, indent=2))
    return {
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
            ceiling="the checkpoint's files read and written once into one file, no fsync (neither side syncs)",
            spread="quartiles and every run per row: a difference inside the quartiles is a tie",
        ),
        "medians_separated": {
            "sealed vs trainer": separated(spreads["sealed"], spreads["trainer"]),
        },
        "machine": load_seen(facts),
    }


# -- SIGKILL of a rank -> the first resumed step ---------------------------------------------

VOCAB, SEQ, BATCH, WORLD = 256, 64, 8, 2
MAP_STYLE, STREAMING = "trainer_map_style", "trainer_streaming"
SIDES = ("sparkgpu", MAP_STYLE, STREAMING)
# Blocks rank 0 reads for one step: the sparkgpu loader counts both ranks' blocks, a map-style
# dataset is read by each rank for itself, and Accelerate's dispatcher reads a streamed one on rank
# 0 for every rank.
READ_PER_STEP = {"sparkgpu": BATCH * WORLD, MAP_STYLE: BATCH, STREAMING: BATCH * WORLD}
# Batches read ahead of the step: Accelerate's loaders fetch the next one to see the end coming.
LOOKAHEAD = {"sparkgpu": 0, MAP_STYLE: 1, STREAMING: 1}


def finetune(side: str, mds_dir: str, parquet: str, timeline: str, kill_step: int, total_steps: int):
    """A plain Trainer as written for GPUs; rank 1 dies at the step after ``kill_step``'s checkpoint.

    Only the callback is the benchmark's: it kills, waits for the checkpoint to be complete
    first (sealed, on the sparkgpu side), and records the times and how many blocks the resumed
    attempt read before its first step ended.
    """
    import json
    import os
    import signal
    import time

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    from sparkgpu import data, runtime
    from sparkgpu.train import sealed_files

    rank, attempt = runtime.get_global_rank(), runtime.attempt()
    started = time.time()  # the launcher's restart and the imports above are over
    rows_read = [0]
    if side == "sparkgpu":
        dataset = data.token_dataset(local=mds_dir, column="ids", seq_len=SEQ - 1, batch_size=BATCH, eos_id=0)
    elif side == STREAMING:
        from datasets import load_dataset

        def with_labels(row):
            rows_read[0] += 1
            return {"input_ids": row["input_ids"], "labels": row["input_ids"]}

        dataset = load_dataset("parquet", data_files=parquet, split="train", streaming=True).map(with_labels)
    else:
        from datasets import load_dataset

        def rows_with_labels(rows):  # applied as rows are read: counts what the resume reads
            rows_read[0] += len(rows["input_ids"])
            return {"input_ids": rows["input_ids"], "labels": rows["input_ids"]}

        dataset = load_dataset("parquet", data_files=parquet, split="train").with_transform(rows_with_labels)

    def record(event: str, **facts) -> None:
        with open(timeline, "a") as f:
            f.write(json.dumps({"event": event, "time": time.time(), "rank": rank, **facts}) + "\n")

    def blocks_read() -> int:
        return dataset.state_dict()["blocks_consumed"] if side == "sparkgpu" else rows_read[0]

    class Timeline(TrainerCallback):
        def __init__(self):
            self.read_at_start = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.read_at_start = blocks_read()
            if attempt > 0 and rank == 0:
                record("function_started", at=started)
                record("trainer_built", at=built)
                record("train_begin", step=state.global_step)  # the restore is done

        def on_step_begin(self, args, state, control, **kwargs):
            if attempt == 0 and rank == 1 and state.global_step == kill_step + 1:
                folder = os.path.join(args.output_dir, f"checkpoint-{kill_step}")
                done = os.path.join(
                    runtime.checkpoint_dir(),
                    sealed_files.TRAINER_FOLDER,
                    f"checkpoint-{kill_step}",
                    sealed_files.SEALED_MARKER,
                )
                if side != "sparkgpu":
                    done = os.path.join(folder, "trainer_state.json")
                while not os.path.exists(done):  # the resume must find it, on both sides
                    time.sleep(0.01)
                record("killed", step=state.global_step)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_step_end(self, args, state, control, **kwargs):
            if attempt > 0:
                if rank == 0:
                    read = blocks_read() - (self.read_at_start or 0)
                    record("first_resumed_step", step=state.global_step, blocks_read=read)
                control.should_training_stop = True
            return control

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
    )
    args = TrainingArguments(
        output_dir="out",
        per_device_train_batch_size=BATCH,
        max_steps=total_steps,
        learning_rate=1e-3,
        save_steps=kill_step,
        logging_steps=total_steps,
        report_to="none",
        disable_tqdm=True,
        seed=7,
        # The map-style rows get their labels from a transform as they are read, which the
        # Trainer's pruning of unused columns would drop; the other sides are not datasets.Dataset.
        remove_unused_columns=side != MAP_STYLE,
    )
    trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=dataset, callbacks=[Timeline()])
    built = time.time()  # imports, the dataset, the model and the Trainer are ready
    if side == "sparkgpu":
        trainer.train()  # resumes by itself
    else:
        last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
        trainer.train(resume_from_checkpoint=last)
    return trainer.state.global_step


def write_blocks(root: Path, total_steps: int) -> tuple[str, str, int]:
    """The same token blocks as MDS shards (documents) and as Parquet rows (blocks of ``SEQ`` tokens)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from streaming import MDSWriter

    from sparkgpu import data

    blocks = (total_steps + 2) * BATCH * WORLD
    rng = np.random.default_rng(0)
    wanted, docs, total = blocks * (SEQ - 1) + 1, [], 0
    while total < wanted:
        length = min(int(rng.integers(20, 400)), wanted - total - 1) or 1
        docs.append(rng.integers(1, VOCAB, length, dtype=np.int64))
        total += length + 1
    mds = root / "mds"
    with MDSWriter(out=str(mds), columns={"ids": "ndarray:int64"}, size_limit=1 << 20) as writer:
        for doc in docs:
            writer.write({"ids": doc})
    loader = data.token_dataset(
        local=str(mds), column="ids", seq_len=SEQ - 1, batch_size=256, eos_id=0, rank=0, world_size=1
    )
    rows = [r.tolist() for batch in loader for r in batch]
    parquet = root / "blocks.parquet"
    pq.write_table(pa.table({"input_ids": rows}), parquet, row_group_size=1024)
    return str(mds), str(parquet), len(rows)


def run_restart(side: str, mds: str, parquet: str, work: Path, kill_step: int, total_steps: int) -> dict:
    from sparkgpu import distributed
    from sparkgpu.config import settings

    folder = work / f"{side}-{time.monotonic_ns()}"
    folder.mkdir()
    timeline = folder / "timeline.jsonl"
    os.environ["SPARKGPU_HF_RESUME"] = "1" if side == "sparkgpu" else "0"
    settings.cache_clear()
    here = os.getcwd()
    os.chdir(folder)  # the ranks' output_dir="out": a fresh one per run
    try:
        job = distributed(gpus=WORLD, gpu_type="cpu", max_restarts=1, log_ranks=None)(finetune)
        job.distributed(side, mds, parquet, str(timeline), kill_step, total_steps)
    finally:
        os.chdir(here)
    events = {e["event"]: e for e in map(json.loads, timeline.read_text().splitlines())}
    killed, resumed = events["killed"], events["first_resumed_step"]
    assert killed["step"] == kill_step + 1 and resumed["step"] == kill_step + 1, (killed, resumed)
    state = json.loads((settings().staging_root / job.last_job_id / "state.json").read_text())
    first, second = state["attempts"]
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "seconds": resumed["time"] - killed["time"],
        "blocks_read": resumed["blocks_read"],
        # Where the time went, from the kill: the failed attempt ended, the new ranks started, the
        # function ran, imports + dataset + model + Trainer were ready, train() began (the restore
        # done), then the first step ended (the replay included).
        "attempt_ended_s": first["ended_at"] - killed["time"],
        "ranks_started_s": second["started_at"] - killed["time"],
        "function_started_s": events["function_started"]["at"] - killed["time"],
        "trainer_built_s": events["trainer_built"]["at"] - killed["time"],
        "train_begin_s": events["train_begin"]["time"] - killed["time"],
    }


def measure_restart(opts) -> dict:
    """SIGKILL of a rank -> the first resumed step, ours vs the Trainer's own resume_from_checkpoint."""
    facts = machine()
    total_steps = opts.kill_step + 4
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="bench-hf-restart-", dir=opts.dir) as tmp:
        os.environ["SPARKGPU_HOME"] = str(Path(tmp) / "home")
        os.environ.setdefault("SPARKGPU_TRACKING", "0")  # restart latency only
        mds, parquet, blocks = write_blocks(Path(tmp), total_steps)
        for repeat in range(opts.repeats):
            for side in SIDES if repeat % 2 == 0 else SIDES[::-1]:
                runs[side].append(run_restart(side, mds, parquet, Path(tmp), opts.kill_step, total_steps))
                print(f"repeat {repeat} {side}: {runs[side][-1]}", flush=True)
    spreads = {side: spread([r["seconds"] for r in values]) for side, values in runs.items()}
    # The function ran -> the first step ended: what the two sides do differently (the launcher's
    # restart before it is the same code for both, and most of the noise on a shared machine).
    in_function = {
        side: spread([r["seconds"] - r["function_started_s"] for r in values]) for side, values in runs.items()
    }
    # train() began -> the first step ended: the restore is done, what is left is the first step and
    # whatever the resume reads again to find its place (the part that grows with the step of the kill).
    in_train = {side: spread([r["seconds"] - r["train_begin_s"] for r in values]) for side, values in runs.items()}
    step_batch = BATCH * WORLD
    return {
        "question": "SIGKILL of a rank at a late step -> the first resumed step: sparkgpu's automatic resume "
        "vs the Trainer's own resume_from_checkpoint written by hand",
        "kill_after_step": opts.kill_step,
        "checkpoint_step": opts.kill_step,
        "batches_before_the_checkpoint_in_its_epoch": opts.kill_step,
        "blocks": blocks,
        "blocks_per_step": step_batch,
        "model": {"llama_hidden": 64, "layers": 2, "vocab": VOCAB, "seq_len": SEQ, "per_rank_batch": BATCH},
        "seconds": spreads,
        "blocks_read_before_the_first_resumed_step": {
            side: statistics.median(r["blocks_read"] for r in values) for side, values in runs.items()
        },
        "batches_replayed": {
            side: round(statistics.median(r["blocks_read"] for r in values) / READ_PER_STEP[side]) - 1 - LOOKAHEAD[side]
            for side, values in runs.items()
        },
        "breakdown_median_s": {
            side: {
                part: statistics.median(r[part] for r in values)
                for part in (
                    "attempt_ended_s",
                    "ranks_started_s",
                    "function_started_s",
                    "trainer_built_s",
                    "train_begin_s",
                    "seconds",
                )
            }
            for side, values in runs.items()
        },
        # The map-style Trainer is the main peer; the streamed one is the second row.
        "trainer_over_sparkgpu": {
            peer: spreads[peer]["median"] / spreads["sparkgpu"]["median"] for peer in (MAP_STYLE, STREAMING)
        },
        "medians_separated": {peer: separated(spreads["sparkgpu"], spreads[peer]) for peer in (MAP_STYLE, STREAMING)},
        "function_started_to_first_step_s": in_function,
        "function_started_to_first_step_separated": {
            peer: separated(in_function["sparkgpu"], in_function[peer]) for peer in (MAP_STYLE, STREAMING)
        },
        "train_begin_to_first_step_s": in_train,
        "train_begin_to_first_step_separated": {
            peer: separated(in_train["sparkgpu"], in_train[peer]) for peer in (MAP_STYLE, STREAMING)
        },
        "method": method(
            "rank 1's SIGKILL (its clock, once the checkpoint of kill_after_step is complete) to the end "
            "of the restarted attempt's first step (rank 0's clock)",
            startup="inside for both: failure detection, the restart by the same launcher "
            "(@distributed(max_restarts=1), local backend, 2 gloo CPU ranks), imports, model build, restore",
            repeats=opts.repeats,
            statistic="median, with quartiles and every run",
            order="sides alternate, the order reversed every other repeat",
            data="the same token blocks: MDS shards read by data.token_dataset (sparkgpu) / one Parquet file "
            "as a map-style datasets.Dataset, labels added by a transform as rows are read, each rank "
            "sampling its share (trainer_map_style) / the same file streamed by "
            "datasets.load_dataset(streaming=True), dispatched by Accelerate as its default for iterable "
            "datasets (trainer_streaming)",
            replay="blocks_read_before_the_first_resumed_step counts blocks read on rank 0 in the resumed "
            "attempt up to the end of its first step (for a streamed dataset rank 0 reads for both ranks, "
            "for a map-style one each rank its own); batches_replayed is that over what rank 0 reads for "
            "one step, less the step itself and the batch Accelerate's loaders read ahead",
        ),
        "runs": runs,
        "machine": load_seen(facts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("blocking", "restart", "all"), default="all")
    parser.add_argument("--hidden", type=int, default=512, help="blocking part: the Llama's width")
    parser.add_argument("--layers", type=int, default=8, help="blocking part: the Llama's layers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kill-step", type=int, default=300, help="restart part: the step of the checkpoint")
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results file (a quick check: not over results/)")
    opts = parser.parse_args()

    result = json.loads(opts.out.read_text()) if opts.out.exists() else {}
    result.pop("not_measured", None)
    if opts.part in ("blocking", "all"):
        result.update(measure_blocking(opts))
    if opts.part in ("restart", "all"):
        result["restart"] = measure_restart(opts)
        print(json.dumps({k: v["median"] for k, v in result["restart"]["seconds"].items()}, indent=2))
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
