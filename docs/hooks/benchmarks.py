"""MkDocs hook: benchmark figures in the docs are read from ``benchmarks/results/*.json``.

A page writes a figure as a reference to a results file instead of a number, so a re-run
benchmark updates every page that quotes it and a figure can never disagree with its results:

    | torchrun CLI | {{ launch.json/results/torchrun CLI/median_s | .2f }} s |

- the first segment is a file of ``benchmarks/results``; the others are keys, separated by ``/``
  (a key that itself contains ``/`` is matched whole: the longest key that fits wins);
- after ``|`` an optional Python format spec; a trailing ``k``, ``M`` or ``G`` scales the value
  and appends the letter (``{{ ... | .0fM }}`` renders 266356792 as ``266M``);
- ``A over B`` renders the ratio of two references (``{{ a.json/x over a.json/y | .1f }}x``);
- ``A versus B`` compares two spreads (``common.spread()``: median and quartiles): ``a tie`` where
  their interquartile ranges overlap, the difference being inside the noise of the repeats, and
  otherwise the ratio of their medians followed by ``x`` (``{{ a.json/x versus a.json/y | .2f }}``);
- inside code (a fenced block or a backtick span) a reference is shown as written.

A reference to a missing file or key fails the build, naming the file, the key and the keys
that exist there. The PNG plots of ``benchmarks/results`` are published under the same path, so
a page shows one with ``![launch](benchmarks/results/launch.png)``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

__all__ = ["BenchmarkReferenceError", "ResultsFiles", "render"]

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
PUBLISHED_UNDER = "benchmarks/results"

_REFERENCE = re.compile(r"\{\{\s*(?P<expr>[^{}|]+?)\s*(?:\|\s*(?P<spec>[^{}|]*?)\s*)?\}\}")
_SCALES = {"k": 1e3, "M": 1e6, "G": 1e9}
_CODE = re.compile(r"(^(?:```|~~~).*?^(?:```|~~~)[^\n]*$|`[^`\n]+`)", re.S | re.M)


class BenchmarkReferenceError(PluginError):
    """A page quotes a benchmark figure that its results file does not have."""


class ResultsFiles:
    """The JSON files of one results folder, each read once per build.

    Args:
        folder: the folder holding ``<name>.json`` results.
    """

    def __init__(self, folder: Path = RESULTS_DIR):
        self.folder = Path(folder)
        self._loaded: dict[str, object] = {}
        self.used: set[str] = set()

    def value(self, reference: str) -> object:
        """Returns the value that ``file.json/key/key...`` names.

        Raises:
            BenchmarkReferenceError: the file or one of the keys does not exist.
        """
        name, _, path = reference.strip().partition("/")
        document = self._document(name)
        self.used.add(name)
        return _lookup(document, path.split("/") if path else [], name)

    def _document(self, name: str) -> object:
        if name not in self._loaded:
            file = self.folder / name
            if not name.endswith(".json") or not file.is_file():
                known = ", ".join(sorted(p.name for p in self.folder.glob("*.json")))
                raise BenchmarkReferenceError(
                    f"benchmark reference to {name!r}: no such results file in {self.folder} "
                    f"(there are: {known}); re-run its benchmark or fix the reference")
            self._loaded[name] = json.loads(file.read_text())
        return self._loaded[name]


def _lookup(node: object, segments: list[str], trail: str) -> object:
    if not segments:
        return node
    if isinstance(node, list):
        index = segments[0]
        if index.isdigit() and int(index) < len(node):
            return _lookup(node[int(index)], segments[1:], f"{trail}/{index}")
        raise BenchmarkReferenceError(f"{trail}: no item {index!r} (a list of {len(node)})")
    if not isinstance(node, dict):
        raise BenchmarkReferenceError(f"{trail} is a value ({node!r}), it has no key {segments[0]!r}")
    # Keys may contain "/" themselves ("spark: sparkgpu / dataframe_to_mds"): longest match wins.
    for take in range(len(segments), 0, -1):
        key = "/".join(segments[:take])
        if key in node:
            return _lookup(node[key], segments[take:], f"{trail}/{key}")
    known = ", ".join(repr(k) for k in node)
    raise BenchmarkReferenceError(
        f"{trail}: no key {segments[0]!r}; it has {known}. The results file lacks a figure the "
        "docs quote: re-run its benchmark or fix the reference")


def _format(value: object, spec: str | None) -> str:
    if not spec:
        return str(value)
    if spec[-1] in _SCALES and isinstance(value, (int, float)):
        return format(value / _SCALES[spec[-1]], spec[:-1] or ".0f") + spec[-1]
    try:
        return format(value, spec)
    except (TypeError, ValueError) as exc:
        raise BenchmarkReferenceError(f"cannot format {value!r} with {spec!r}: {exc}") from exc


TIE = "a tie"


def _compare(first: object, second: object, first_name: str, second_name: str, spec: str | None) -> str:
    """``a tie`` where two spreads' interquartile ranges overlap, else the ratio of their medians."""
    for name, value in ((first_name, first), (second_name, second)):
        if not (isinstance(value, dict) and {"median", "q1", "q3"} <= value.keys()):
            raise BenchmarkReferenceError(
                f"{name.strip()}: 'versus' compares spreads (median, q1, q3), this is {value!r}")
    a, b = first, second
    if not (a["q3"] < b["q1"] or b["q3"] < a["q1"]):
        return TIE
    return _format(a["median"] / b["median"], spec or ".2f") + "x"


def render(markdown: str, results: ResultsFiles) -> str:
    """Replaces every ``{{ file.json/key... | spec }}`` of a page by its formatted value.

    Args:
        markdown: the page's Markdown.
        results: where the references are looked up.

    Returns:
        The Markdown with every reference replaced.

    Raises:
        BenchmarkReferenceError: a reference names a missing file or key.
    """

    def replace(match: re.Match) -> str:
        expr = match.group("expr")
        if " versus " in expr:
            first, second = expr.split(" versus ", 1)
            return _compare(results.value(first), results.value(second), first, second, match.group("spec"))
        if " over " in expr:
            numerator, denominator = expr.split(" over ", 1)
            value = results.value(numerator) / results.value(denominator)
        else:
            value = results.value(expr)
        return _format(value, match.group("spec"))

    # Code is shown as written: a reference inside a code block or span stays literal.
    parts = _CODE.split(markdown)
    return "".join(part if i % 2 else _REFERENCE.sub(replace, part) for i, part in enumerate(parts))


_results = ResultsFiles()


def on_config(config, **kwargs):
    global _results
    _results = ResultsFiles()  # a rebuild (mkdocs serve) reads re-run results
    return config


def on_files(files, config, **kwargs):
    for png in sorted(RESULTS_DIR.glob("*.png")):
        files.append(File.generated(config, f"{PUBLISHED_UNDER}/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown, page, config, files, **kwargs):
    try:
        return render(markdown, _results)
    except BenchmarkReferenceError as exc:
        raise BenchmarkReferenceError(f"{page.file.src_uri}: {exc}") from exc


def on_serve(server, config, builder, **kwargs):
    server.watch(str(RESULTS_DIR))
    return server
