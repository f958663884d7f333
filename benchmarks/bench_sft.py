"""Fine-tuning data: tokenizing on Spark, packing rows, and the SFT loader, each beside its peer.

Question 1 (tokenize): rows/s and tokens/s from a Parquet table to token ids with a loss mask.

  * sparkgpu ``data.tokenize(spark.read.parquet(...))`` on Spark Connect ``local[2]``: the rows
    are encoded in the executors' tasks (4 Parquet files, so 4 tasks on 2 cores) and written as
    MDS; and the same with the DataFrame coalesced to one task, for how the rate scales with
    the cores encoding in parallel;
  * HF ``datasets``: ``Dataset.from_parquet`` of the same files, then ``map(batched=True,
    num_proc=2)`` with the same tokenizer: ``apply_chat_template(..., return_dict=True,
    return_assistant_tokens_mask=True)`` for chats (TRL's recipe), ``tokenizer(text)`` for text.

  Both timed from the call to the output written (Spark's job, its Python workers and the
  tokenizer loading inside; ``datasets``' conversion of Parquet to its Arrow cache, its process
  pool and the copies of the tokenizer inside), each repeat into a new folder and a new HF cache
  folder, so neither reuses an earlier result. The Spark session's own start (once per notebook)
  is reported apart. Sides alternate their order from repeat to repeat.

Question 2 (packing): the share of padding in rows of ``seq_len`` for a long-tailed mix of
document lengths (log-normal, 20 to 4,096 tokens), against TRL's best-fit-decreasing
``pack_dataset(..., strategy="bfd")`` (its default batch of 1,000 documents per packing call),
and against padding each batch of documents to its longest (no packing). The same lengths for
every side; padding = 1 - tokens / (rows x seq_len). Packing time beside it.

Question 3 (loader): tokens/s the SFT loader hands out as ``(batch, seq_len)`` rows of
``input_ids`` / ``labels`` / ``position_ids``, shuffled, from a warm local folder of the same
long-tailed documents: start-up (open to first batch) and the steady rate after it.

    python benchmarks/bench_sft.py                                    # about 10 minutes on 2 cores
    python benchmarks/bench_sft.py --rows 2000 --docs 3000 --repeats 1 --out /tmp/sft.json   # a quick look
    python benchmarks/bench_sft.py --sections training                # question 4 alone, about 4 minutes
    python benchmarks/bench_sft.py --sections training --train-steps 4 --repeats 1 --out /tmp/sft.json

Sections not named by ``--sections`` keep the figures already in ``--out``.

Question 4 (training): real (non-pad) tokens per second of the same tiny Llama on 2 gloo CPU ranks
(``sparkgpu.distributed(gpus=2, gpu_type="cpu")``, one job per repeat running every side in turn,
the order rotating), the same documents (question 2's long-tailed mix scaled to ``--train-seq-len``),
rows of at most ``seq_len``, the same rows per step and the same number of steps:

  * sparkgpu: ``data.sft_dataset`` (packed rows, ``position_ids`` per document) as a plain
    ``transformers.Trainer``'s ``train_dataset``;
  * TRL ``SFTTrainer(packing=True)`` with the packing TRL documents for the attention the model
    runs: ``packing_strategy="bfd"`` (which turns padding-free on) where the model runs
    FlashAttention, the only attention TRL documents padding-free for; ``"wrapped"`` (rows of
    exactly ``max_length``, documents cut across rows, no padding-free) elsewhere, so with sdpa on
    these CPU ranks. The strategy each run used is in the results (``packing_strategy``);
  * TRL ``SFTTrainer`` without packing: each batch of documents padded to its longest;
  * two diagnostics, not peers, that split the gap: our loader with ``flatten=True`` (TRL bfd's
    padding-free layout, a batch as one row) under the plain Trainer, and our loader's rows under
    ``SFTTrainer`` through ``sparkgpu.hf.as_hf_dataset``.

  Start-up (data opened or prepared, to the end of the first step) apart from the steady rate.

Results: benchmarks/results/sft.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import load_seen, machine, method, spread

RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = ("packing", "loader", "tokenize", "training")
SYLLABLES = "ka lo mi ne ru ta so vi pe da gu li mo na re si to va be ze".split()

CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m['content'] }}<|im_end|>\n"
    "{% endgeneration %}{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Data: a vocabulary of made-up words with a long-tailed frequency, chats of a few turns.


class _Words:
    """A vocabulary of 5,000 made-up words drawn with a Zipf-like frequency."""

    def __init__(self, rng):
        self.rng = rng
        self.vocab = np.array(["".join(rng.choice(SYLLABLES, int(rng.integers(1, 4)))) for _ in range(5000)])
        weights = 1.0 / np.arange(1, len(self.vocab) + 1)
        self.cumulative = np.cumsum(weights / weights.sum())

    def __call__(self, count: int) -> str:
        picks = np.searchsorted(self.cumulative, self.rng.random(count) * self.cumulative[-1])
        return " ".join(self.vocab[np.minimum(picks, len(self.vocab) - 1)])


def make_rows(count: int, seed: int = 0) -> dict:
    """``count`` chats (1-4 turns, 10-200 words a message) and the same text as plain documents."""
    rng = np.random.default_rng(seed)
    words = _Words(rng)
    chats, texts = [], []
    for _ in range(count):
        turns = []
        for _ in range(int(rng.integers(1, 5))):
            user = words(int(rng.integers(10, 60)))
            answer = words(int(rng.integers(20, 200)))
            turns += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        chats.append(turns)
        texts.append(" ".join(t["content"] for t in turns))
    return {"messages": chats, "text": texts}


def build_tokenizer(rows: dict):
    """A byte-level BPE (8k merges) trained on the data, with a ChatML template marking the assistant."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=specials, show_progress=False)
    backend.train_from_iterator(rows["text"][:2000], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


def write_parquet(folder: Path, rows: dict, files: int = 4) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(rows)
    folder.mkdir(parents=True)
    paths = []
    step = -(-len(table) // files)
    for i in range(files):
        path = str(folder / f"part-{i}.parquet")
        pq.write_table(table.slice(i * step, step), path)
        paths.append(path)
    return paths


# Question 1.


def run_sparkgpu(spark, paths, tok, fmt: str, out: str, tasks: int | None) -> tuple[float, dict]:
    from sparkgpu import data

    started = time.perf_counter()
    df = spark.read.parquet(*paths).select(fmt)
    if tasks is not None:
        df = df.coalesce(tasks)
    result = data.tokenize(df, out, tokenizer=tok, format=fmt, progress=False)
    seconds = time.perf_counter() - started
    assert result.source["via"] == "mapInArrow" and not result.reused
    return seconds, {"rows": result.samples, "tokens": result.stats["tokens"]}


def _hf_chat(batch, tok):
    out = tok.apply_chat_template(batch["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}


def _hf_text(batch, tok):
    ids = tok(batch["text"])["input_ids"]
    return {"input_ids": [i + [tok.eos_token_id] for i in ids]}


def run_datasets(paths, tok, fmt: str, cache: str, workers: int) -> tuple[float, dict]:
    import datasets

    started = time.perf_counter()
    ds = datasets.Dataset.from_parquet(paths, cache_dir=cache, columns=[fmt])
    mapped = ds.map(
        _hf_chat if fmt == "messages" else _hf_text,
        batched=True,
        num_proc=workers,
        fn_kwargs={"tok": tok},
        remove_columns=[fmt],
        load_from_cache_file=False,
    )
    seconds = time.perf_counter() - started
    tokens = sum(len(ids) for ids in mapped.with_format("arrow")["input_ids"].to_pylist())
    return seconds, {"rows": len(mapped), "tokens": tokens}


def tokenize_section(args, work: Path, rows: dict, tok) -> dict:
    from sparkgpu.testing.local_spark import local_session

    paths = write_parquet(work / "parquet", rows)
    started = time.perf_counter()
    spark = local_session(cores=2)
    session_s = time.perf_counter() - started
    section: dict = {"spark_session_start_s": session_s, "formats": {}}
    sides = {
        "sparkgpu local[2]": lambda fmt, n: run_sparkgpu(spark, paths, tok, fmt, str(work / f"sg-{fmt}-{n}"), None),
        "sparkgpu, one task": lambda fmt, n: run_sparkgpu(spark, paths, tok, fmt, str(work / f"sg1-{fmt}-{n}"), 1),
        "datasets.map num_proc=2": lambda fmt, n: run_datasets(paths, tok, fmt, str(work / f"hf-{fmt}-{n}"), 2),
    }
    # A first, untimed run of every side: JVM classes, Python worker daemons, imports.
    for run in sides.values():
        run(args.formats[0], "warm")
    for fmt in args.formats:
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        counts = {}
        for repeat in range(args.repeats):
            names = list(sides) if repeat % 2 == 0 else list(reversed(sides))
            for name in names:
                took, counts[name] = sides[name](fmt, repeat)
                seconds[name].append(took)
                print(f"  tokenize {fmt:9s} {name:26s} {took:7.2f} s", file=sys.stderr)
        tokens = counts["sparkgpu local[2]"]["tokens"]
        peers = {}
        for name, runs in seconds.items():
            peers[name] = {
                "seconds": spread(runs),
                "rows_per_s": len(rows[fmt]) / statistics.median(runs),
                "tokens_per_s": tokens / statistics.median(runs),
                "tokens": counts[name]["tokens"],
            }
        section["formats"][fmt] = {
            "rows": len(rows[fmt]),
            "tokens": tokens,
            "peers": peers,
            "ratios": {
                "sparkgpu / datasets.map": peers["sparkgpu local[2]"]["rows_per_s"]
                / peers["datasets.map num_proc=2"]["rows_per_s"],
                "2 cores / 1 task": peers["sparkgpu local[2]"]["rows_per_s"]
                / peers["sparkgpu, one task"]["rows_per_s"],
            },
        }
    section["method"] = method(
        "from the call to the output written (Parquet read, encode, write), each repeat into new folders",
        startup="inside for both sides (Spark job and Python workers; datasets' Arrow cache and process pool); "
        "the Spark session start is apart as spark_session_start_s",
        repeats=args.repeats,
        workers="Spark local[2] with 4 tasks (one Parquet file each) vs datasets.map num_proc=2; "
        "'one task' coalesces the DataFrame to one partition",
        order="sides alternate their order between repeats; one untimed warm-up run of each side first",
        tokens="counted by sparkgpu's statistics; the datasets side's own count beside it (HF appends no EOS to "
        "chats; text gets the EOS appended by both)",
    )
    spark.stop()
    return section


# Question 2.


def long_tailed_lengths(count: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.exp(rng.normal(np.log(300), 1.2, count)), 20, 4096).astype(np.int64)


def packing_section(args, lengths: np.ndarray) -> dict:
    import datasets
    from trl.data_utils import pack_dataset

    from sparkgpu.data.loaders.packing import pack_epoch

    seq, tokens = args.seq_len, int(lengths.sum())
    out: dict = {
        "documents": len(lengths),
        "tokens": tokens,
        "seq_len": seq,
        "pad_share": {},
        "rows": {},
        "seconds": {},
    }

    def record(name, rows, seconds):
        out["pad_share"][name] = 1 - tokens / (rows * seq)
        out["rows"][name] = rows
        out["seconds"][name] = seconds

    for name, window in (("sparkgpu bfd", 4096), ("sparkgpu bfd, window 1000", 1000)):
        started = time.perf_counter()
        rows = pack_epoch(
            np.random.default_rng(0).permutation(len(lengths)),
            lengths,
            seq_len=seq,
            overflow="truncate",
            window=window,
            world_size=1,
            rng=np.random.default_rng(1),
        )
        record(name, rows.num_rows, time.perf_counter() - started)
    ds = datasets.Dataset.from_dict({"input_ids": [np.zeros(n, np.int32) for n in lengths.tolist()]})
    started = time.perf_counter()
    packed = pack_dataset(ds, seq, strategy="bfd")
    record("trl bfd", len(packed), time.perf_counter() - started)
    # No packing: batches of documents in a shuffled order, each padded to its longest.
    shuffled = lengths[np.random.default_rng(2).permutation(len(lengths))]
    batch = args.batch_size
    longest = np.maximum.reduceat(shuffled, np.arange(0, len(shuffled), batch))
    sizes = np.diff(np.r_[np.arange(0, len(shuffled), batch), len(shuffled)])
    out["pad_share"][f"padding each batch of {batch}"] = 1 - tokens / int((longest * sizes).sum())
    out["ratios"] = {"sparkgpu / trl bfd (pad share)": out["pad_share"]["sparkgpu bfd"] / out["pad_share"]["trl bfd"]}
    out["method"] = method(
        "padding share of rows of seq_len over one epoch of the same lengths; packing time of one epoch",
        startup="not applicable",
        repeats=1,
        statistic="exact (deterministic)",
        trl="pack_dataset(strategy='bfd') with its default map batch of 1,000 documents; its rows are at most "
        "seq_len long and counted as padded to seq_len",
        sparkgpu="pack_epoch with the loader's default window of 4,096 documents, and with TRL's 1,000",
    )
    return out


# Question 3.


def loader_section(args, work: Path, lengths: np.ndarray) -> dict:
    import pyarrow as pa

    from sparkgpu import data

    rng = np.random.default_rng(3)
    ids = [rng.integers(0, 8192, n, dtype=np.int32) for n in lengths.tolist()]
    masks = [np.r_[np.zeros(n // 3, np.uint8), np.ones(n - n // 3, np.uint8)] for n in lengths.tolist()]
    table = pa.table({"input_ids": ids, "loss_mask": masks})
    url = data.to_mds(table, str(work / "loader"), progress=False).url
    startups, rates = [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        loader = data.sft_dataset(
            local=url, seq_len=args.seq_len, batch_size=args.batch_size, shuffle=True, rank=0, world_size=1
        )
        first, count, epochs = None, 0, 0
        while first is None or time.perf_counter() - first < args.seconds:
            for batch in loader:
                if first is None:
                    first = time.perf_counter()
                    startups.append(first - started)
                    continue
                count += batch["input_ids"].numel()
            epochs += 1
        rates.append(count / (time.perf_counter() - first))
        loader.close()
    return {
        "documents": len(lengths),
        "tokens": int(lengths.sum()),
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "startup_s": spread(startups),
        "row_tokens_per_s": spread(rates, higher_is_better=True),
        "method": method(
            "row tokens (batch x seq_len, padding included) handed out after the first batch, over whole "
            f"epochs for at least {args.seconds} s",
            startup="apart: open (reading every shard's headers, planning the epoch) to the first batch",
            repeats=args.repeats,
            workers="none (num_workers=0), one process",
        ),
    }


# Question 4.

TRAIN_VOCAB, TRAIN_PAD = 2048, 0
OURS, TRL_PACKED, TRL_PADDED = "sparkgpu loader + Trainer", "trl packing", "trl no packing"
# Diagnostics, not peers: our rows in TRL bfd's layout (each batch flattened into one row) under the
# plain Trainer, and our rows under SFTTrainer (through as_hf_dataset). They tell the cost of the
# layout and of SFTTrainer's step apart from the data each side trains on.
OURS_FLAT, OURS_IN_TRL = "sparkgpu loader, flatten=True", "sparkgpu loader + SFTTrainer"
TRAIN_SIDES = (OURS, TRL_PACKED, TRL_PADDED, OURS_FLAT, OURS_IN_TRL)
TRAIN_RATIOS = {
    "sparkgpu / trl packing": (OURS, TRL_PACKED),
    "sparkgpu / trl no packing": (OURS, TRL_PADDED),
    "flattened layout: sparkgpu / sparkgpu flatten=True": (OURS, OURS_FLAT),
    "sparkgpu flatten=True / trl packing": (OURS_FLAT, TRL_PACKED),
    "same rows: sparkgpu + Trainer / sparkgpu + SFTTrainer": (OURS, OURS_IN_TRL),
    "same trainer: sparkgpu + SFTTrainer / trl packing": (OURS_IN_TRL, TRL_PACKED),
}


def trl_packing_strategy(attention: str) -> str:
    """The packing TRL documents for a model's attention: ``bfd`` (padding-free) under FlashAttention,
    the only attention its docs support padding-free with; ``wrapped`` under any other (sdpa, eager)."""
    return "bfd" if attention.startswith("flash_attention") else "wrapped"


def training_lengths(args) -> np.ndarray:
    """The packing section's long-tailed lengths, scaled by ``train_seq_len / 4096``: the same mix
    relative to the row, at a size a tiny model on two cores trains in seconds."""
    lengths = long_tailed_lengths(args.train_docs, seed=4)
    return np.maximum(4, lengths * args.train_seq_len // 4096)


def train_sides(order, mds_url: str, arrow_dir: str, opts: dict) -> dict:
    """One rank of the comparison: each side in ``order`` builds its trainer and trains ``steps`` steps.

    The same tiny Llama (rebuilt from the same seed per side), the same documents, rows of at
    most ``seq_len`` tokens and ``batch`` rows a step per rank; fp32, no gradient checkpointing,
    no checkpoints. A forward pre-hook counts the real (non-pad) tokens of every step, the same
    way for every side; a callback takes the time at the end of every step.
    """
    import time

    import torch
    from datasets import load_from_disk

    import sparkgpu.hf
    from tokenizers import Tokenizer, models
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )
    from trl import SFTConfig, SFTTrainer

    from sparkgpu import data

    seq, batch, steps, vocab, pad = opts["seq_len"], opts["batch"], opts["steps"], opts["vocab"], opts["pad"]
    words = {"<pad>": pad, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab)}}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="<eos>")), pad_token="<pad>", eos_token="<eos>"
    )

    def model():
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=seq,
        )
        return LlamaForCausalLM(config)

    # Untimed: the first forward and backward of the process (thread pools, allocator).
    warm = model()
    warm(
        input_ids=torch.ones(batch, seq, dtype=torch.long), labels=torch.ones(batch, seq, dtype=torch.long)
    ).loss.backward()
    del warm

    common = dict(
        output_dir="out",
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=1e-3,
        seed=7,
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    results = {}
    for side in order:
        tokens: list[int] = []
        ends: list[float] = []
        counted = [0]
        shapes: list[list[int]] = []

        class Clock(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                ends.append(time.perf_counter())
                tokens.append(counted[0])
                counted[0] = 0

        def count(module, args, kwargs):
            counted[0] += int((kwargs["input_ids"] != pad).sum())
            shapes.append(list(kwargs["input_ids"].shape))

        net = model()
        net.register_forward_pre_hook(count, with_kwargs=True)
        strategy = None
        started = time.perf_counter()
        if side in (OURS, OURS_FLAT):
            rows = data.sft_dataset(
                local=mds_url, seq_len=seq, batch_size=batch, shuffle=True, seed=0, flatten=side == OURS_FLAT
            )
            trainer = Trainer(model=net, args=TrainingArguments(**common), train_dataset=rows, callbacks=[Clock()])
        elif side == OURS_IN_TRL:
            rows = data.sft_dataset(local=mds_url, seq_len=seq, batch_size=batch, shuffle=True, seed=0)
            trainer = SFTTrainer(
                model=net,
                args=SFTConfig(**common, dataset_kwargs={"skip_prepare_dataset": True}),
                train_dataset=sparkgpu.hf.as_hf_dataset(rows),
                processing_class=tokenizer,
                callbacks=[Clock()],
            )
        else:
            strategy = trl_packing_strategy(net.config._attn_implementation)
            packing = {"packing": True, "packing_strategy": strategy} if side == TRL_PACKED else {"packing": False}
            config = SFTConfig(**common, max_length=seq, **packing)
            trainer = SFTTrainer(
                model=net,
                args=config,
                train_dataset=load_from_disk(arrow_dir),
                processing_class=tokenizer,
                callbacks=[Clock()],
            )
        trainer.train()
        assert len(ends) == steps, (side, len(ends))
        results[side] = {
            "startup_s": ends[0] - started,
            "steady_s": ends[-1] - ends[0],
            "steady_tokens": sum(tokens[1:]),
            "tokens_per_step": tokens,
            "first_batch_shape": shapes[0],
            "attention": net.config._attn_implementation,
            "packing_strategy": strategy if side == TRL_PACKED else None,
            "padding_free": bool(getattr(trainer, "padding_free", False)),
        }
    results["threads"] = torch.get_num_threads()
    return results


def training_section(args, work: Path) -> dict:
    import datasets
    import pyarrow as pa

    from sparkgpu import data, distributed

    lengths = training_lengths(args)
    rng = np.random.default_rng(5)
    docs = [rng.integers(2, TRAIN_VOCAB, n, dtype=np.int32) for n in lengths.tolist()]
    ones = [np.ones(n, np.uint8) for n in lengths.tolist()]
    url = data.to_mds(pa.table({"input_ids": docs, "loss_mask": ones}), str(work / "train-mds"), progress=False).url
    arrow = str(work / "train-arrow")
    datasets.Dataset.from_dict({"input_ids": [d.tolist() for d in docs]}).save_to_disk(arrow)
    opts = {
        "seq_len": args.train_seq_len,
        "batch": args.train_batch,
        "steps": args.train_steps,
        "vocab": TRAIN_VOCAB,
        "pad": TRAIN_PAD,
    }
    job = distributed(gpus=2, gpu_type="cpu", log_ranks=None)(train_sides)
    runs: dict[str, dict[str, list[float]]] = {side: {"startup": [], "rate": []} for side in TRAIN_SIDES}
    per_step: dict[str, list[float]] = {side: [] for side in TRAIN_SIDES}
    paired: dict[str, list[float]] = {name: [] for name in TRAIN_RATIOS}
    here = os.getcwd()
    threads = None
    for repeat in range(args.repeats):
        turn = repeat % len(TRAIN_SIDES)
        order = TRAIN_SIDES[turn:] + TRAIN_SIDES[:turn]
        folder = work / f"train-{repeat}"
        folder.mkdir()
        os.chdir(folder)
        try:
            ranks = job.distributed(list(order), url, arrow, opts)
        finally:
            os.chdir(here)
        threads = ranks[0]["threads"]
        for side in TRAIN_SIDES:
            first = ranks[0][side]
            steady_tokens = sum(r[side]["steady_tokens"] for r in ranks)
            runs[side]["startup"].append(first["startup_s"])
            runs[side]["rate"].append(steady_tokens / first["steady_s"])
            per_step[side].append(steady_tokens / (args.train_steps - 1))
            print(
                f"  training {side:30s} start-up {first['startup_s']:6.2f} s, "
                f"{steady_tokens / first['steady_s']:9,.0f} real tokens/s",
                file=sys.stderr,
            )
        for name, (top, bottom) in TRAIN_RATIOS.items():
            paired[name].append(runs[top]["rate"][-1] / runs[bottom]["rate"][-1])
        facts = {side: ranks[0][side] for side in TRAIN_SIDES}
    peers = {
        side: {
            "startup_s": spread(runs[side]["startup"]),
            "real_tokens_per_s": spread(runs[side]["rate"], higher_is_better=True),
            "real_tokens_per_step": statistics.median(per_step[side]),
            "first_batch_shape": facts[side]["first_batch_shape"],
            "attention": facts[side]["attention"],
            "packing_strategy": facts[side]["packing_strategy"],
            "padding_free": facts[side]["padding_free"],
        }
        for side in TRAIN_SIDES
    }
    rate = {side: peers[side]["real_tokens_per_s"]["median"] for side in TRAIN_SIDES}
    return {
        "documents": len(lengths),
        "tokens": int(lengths.sum()),
        "length_p50": float(np.median(lengths)),
        "length_max": int(lengths.max()),
        "seq_len": args.train_seq_len,
        "rows_per_step_per_rank": args.train_batch,
        "steps": args.train_steps,
        "ranks": 2,
        "threads_per_rank": threads,
        "model": "LlamaForCausalLM, vocab 2048, hidden 64, 2 layers, 4 heads, fp32",
        "peers": peers,
        "ratios": {name: rate[top] / rate[bottom] for name, (top, bottom) in TRAIN_RATIOS.items()},
        "paired_ratios": {name: spread(values, higher_is_better=True) for name, values in paired.items()},
        "goals": {"sparkgpu / trl packing": 1.0, "sparkgpu / trl no packing": 1.5},
        "method": method(
            f"real (non-pad) tokens of both ranks per second of rank 0's clock, from the end of step 1 to the end "
            f"of step {args.train_steps}; every step's tokens counted by one forward pre-hook (input_ids != pad)",
            startup="apart as startup_s: from building the trainer's data (sft_dataset opening and planning the "
            "epoch; load_from_disk of the same documents saved as an Arrow dataset, TRL's preparation and packing "
            "inside) to the end of step 1; imports and a first forward/backward of the process are before it",
            repeats=args.repeats,
            statistic="ratios: median rate of one side over median rate of the other; paired_ratios: the two "
            "sides' ratio within each repeat (the same job, minutes apart), their median and spread beside it",
            launcher="one sparkgpu.distributed(gpus=2, gpu_type='cpu') job per repeat, 2 gloo ranks, every side in "
            "it in turn; the order of the sides rotates from repeat to repeat",
            budget=f"rows of at most seq_len={args.train_seq_len}, {args.train_batch} rows a step per rank for "
            "every side: our loader's packed rows; TRL's packed rows with the strategy its docs give for the "
            "attention the model runs (packing_strategy: 'bfd', padding-free, under FlashAttention, the only "
            "attention TRL documents padding-free for; 'wrapped', rows of exactly max_length with documents cut "
            "across rows, under sdpa); TRL without packing: documents truncated to max_length, each batch padded "
            "to its longest",
            configuration="the same model from the same seed, fp32, no gradient checkpointing (TRL's default turns it "
            "on: off for every side), learning rate 1e-3, no checkpoints, no logging; SFTTrainer with its own loss "
            "(fused LM head) and collator; Trainer with the model's loss; attention 'sdpa' on every side (no "
            "flash-attention kernel on CPU), so TRL packs 'wrapped' here",
            diagnostic="not peers, they split the gap: 'sparkgpu loader, flatten=True' is our loader with each "
            "batch flattened into one row of batch x seq_len tokens (TRL bfd's padding-free layout, which under sdpa "
            "builds one block-diagonal mask over the whole flattened batch) under the plain Trainer; 'sparkgpu "
            "loader + SFTTrainer' is our loader's rows under SFTTrainer through sparkgpu.hf.as_hf_dataset "
            "(its fused-LM-head loss, its per-step entropy and token-accuracy metrics gathered across ranks)",
            data="the packing section's long-tailed lengths scaled by seq_len/4096 (4 tokens at least), random ids; "
            "the same documents written once as MDS (sparkgpu) and as an Arrow dataset (TRL), both warm local folders",
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4_000, help="chats (and texts) to tokenize")
    parser.add_argument("--formats", nargs="+", default=["messages", "text"])
    parser.add_argument("--docs", type=int, default=50_000, help="documents to pack and load")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-tokenize", action="store_true")
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=[s for s in SECTIONS if s != "training"],
        help="sections to run; the others keep their figures from --out (default: all but training)",
    )
    parser.add_argument("--train-docs", type=int, default=2_000, help="documents of the training section")
    parser.add_argument("--train-seq-len", type=int, default=512)
    parser.add_argument("--train-batch", type=int, default=4, help="rows per step per rank")
    parser.add_argument("--train-steps", type=int, default=14)
    parser.add_argument("--out", type=Path, default=RESULTS / "sft.json")
    args = parser.parse_args()
    sections = [s for s in args.sections if not (s == "tokenize" and args.skip_tokenize)]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    # Sections not run keep their figures (and the machine they were measured on).
    report: dict = json.loads(args.out.read_text()) if args.out.exists() else {}
    facts = machine()
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as tmp:
        work = Path(tmp)
        lengths = long_tailed_lengths(args.docs)
        if "packing" in sections:
            report["packing"] = packing_section(args, lengths)
            print(json.dumps(report["packing"]["pad_share"], indent=1), file=sys.stderr)
        if "loader" in sections:
            report["loader"] = loader_section(args, work, lengths)
            print(f"loader {report['loader']['row_tokens_per_s']['median']:,.0f} tokens/s", file=sys.stderr)
        if "tokenize" in sections:
            rows = make_rows(args.rows)
            report["tokenize"] = tokenize_section(args, work, rows, build_tokenizer(rows))
            for fmt, figures in report["tokenize"]["formats"].items():
                print(fmt, json.dumps(figures["ratios"]), file=sys.stderr)
        if "training" in sections:
            report["training"] = training_section(args, work)
            print("training", json.dumps(report["training"]["ratios"]), file=sys.stderr)
    seen = load_seen(facts)
    if "training" in sections:
        report["training"]["machine"] = seen
    if set(sections) & {"packing", "loader", "tokenize"}:
        report["machine"] = seen
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
