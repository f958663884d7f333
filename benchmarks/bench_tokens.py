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

Every side reads the same documents in the same process. Each of ``--repeats`` repeats runs
the sides one after another, in an order that alternates from repeat to repeat, and every side
is built the same way each time: a new dataset object (litdata's dataset and loader, sparkgpu's
token_dataset, the ceiling's generator) over files the page cache already holds. One window
runs from that construction until at least ``--seconds`` have passed, over as many epochs as
that takes (an epoch's restart is inside the window for every side). Two figures per side:
start-up (construction to first batch) and the steady rate (tokens after the first batch over
the time after it); the rate with start-up counted is beside them. Ratios divide medians of
the steady rate. Results: benchmarks/results/tokens.json.

    python benchmarks/bench_tokens.py                                      # about 6 minutes on 2 cores
    python benchmarks/bench_tokens.py --docs 2000 --seconds 1 --repeats 1 --mix-samples 20000   # a quick look
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import load_seen, machine, method, spread

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
    litdata.optimize(
        fn=_litdata_doc,
        inputs=docs,
        output_dir=str(folder),
        chunk_bytes="16MB",
        item_loader=TokensLoader(),
        num_workers=1,
        mode="overwrite",
    )
    return str(folder)


def window(build, count, seconds: float) -> dict:
    """One timed window: ``build()`` a new source, then iterate it (epoch after epoch) for at
    least ``seconds``. Start-up is construction to first batch; the steady rate counts what
    follows the first batch; every batch, the first included, is counted in the total."""
    started = time.perf_counter()
    source = build()
    items, epochs, first, first_items = 0, 0, None, 0
    done = False
    while not done:
        for batch in source:
            items += count(batch)
            now = time.perf_counter()
            if first is None:
                first, first_items = now - started, items
            if now - started >= seconds:
                done = True
                break
        else:
            epochs += 1
            if first is None:
                raise RuntimeError("an epoch without a batch")
    total = time.perf_counter() - started
    steady_s = max(total - first, 1e-9)
    return {
        "startup_s": first,
        "seconds": total,
        "items": items,
        "whole_epochs": epochs,
        "steady_per_s": (items - first_items) / steady_s,
        "per_s_including_startup": items / total,
    }


def compare(sides: dict, count, seconds: float, repeats: int, unit: str) -> dict:
    """Runs every side's window ``repeats`` times, the order alternating per repeat; medians."""
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    names = list(sides)
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            runs[name].append(window(sides[name], count, seconds))
    out = {}
    for name, windows in runs.items():
        steady = spread([w["steady_per_s"] for w in windows], higher_is_better=True)
        out[name] = {
            f"{unit}_per_s": steady["median"],
            f"{unit}_per_s_spread": steady,
            "startup_s": spread([w["startup_s"] for w in windows])["median"],
            "startup_s_spread": spread([w["startup_s"] for w in windows]),
            f"{unit}_per_s_including_startup": spread([w["per_s_including_startup"] for w in windows])["median"],
            "window_s": spread([w["seconds"] for w in windows])["median"],
            "whole_epochs_per_window": [w["whole_epochs"] for w in windows],
        }
    return out


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
        blocks = (len(stream) - 1) // seq
        order = np.random.default_rng(0).permutation(blocks) if shuffle else np.arange(blocks)

        def ours():
            return data.token_dataset(
                local=mds, column="ids", seq_len=seq, batch_size=batch, shuffle=shuffle, rank=0, world_size=1
            )

        def ceiling():
            # As many blocks per gather as the loader cuts at once (one memcpy per block, in C),
            # handed out as views.
            raw, itemsize = stream.view(np.uint8), stream.dtype.itemsize
            for lo in range(0, blocks, per_cut):
                firsts = order[lo : lo + per_cut] * seq
                cut = np.empty((len(firsts), width), dtype=stream.dtype)
                _gather.gather_spans(
                    cut.reshape(-1).view(np.uint8),
                    np.arange(len(firsts), dtype=np.int64) * width * itemsize,
                    [raw],
                    None,
                    firsts * itemsize,
                    np.full(len(firsts), width * itemsize, dtype=np.int64),
                )
                cut = torch.from_numpy(cut)
                for first in range(0, len(cut), batch):
                    yield cut[first : first + batch]

        class Ceiling:  # a new iteration per epoch, as a dataset gives
            def __iter__(self):
                return ceiling()

        sides = {f"sparkgpu token_dataset ({label})": ours, f"ceiling: block copies in memory ({label})": Ceiling}
        if lit is not None:
            import litdata
            from litdata.streaming.item_loader import TokensLoader

            def litdata_batches():
                # litdata's documented token-block setup: TokensLoader with block_size, its own loader.
                lds = litdata.StreamingDataset(lit, item_loader=TokensLoader(block_size=width), shuffle=shuffle, seed=0)
                return litdata.StreamingDataLoader(lds, batch_size=batch, num_workers=0)

            sides[f"litdata TokensLoader ({label})"] = litdata_batches
        results.update(compare(sides, lambda b: b.numel(), args.seconds, args.repeats, "tokens"))
    return {
        "tokens": int(len(stream)),
        "seq_len": seq,
        "batch_size": batch,
        "peers": results,
        "workers": {"sparkgpu": 0, "litdata": 0, "ceiling": 0},
        "method": method(
            "construction of a new dataset object, then epochs until the window has lasted --seconds",
            startup="construction to first batch, reported apart as startup_s; the steady rate "
            "(tokens_per_s) counts from the first batch on; tokens_per_s_including_startup "
            "counts every batch over the whole window",
            repeats=args.repeats,
            statistic="median of the steady rate per window",
            order="sides alternate order per repeat",
            window_s=args.seconds,
            workers="none for any side: every side runs in the main process",
        ),
    }


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
    peers = compare(
        {
            "one dataset": lambda: data.dataset(
                local=str(whole), batch_size=args.batch_size * 64, shuffle=True, rank=0, world_size=1
            ),
            "three-stream mixture": lambda: data.dataset(
                streams=[data.Stream(local=f, proportion=p) for f, p in zip(folders, (0.5, 0.3, 0.2))],
                epoch_size=sum(sizes),
                batch_size=args.batch_size * 64,
                shuffle=True,
                rank=0,
                world_size=1,
            ),
        },
        count,
        args.seconds,
        args.repeats,
        "samples",
    )
    return {
        "samples": sum(sizes),
        "batch_size": args.batch_size * 64,
        "peers": peers,
        "method": method(
            "construction of a new dataset object, then epochs until the window has lasted --seconds",
            startup="construction to first batch, apart as startup_s",
            repeats=args.repeats,
            statistic="median of the steady rate per window",
            order="sides alternate order per repeat",
        ),
    }


def ratios(report: dict) -> dict:
    """The comparisons the goals are about, taken within this run."""
    tokens, mixture = report["token_packing"]["peers"], report["mixture"]["peers"]
    out = {}
    for label in ("in order", "shuffled"):
        ours = tokens[f"sparkgpu token_dataset ({label})"]["tokens_per_s"]
        out[f"sparkgpu / ceiling ({label})"] = (
            ours / tokens[f"ceiling: block copies in memory ({label})"]["tokens_per_s"]
        )
        if f"litdata TokensLoader ({label})" in tokens:
            theirs = tokens[f"litdata TokensLoader ({label})"]
            out[f"sparkgpu / litdata ({label})"] = ours / theirs["tokens_per_s"]
            out[f"sparkgpu / litdata, start-up counted ({label})"] = (
                tokens[f"sparkgpu token_dataset ({label})"]["tokens_per_s_including_startup"]
                / theirs["tokens_per_s_including_startup"]
            )
    out["method"] = "medians of the steady rate (after the first batch), same repeats and windows for every side"
    out["mixture cost (one dataset / mixture)"] = (
        mixture["one dataset"]["samples_per_s"] / mixture["three-stream mixture"]["samples_per_s"]
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=100_000, help="about 80M tokens at the default mean length")
    parser.add_argument("--mean-length", type=int, default=800)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--mix-samples", type=int, default=200_000)
    parser.add_argument("--seconds", type=float, default=5.0, help="each window lasts at least this long")
    parser.add_argument("--repeats", type=int, default=5, help="windows per side, the same for every side")
    parser.add_argument("--out", type=Path, default=RESULTS / "tokens.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tokens-") as tmp:
        work = Path(tmp)
        facts = machine()
        report = {"token_packing": token_section(args, work), "mixture": mixture_section(args, work)}
        report["machine"] = load_seen(facts)
    for section in ("token_packing", "mixture"):
        print(f"\n{section}:")
        for name, figures in report[section]["peers"].items():
            print(f"  {name:48s} " + ", ".join(f"{k} {v:,.3g}" for k, v in figures.items() if isinstance(v, float)))
    report["ratios"] = ratios(report)
    print("\nratios (same run):")
    for name, value in report["ratios"].items():
        print(f"  {name:48s} {value:.3g}" if isinstance(value, float) else f"  {name:48s} {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
