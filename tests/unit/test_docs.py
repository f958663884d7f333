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
    assert "sparkgpu.decorator.distributed" in (tmp_path / "site" / "reference" / "sparkgpu" / "index.html").read_text()


def test_every_figure_in_the_docs_is_read_from_its_results_file():
    hook = _benchmarks_hook()
    results = hook.ResultsFiles()
    for page in DOCS.rglob("*.md"):
        rendered = hook.render(page.read_text(), results)
        assert "{{" not in hook._CODE.sub("", rendered), f"{page}: a reference the hook did not read"
    assert {"launch.json", "checkpoint.json", "restart.json", "soak.json"} <= results.used


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
    "sparkgpu.units",
    "sparkgpu.catalog",
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
