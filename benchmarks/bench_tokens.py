"""Token packing and mixtures: sparkgpu.data.token_dataset and streams= against their peers.

Question 1: how many tokens per second reach the training loop as ``(batch, seq_len + 1)``
tensors of packed documents, from a warm local folder?

  * sparkgpu ``data.token_dataset`` (in order and shuffled);
  * litdata ``StreamingDataset(item_loader=TokensLoader(block_size=seq_len + 1))`` +
    ``StreamingDataLoader`` over the same documents (written with ``litdata.optimize``);
  * ceiling: the same blocks, in the same order, copied from one in-memory array of the
    concatenated tokens by the C span gather (one memcpy per block), as many blocks per call
    as the loader cuts at once (about 2M tokens), handed out as tensor views batch by batch.

Question 2: what does mixing cost? The same fixed-width samples read as one dataset and as a
three-stream mixture (proportions 0.5 / 0.3 / 0.2, epoch of the same size), shuffled.

Every peer reads the same documents in the same process, one after another; each rate is the
best of ``--repeats`` passes of at most ``--seconds``. Results: benchmarks/results/tokens.json.

    python benchmarks/bench_tokens.py                                    # a few minutes on 2 cores
    python benchmarks/bench_tokens.py --docs 2000 --seconds 1 --repeats 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results"
try:
    from sparkgpu.data.loaders.tokens import _CUT_TOKENS  # tokens the loader cuts per gather
except ImportError:  # a version of the loader that cut one batch at a time
    _CUT_TOKENS = 0


def make_documents(count: int, mean_length: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(mean_length // 4, mean_length * 7 // 4, count)
    return [rng.integers(1, 50_000, n, dtype=np.int32) for n in lengths]


def write_mds(folder: Path, docs) -> str:
    from streaming import MDSWriter

    with MDSWriter(out=str(folder), columns={"ids": "ndarray:int32"}, size_limit="16mb") as writer:
        for doc in docs:
            writer.write({"ids": doc})
    return str(folder)


def _litdata_doc(doc):
    yield torch.from_numpy(doc)


def write_litdata(folder: Path, docs) -> str | None:
    try:
        import litdata
        from litdata.streaming.item_loader import TokensLoader
    except ImportError:
        print("litdata is not installed (pip install litdata): its peer is skipped", file=sys.stderr)
        return None
    litdata.optimize(fn=_litdata_doc, inputs=docs, output_dir=str(folder), chunk_bytes="16MB", item_loader=TokensLoader(),
                     num_workers=1, mode="overwrite")
    return str(folder)


def rate(batches_factory, count_tokens, seconds: float, repeats: int) -> dict:
    """Best tokens/s over ``repeats`` passes of at most ``seconds`` each (first batch excluded)."""
    best, firsts = 0.0, []
    for _ in range(repeats):
        started = time.perf_counter()
        iterator = iter(batches_factory())
        first = next(iterator)
        begun = time.perf_counter()
        firsts.append(begun - started)
        tokens = 0
        del first
        for batch in iterator:
            tokens += count_tokens(batch)
            if time.perf_counter() - begun > seconds:
                break
        best = max(best, tokens / max(time.perf_counter() - begun, 1e-9))
    return {"tokens_per_s": best, "first_batch_s": min(firsts)}


def token_section(args, work: Path) -> dict:
    from sparkgpu import data
    from sparkgpu.data import _gather

    docs = make_documents(args.docs, args.mean_length)
    stream = np.concatenate(docs)
    mds = write_mds(work / "mds", docs)
    lit = write_litdata(work / "litdata", docs)
    seq, batch = args.seq_len, args.batch_size
    width = seq + 1
    per_cut = max(1, _CUT_TOKENS // (batch * width)) * batch
    results = {}
    for shuffle in (False, True):
        label = "shuffled" if shuffle else "in order"
        ds = data.token_dataset(local=mds, column="ids", seq_len=seq, batch_size=batch, shuffle=shuffle, rank=0, world_size=1)
        results[f"sparkgpu token_dataset ({label})"] = rate(lambda: ds, lambda b: b.numel(), args.seconds, args.repeats)
        blocks = (len(stream) - 1) // seq
        order = np.random.default_rng(0).permutation(blocks) if shuffle else np.arange(blocks)

        def ceiling():
            # As many blocks per gather as the loader cuts at once (one memcpy per block, in C),
            # handed out as views.
            raw, itemsize = stream.view(np.uint8), stream.dtype.itemsize
            for lo in range(0, blocks, per_cut):
                firsts = order[lo:lo + per_cut] * seq
                cut = np.empty((len(firsts), width), dtype=stream.dtype)
                _gather.gather_spans(cut.reshape(-1).view(np.uint8), np.arange(len(firsts), dtype=np.int64) * width * itemsize,
                                     [raw], None, firsts * itemsize, np.full(len(firsts), width * itemsize, dtype=np.int64))
                cut = torch.from_numpy(cut)
                for first in range(0, len(cut), batch):
                    yield cut[first:first + batch]

        results[f"ceiling: block copies in memory ({label})"] = rate(ceiling, lambda b: b.numel(), args.seconds, args.repeats)
        if lit is not None:
            import litdata
            from litdata.streaming.item_loader import TokensLoader

            def litdata_batches():
                lds = litdata.StreamingDataset(lit, item_loader=TokensLoader(block_size=width), shuffle=shuffle, seed=0)
                return litdata.StreamingDataLoader(lds, batch_size=batch, num_workers=0)

            results[f"litdata TokensLoader ({label})"] = rate(litdata_batches, lambda b: b.numel(), args.seconds, args.repeats)
    return {"tokens": int(len(stream)), "seq_len": seq, "batch_size": batch, "peers": results}


def mixture_section(args, work: Path) -> dict:
    from streaming import MDSWriter

    from sparkgpu import data

    sizes = [args.mix_samples // 2, args.mix_samples * 3 // 10, args.mix_samples // 5]
    folders, rng = [], np.random.default_rng(1)
    columns = {**{f"f{i:02d}": "float32" for i in range(32)}, "id": "int64"}
    whole = work / "mix-whole"
    with MDSWriter(out=str(whole), columns=columns, size_limit="16mb") as all_writer:
        for n, size in enumerate(sizes):
            folder = work / f"mix-{n}"
            with MDSWriter(out=str(folder), columns=columns, size_limit="16mb") as writer:
                for i in range(size):
                    sample = {**{f"f{j:02d}": np.float32(rng.random()) for j in range(32)}, "id": i}
                    writer.write(sample)
                    all_writer.write(sample)
            folders.append(str(folder))
    count = lambda b: len(b["id"])  # noqa: E731
    one = data.dataset(local=str(whole), batch_size=args.batch_size * 64, shuffle=True, rank=0, world_size=1)
    mix = data.dataset(streams=[data.Stream(local=f, proportion=p) for f, p in zip(folders, (0.5, 0.3, 0.2))],
                       epoch_size=sum(sizes), batch_size=args.batch_size * 64, shuffle=True, rank=0, world_size=1)
    peers = {"one dataset": rate(lambda: one, count, args.seconds, args.repeats),
             "three-stream mixture": rate(lambda: mix, count, args.seconds, args.repeats)}
    for figures in peers.values():
        figures["samples_per_s"] = figures.pop("tokens_per_s")
    return {"samples": sum(sizes), "batch_size": args.batch_size * 64, "peers": peers}


def ratios(report: dict) -> dict:
    """The comparisons the goals are about, taken within this run."""
    tokens, mixture = report["token_packing"]["peers"], report["mixture"]["peers"]
    out = {}
    for label in ("in order", "shuffled"):
        ours = tokens[f"sparkgpu token_dataset ({label})"]["tokens_per_s"]
        out[f"sparkgpu / ceiling ({label})"] = ours / tokens[f"ceiling: block copies in memory ({label})"]["tokens_per_s"]
        if f"litdata TokensLoader ({label})" in tokens:
            out[f"sparkgpu / litdata ({label})"] = ours / tokens[f"litdata TokensLoader ({label})"]["tokens_per_s"]
    out["mixture cost (one dataset / mixture)"] = (mixture["one dataset"]["samples_per_s"]
                                                   / mixture["three-stream mixture"]["samples_per_s"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=50_000)
    parser.add_argument("--mean-length", type=int, default=800)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--mix-samples", type=int, default=200_000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "tokens.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tokens-") as tmp:
        work = Path(tmp)
        report = {"machine": platform.platform(), "python": platform.python_version(),
                  "token_packing": token_section(args, work), "mixture": mixture_section(args, work)}
    for section in ("token_packing", "mixture"):
        print(f"\n{section}:")
        for name, figures in report[section]["peers"].items():
            print(f"  {name:48s} " + ", ".join(f"{k} {v:,.3g}" for k, v in figures.items()))
    report["ratios"] = ratios(report)
    print("\nratios (same run):")
    for name, value in report["ratios"].items():
        print(f"  {name:48s} {value:.3g}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
