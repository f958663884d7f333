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
    from sparkgpu.local_spark import local_session

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
    parser.add_argument("--out", type=Path, default=RESULTS / "sft.json")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    facts = machine()
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as tmp:
        work = Path(tmp)
        lengths = long_tailed_lengths(args.docs)
        report["packing"] = packing_section(args, lengths)
        print(json.dumps(report["packing"]["pad_share"], indent=1), file=sys.stderr)
        report["loader"] = loader_section(args, work, lengths)
        print(f"loader {report['loader']['row_tokens_per_s']['median']:,.0f} tokens/s", file=sys.stderr)
        if not args.skip_tokenize:
            rows = make_rows(args.rows)
            report["tokenize"] = tokenize_section(args, work, rows, build_tokenizer(rows))
            for fmt, figures in report["tokenize"]["formats"].items():
                print(fmt, json.dumps(figures["ratios"]), file=sys.stderr)
    report["machine"] = load_seen(facts)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
