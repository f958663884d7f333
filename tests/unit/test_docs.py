"""The documentation site: it builds strictly, its benchmark figures come from the results files,
the API reference covers the public names, and the quickstart's code runs as written."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")


def _benchmarks_hook():
    spec = importlib.util.spec_from_file_location("docs_benchmarks_hook", DOCS / "hooks" / "benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_site_builds_strictly(tmp_path):
    """Broken links, missing anchors, unresolved references and docstring warnings fail the build."""
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    benchmarks = (tmp_path / "site" / "benchmarks" / "index.html").read_text()
    assert "{{" not in benchmarks
    launch = json.loads((ROOT / "benchmarks" / "results" / "launch.json").read_text())
    assert f"{launch['results']['torchrun CLI']['median_s']:.2f} s" in benchmarks
    assert (tmp_path / "site" / "benchmarks" / "results" / "launch.png").is_file()
    assert (
        "sparkgpu.api.decorator.distributed"
        in (tmp_path / "site" / "reference" / "sparkgpu" / "index.html").read_text()
    )


def test_every_reference_in_the_docs_resolves_in_its_results_file():
    hook = _benchmarks_hook()
    results = hook.ResultsFiles()
    for page in DOCS.rglob("*.md"):
        rendered = hook.render(page.read_text(), results)
        assert "{{" not in hook._CODE.sub("", rendered), f"{page}: a reference the hook did not read"
    assert {"launch.json", "checkpoint.json", "restart.json", "soak.json"} <= results.used


# --- no figure typed by hand ------------------------------------------------------------------
#
# A figure is a ratio (2.3x, 1.5×, "ten times the"), a rate (450 requests a second, MB/s, rows/s),
# a duration (3.5 s, 20 minutes, two seconds), a size (1.06 GB) or a percentage. In prose it must be
# a {{ }} reference into benchmarks/results, or a constant of the set-up named in CONSTANTS below.
# Code (fenced blocks and `spans`) is exempt: a setting or its default written as code
# (`client_timeout=120`) is the code's constant, not a measurement; a span holding nothing but a
# figure (`3.5 s`) is prose in disguise and is not exempt. Numbers without a unit (versions,
# sections, gpus=8, 2-core) are not figures.

_NUMBER = r"(?<![\w.,/-])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_IN_WORDS = r"(?:one|two|three|four|five|six|seven|eight|nine|ten|twelve|fifteen|twenty|thirty|forty|fifty|sixty|ninety|a hundred|hundreds of|a thousand|thousands of)"
_TIME_UNIT = r"(?:ns|µs|us|ms|s|secs?|seconds?|minutes?|mins?|hours?|h|days?)"
_SCALE = r"(?:\s?(?:k|M|G|thousand|million|billion))?"
_FIGURE = re.compile(
    "|".join(
        (
            rf"{_NUMBER}\s?[x×](?![\w×])",  # a ratio: 2.3x, 1.5×; not 224x224
            rf"\b(?:{_NUMBER}|{_IN_WORDS}|twice|half)\s(?:times|fold)\s(?:the|as|that|faster|slower|more|fewer|less"
            r"|longer|shorter|larger|smaller|higher|lower)\b",  # a ratio in words
            rf"{_NUMBER}{_SCALE}\s?[A-Za-z]*/s\b",  # a rate: MB/s, rows/s
            rf"{_NUMBER}{_SCALE}\s(?:[A-Za-z-]+\s){{1,2}}(?:a|an|per|each)\s(?:second|minute|hour)\b",  # in words
            rf"{_NUMBER}\s?{_TIME_UNIT}(?![\w/])",  # a duration: 3.5 s, 120 ms, 20 minutes
            rf"\b{_IN_WORDS}\s(?:milliseconds|seconds|minutes|hours)\b",  # two seconds
            rf"{_NUMBER}\s?(?:[kKMGTP]i?B|bytes?)\b",  # a size: 1.06 GB, 64 MiB
            rf"{_NUMBER}\s?(?:%|percent\b)",  # a percentage
        )
    )
)
_FENCED = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_SPAN = re.compile(r"(?<!`)`(?!`)((?:[^`\n]|\n(?!\s*\n))+?)`")  # a span may wrap, not cross a paragraph
_REFERENCE = re.compile(r"\{\{.*?\}\}", re.S)
_LINK_TARGET = re.compile(r"\]\([^)\s]*\)")

# The constants of the set-up a page may state as typed: (page, the phrase as written, why it is no
# measurement). A phrase covers the figures inside it; in it "(code)" stands for a code span and
# "(reference)" for a {{ }} reference. A phrase the page no longer has fails the test.
_SETTING = "a setting's default or a fixed interval or size of the code, not a measurement"
_GOAL = "a goal the issue set, not a measurement"
_SETUP = "a size, rate or scenario the benchmark is set up with, not a result"
_LIBRARY = "another library's constant or threshold, from its code or docs, not a measurement"
_MACHINE = "the size of the machine the benchmark ran on, a fact of the set-up"
_ARITHMETIC = "arithmetic on constants (a bucket width, a dtype's bytes, a rate of a fixed interval)"
_SYNTAX = "an example of what a setting accepts"
_TEST = "a setting of the test the page describes"
CONSTANTS: list[tuple[str, str, str]] = [
    ("README.md", "rank writes 1 GB of log.", _SETUP),
    ("benchmarks.md", "goal was 50% of the", _GOAL),
    ("benchmarks.md", "The goal (1.3x the best", _GOAL),
    ("benchmarks.md", "goal of 1.0x or more", _GOAL),
    ("benchmarks.md", "(goal: 2% or less", _GOAL),
    ("benchmarks.md", "packing (goal 1.0x) waits", _GOAL),
    ("benchmarks.md", "packing (goal 1.5x); other", _GOAL),
    ("benchmarks.md", "goal was 20x (code) at", _GOAL),
    ("benchmarks.md", "at least 1.0x pyarrow like", _GOAL),
    ("benchmarks.md", "at most 1.2x pyarrow's) needs", _GOAL),
    ("benchmarks.md", "(code) (272 MB: 2M rows", _SETUP),
    ("benchmarks.md", "rows of 136 bytes;", _SETUP),
    ("benchmarks.md", "profile puts 30 ms to the", _SETUP),
    ("benchmarks.md", "and 100 MB/s per connection", _SETUP),
    ("benchmarks.md", "goals were 70% on loopback", _GOAL),
    ("benchmarks.md", "loopback and 80% on the", _GOAL),
    ("benchmarks.md", "at least 4x what a", _SETTING),
    ("benchmarks.md", "was under 0.2 s, **met**). Its", _GOAL),
    ("benchmarks.md", "bodies over 5 MB in", _LIBRARY),
    ("benchmarks.md", "on a 24 GB machine ((code)).", _MACHINE),
    ("benchmarks.md", "samples (a 100 kB payload and", _SETUP),
    ("benchmarks.md", "(code), (code); 64 MB", _SETUP),
    ("benchmarks.md", "S3-like link (30 ms to the", _SETUP),
    ("benchmarks.md", "byte, 100 MB/s per connection)", _SETUP),
    ("benchmarks.md", "shuffled (goal 1.3x, **met** both;", _GOAL),
    ("benchmarks.md", "epoch at 1.3x the best", _GOAL),
    ("benchmarks.md", "shuffled (goal 80%,", _GOAL),
    ("benchmarks.md", "its first 64 MB shard) the", _SETUP),
    ("benchmarks.md", "(code) under 25 GB may thrash;", _LIBRARY),
    ("benchmarks.md", "the 1.3x goal **met", _GOAL),
    ("benchmarks.md", "order**, the 80% goal **missed**", _GOAL),
    ("benchmarks.md", "a whole 64 MB shard over", _SETUP),
    ("benchmarks.md", "cores handing 6.4 MB batches to", _SETUP),
    ("benchmarks.md", "files of 32 MB as ranges", _SETUP),
    ("benchmarks.md", "4 MiB from one", _SETUP),
    ("benchmarks.md", "exit after 10 s idle): (reference)", _LIBRARY),
    ("benchmarks.md", "all_reduce of 1 MiB to 1", _SETUP),
    ("benchmarks.md", "MiB to 1 GiB of float32:", _SETUP),
    ("benchmarks.md", "pageable memory, 1 MiB to 1", _SETUP),
    ("benchmarks.md", "MiB to 1 GiB,", _SETUP),
    ("benchmarks.md", "as float32 (four times the bytes), and", _ARITHMETIC),
    ("benchmarks.md", "(code) | 1 GiB from pinned", _SETUP),
    ("guides/checkpoints.md", "each attempt (7 days by default", _SETTING),
    ("guides/checkpoints.md", "at most 1.3x (code)'s synchronous", _GOAL),
    ("guides/checkpoints.md", "and every 64 MB written is", _SETTING),
    ("guides/checkpoints.md", "written in 64 MB", _SETTING),
    ("guides/data.md", "claim every 20 s (a third", _SETTING),
    ("guides/data.md", "60 s lease). A", _SETTING),
    ("guides/when-a-job-stops.md", "(at most every 15 s)", _SETTING),
    ("guides/when-a-job-stops.md", "relative error of 2% (bf16", _SETTING),
    ("guides/when-a-job-stops.md", "(default 5GiB; (code) checks only", _SETTING),
    ("guides/when-a-job-stops.md", "needs (default 5GiB; (code) only", _SETTING),
    ("guides/launch.md", "5GiB | free space a node's", _SETTING),
    ("guides/when-a-job-stops.md", "the goal is 10 s at most)", _GOAL),
    ("guides/when-a-job-stops.md", "the goal is 1% at most.", _GOAL),
    ("guides/data.md", "(code), e.g. 500GB). Shards download", _SYNTAX),
    ("guides/data.md", "(within about 19%).", _ARITHMETIC),
    ("guides/data.md", "(reference)x (goal: 1.0x). Both sides", _GOAL),
    ("guides/data.md", "(goals: 1.0x TRL's packing,", _GOAL),
    ("guides/data.md", "packing, 1.5x padding)**: the", _GOAL),
    ("guides/data.md", "at least 4x what one", _SETTING),
    ("guides/data.md", "waits (about 12 MB at 30", _ARITHMETIC),
    ("guides/data.md", "MB at 30 ms and 100", _ARITHMETIC),
    ("guides/data.md", "ms and 100 MB/s, up to", _ARITHMETIC),
    ("guides/data.md", "up to 16 MiB), so the", _SETTING),
    ("guides/data.md", "loopback (30 ms to the", _SETUP),
    ("guides/data.md", "first byte, 100 MB/s per connection),", _SETUP),
    ("guides/data.md", "behind the 30 ms / 100", _SETUP),
    ("guides/data.md", "ms / 100 MB/s link (needs", _SETUP),
    ("guides/databricks.md", "defaults to 3 hours on local", _SETTING),
    ("guides/launch.md", "within (code) (15 minutes by default),", _SETTING),
    ("guides/launch.md", "pool) SIGKILL 2 s after the", _SETTING),
    ("guides/launch.md", "rewrites every 10 s with the", _SETTING),
    ("guides/launch.md", "older than 60 s belongs to", _SETTING),
    ("guides/launch.md", "5 s; a waiting", _SETTING),
    ("guides/launch.md", "the queue every 5 s.", _SETTING),
    ("guides/launch.md", "its store 360 writes an hour;", _ARITHMETIC),
    ("guides/launch.md", "wait (code) (600 s) for each", _SETTING),
    ("guides/launch.md", "(code) as 64 MiB: write (code)", _SYNTAX),
    ("guides/launch.md", "seconds or 90s, (code), 12h,", _SYNTAX),
    ("guides/launch.md", "90s, (code), 12h, (code) ((code)).", _SYNTAX),
    ("guides/launch.md", "data cache (500GB) |", _SETTING),
    ("guides/launch.md", "older than 30 days ((code) keeps", _SETTING),
    ("guides/launch.md", "dropped after 10 s and never", _SETTING),
    ("guides/launch.md", "2 s into its", _SETTING),
    ("guides/predict.md", "goal of 1.3x the best", _GOAL),
    ("guides/when-a-job-stops.md", "larger of 10 minutes and", _SETTING),
    ("guides/when-a-job-stops.md", "and 10 times the longest", _SETTING),
    ("guides/spark.md", "job's (code) (7 days for remote", _SETTING),
    ("guides/spark.md", "after (code) (600 s); an explicit", _SETTING),
    ("guides/spark.md", "grace and 5 s", _SETTING),
    ("guides/spark.md", "for 10 s without saying", _SETTING),
    ("guides/spark.md", "least every 2 minutes;", _SETTING),
    ("guides/spark.md", "(code) (15 minutes by default)", _SETTING),
    ("guides/spark.md", "again every 30 s; once all", _SETTING),
    ("guides/spark.md", "10 s, or four", _SETTING),
    ("guides/spark.md", "(code) (120 s, or (code)", _SETTING),
    ("guides/spark.md", "8 s timeout, the", _TEST),
    ("guides/spark.md", "is (code) (10 s).", _SETTING),
    ("guides/spark.md", "so every 30 s, up to", _SETTING),
    ("guides/spark.md", "for (code) (10 s here); (code)", _TEST),
    ("guides/spark.md", "again only 15 s later. The", _LIBRARY),
    ("guides/spark.md", "node every 30 s (every 2", _SETTING),
    ("guides/spark.md", "s (every 2 s", _SETTING),
    ("guides/spark.md", "false losses, 60 s store stall", _SETUP),
    ("guides/spark.md", "false losses, 1 GB log |", _SETUP),
    ("guides/spark.md", "at most 0.2 requests a second per running", _GOAL),
    ("guides/spark.md", "resolver timeout 1 s | floor:", _SETUP),
    ("guides/spark.md", "its timeout (5 s, (code)'s", _LIBRARY),
    ("guides/spark.md", "object every 20 s and its", _SETTING),
    ("guides/sweeps.md", "(code), 20 s by default; a", _SETTING),
    ("guides/when-a-job-stops.md", "every (code) (20 s by default).", _SETTING),
    ("guides/spark.md", "least every 2 minutes), so per", _SETTING),
    ("guides/spark.md", "node per 30 s. The client's", _SETTING),
    ("guides/spark.md", "logs every 2 s instead of", _SETTING),
    ("guides/spark.md", "(code) (default 15GB, checked before", _SETTING),
]


def typed_figures(markdown: str) -> list[tuple[int, str, str, int]]:
    """(line number, figure, the line, where the figure starts in it) for every figure of a page's
    prose that is not a ``{{ }}`` reference."""
    text = _FENCED.sub(lambda block: "\n" * block.group(0).count("\n"), markdown)
    text = _REFERENCE.sub("(reference)", text)
    text = _LINK_TARGET.sub("]()", text)

    def code(span: re.Match) -> str:
        inside = span.group(1).strip()
        return inside if _FIGURE.fullmatch(inside) else "(code)" + "\n" * span.group(0).count("\n")

    text = _SPAN.sub(code, text)
    return [
        (number, figure.group(0), line, figure.start())
        for number, line in enumerate(text.splitlines(), 1)
        for figure in _FIGURE.finditer(line)
    ]


def _covers(phrase: str, line: str, start: int, length: int) -> bool:
    """Whether an occurrence of ``phrase`` in ``line`` holds the figure at ``start``."""
    at = line.find(phrase)
    while at != -1:
        if at <= start and start + length <= at + len(phrase):
            return True
        at = line.find(phrase, at + 1)
    return False


def _pages() -> list[Path]:
    return sorted([*DOCS.rglob("*.md"), ROOT / "README.md"])


def test_no_figure_in_the_docs_is_typed_by_hand():
    """Every ratio, rate, duration, size or percentage in prose is a reference into a results file,
    or a constant of the set-up listed with its reason in CONSTANTS."""
    allowed: dict[str, list[str]] = {}
    for page, phrase, reason in CONSTANTS:
        assert reason, (page, phrase)
        allowed.setdefault(page, []).append(phrase)
    typed, unused = [], {(page, phrase) for page, phrase, _ in CONSTANTS}
    for path in _pages():
        page = str(path.relative_to(ROOT if path.parent == ROOT else DOCS))
        for number, figure, line, start in typed_figures(path.read_text()):
            covering = [p for p in allowed.get(page, []) if _covers(p, line, start, len(figure))]
            if covering:
                unused.difference_update((page, p) for p in covering)
            else:
                typed.append(f"{page}:{number}: {figure!r} in {line.strip()!r}")
    assert not typed, (
        "figures typed by hand: write each as a {{ file.json/key | spec }} reference into benchmarks/results "
        "(the benchmark must write the value), reword it without the number, or, for a constant of the set-up, "
        "add it to CONSTANTS with the reason:\n" + "\n".join(typed)
    )
    assert not unused, f"CONSTANTS that no page says any more (remove them): {sorted(unused)}"


def test_a_constant_covers_only_the_figure_inside_its_phrase():
    line = "a job looks every 5 s; it finished in 5 s"
    (_, _, _, first), (_, _, _, second) = typed_figures(line)
    assert _covers("looks every 5 s;", line, first, 3)
    assert not _covers("looks every 5 s;", line, second, 3)


@pytest.mark.parametrize(
    "prose",
    [
        "sparkgpu is 2.3x faster",
        "about 1.5× the peer",
        "about ten times the CPU of a write",
        "the S3 server gets about 450 requests a second",
        "at 120 MB/s per connection",
        "1,200,000 rows/s",
        "about 3.5 s of CPU each",
        "it takes 20 minutes",
        "within 120 ms",
        "about two seconds of CPU",
        "the 1.06 GB state",
        "64 MiB travel with the tree",
        "up to 83% of the CPU",
        "a span that is only a figure: `3.5 s`",
        "a span that wraps `client_timeout=120` and then 0.69 s",
    ],
)
def test_a_typed_figure_is_found(prose):
    assert typed_figures(prose), prose


@pytest.mark.parametrize(
    "prose",
    [
        "torch 2.11 and transformers 5.0.1, section 3.2, Python 3.11",
        "`@distributed(gpus=8)` on a 2-core machine, 8 GPUs, H200, ResNet-50, bf16, x86_64",
        "rows of 256x3x224x224 images",
        "{{ launch.json/results/torchrun CLI/median_s | .2f }} s, {{ a.json/x over a.json/y | .1f }}x",
        'a setting in code: `client_timeout=120` or `max_runtime="2h"`',
        "```\nsaved in 1.23s at 450 MB/s\n```",
        "see [the table](benchmarks.md#results-on-one-h200), step 300, 4,896 blocks, 2 workers x 2 GPUs",
    ],
)
def test_what_is_not_a_figure_is_left_alone(prose):
    assert typed_figures(prose) == [], prose


def test_a_figure_missing_from_its_results_file_fails_naming_the_key(tmp_path):
    hook = _benchmarks_hook()
    (tmp_path / "launch.json").write_text(json.dumps({"results": {"torchrun CLI": {"median_s": 4.369}}}))
    results = hook.ResultsFiles(tmp_path)
    assert hook.render("{{ launch.json/results/torchrun CLI/median_s | .1f }} s", results) == "4.4 s"
    with pytest.raises(hook.BenchmarkReferenceError, match=r"launch.json/results: no key 'warm pool'.*'torchrun CLI'"):
        hook.render("| {{ launch.json/results/warm pool/median_s | .2f }} |", results)
    with pytest.raises(hook.BenchmarkReferenceError, match=r"'restart.json': no such results file.*launch.json"):
        hook.render("{{ restart.json/median_seconds/sparkgpu }}", results)


def test_references_format_scale_and_divide(tmp_path):
    hook = _benchmarks_hook()
    (tmp_path / "r.json").write_text(
        json.dumps(
            {
                "peers": {"ceiling: numpy (in order)": {"tokens_per_s": 544614813.7}},
                "ratios": {"spark: sparkgpu / floor": 0.8},
                "samples": [{"n": 3}, {"n": 12}],
            }
        )
    )
    results = hook.ResultsFiles(tmp_path)
    text = (
        "{{ r.json/peers/ceiling: numpy (in order)/tokens_per_s | .0fM }} "
        "{{ r.json/ratios/spark: sparkgpu / floor | .0% }} {{ r.json/samples/1/n }} "
        "{{ r.json/samples/1/n over r.json/samples/0/n | .1f }}x"
    )
    assert hook.render(text, results) == "545M 80% 12 4.0x"
    code = "`{{ r.json/samples/0/n }}` and\n```\n{{ r.json/nowhere }}\n```\n{{ r.json/samples/0/n }}"
    assert hook.render(code, results) == "`{{ r.json/samples/0/n }}` and\n```\n{{ r.json/nowhere }}\n```\n3"


def test_versus_calls_a_difference_inside_the_spread_a_tie(tmp_path):
    hook = _benchmarks_hook()
    spreads = {
        "trainer": {"median": 1.70, "q1": 1.15, "q3": 1.70},
        "sealed": {"median": 0.69, "q1": 0.64, "q3": 1.75},  # a lower median, the quartiles overlapping
        "apart": {"median": 0.40, "q1": 0.35, "q3": 0.45},
    }
    (tmp_path / "r.json").write_text(json.dumps({"blocking_s": spreads}))
    results = hook.ResultsFiles(tmp_path)
    assert hook.render("{{ r.json/blocking_s/sealed versus r.json/blocking_s/trainer }}", results) == "a tie"
    assert hook.render("{{ r.json/blocking_s/apart versus r.json/blocking_s/trainer | .3f }}", results) == "0.235x"
    with pytest.raises(hook.BenchmarkReferenceError, match=r"'versus' compares spreads"):
        hook.render("{{ r.json/blocking_s/apart/median versus r.json/blocking_s/trainer }}", results)


PUBLIC_MODULES = [
    "sparkgpu",
    "sparkgpu.runtime",
    "sparkgpu.data",
    "sparkgpu.train",
    "sparkgpu.hf",
    "sparkgpu.tracking",
    "sparkgpu.registry",
    "sparkgpu.predict",
    "sparkgpu.usage",
    "sparkgpu.env",
    "sparkgpu.ray",
    "sparkgpu.errors",
    "sparkgpu.spec.units",
    "sparkgpu.spec.catalog",
    "sparkgpu.launch.client.attempt_report",
]


def _documented_names() -> set[str]:
    """The last segment of every ``::: target`` of docs/reference; a whole module adds its ``__all__``."""
    names = set()
    for page in (DOCS / "reference").glob("*.md"):
        for line in page.read_text().splitlines():
            if not line.startswith("::: "):
                continue
            target = line[4:].strip()
            names.add(target.rsplit(".", 1)[-1])
            try:
                names.update(importlib.import_module(target).__all__)
            except ImportError:
                pass  # a class or function, not a module
    return names


def test_the_api_reference_documents_every_public_name():
    documented = _documented_names()
    missing = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            if name.startswith("__") or isinstance(getattr(module, name), type(sys)):
                continue  # sparkgpu.data, sparkgpu.runtime...: modules with pages of their own
            if name not in documented:
                missing.append(f"{module_name}.{name}")
    assert not missing, f"public names without an entry in docs/reference: {missing}"


# --- the quickstart's code ------------------------------------------------------------------

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_EXPECTED = re.compile(r"#\s*->\s*(.+?)(?:\s{2,}|$)")


def _quickstart_blocks() -> list[str]:
    blocks = _BLOCK.findall((DOCS / "quickstart.md").read_text())
    assert len(blocks) >= 3
    return blocks


def _run_block(source: str, namespace: dict) -> int:
    """Runs one block statement by statement; a statement ending in ``# -> value`` must equal it."""
    lines = source.splitlines()
    checked = 0
    for node in ast.parse(source).body:
        expected = _EXPECTED.search(lines[node.end_lineno - 1]) if isinstance(node, ast.Expr) else None
        if expected is None:
            exec(compile(ast.Module([node], type_ignores=[]), "quickstart.md", "exec"), namespace)
            continue
        value = eval(compile(ast.Expression(node.value), "quickstart.md", "eval"), namespace)
        assert value == ast.literal_eval(expected.group(1)), (
            f"{ast.unparse(node)}: {value!r}, the page says {expected.group(1)}"
        )
        checked += 1
    return checked


@pytest.mark.integration
@pytest.mark.spark
def test_every_quickstart_snippet_runs_as_written(request):
    """The quickstart's blocks run in order in one namespace (as pasted into one notebook); the
    Spark block gets the test session as ``spark``."""
    namespace = {"__name__": "quickstart"}
    checked = 0
    for block in _quickstart_blocks():
        if re.search(r"\bspark\.", block) and "spark" not in namespace:
            namespace["spark"] = request.getfixturevalue("spark")
        checked += _run_block(block, namespace)
    assert checked >= 5
    import torch

    model = namespace["model"]
    x = torch.rand(256, 4)
    target = 2 * x[:, 0] - x[:, 1]
    assert torch.nn.functional.mse_loss(model(x).squeeze(1), target).item() < 0.05, "the quickstart model did not learn"
