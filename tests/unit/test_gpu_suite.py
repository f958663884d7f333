"""benchmarks/gpu_suite.py: every part ends with a status and a reason, on a machine with or without a GPU,
and the formulas its figures rest on (nccl-tests' bus bandwidth, a PCIe link's limit) are right."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_suite.py"
STATUSES = {"ok", "skipped", "failed"}


@pytest.fixture
def suite(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its imports of common.py and bench_images.py
    spec = importlib.util.spec_from_file_location("gpu_suite", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path: Path, *arguments: str) -> dict:
    out = tmp_path / "results"
    # Minutes, not seconds: the CPU-side parts start process pools and loader workers, slow on a
    # busy 2-core machine (about 40 s on a quiet one).
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--work-dir", str(tmp_path), *arguments],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {path.name: json.loads(path.read_text()) for path in out.glob("gpu-*.json")}


def _check_entry(where: str, entry: dict) -> None:
    assert entry["status"] in STATUSES, (where, entry)
    if entry["status"] == "skipped":
        assert entry.get("reason"), f"{where} is skipped without a reason: {entry}"
    if entry["status"] == "failed":
        assert entry.get("error") and "traceback" in entry, (where, entry)


def test_small_run_gives_every_part_and_measurement_a_status(suite, tmp_path):
    import torch

    files = _run(tmp_path, "--small")
    assert set(files) == {"gpu-suite.json"} | {f"gpu-{part}.json" for part in suite.PARTS}
    assert len(files["gpu-suite.json"]["runs"]) == 1
    whole = files["gpu-suite.json"]["runs"][0]
    assert whole["command"] == "python benchmarks/gpu_suite.py --budget-s 480 --small"
    assert list(whole["parts"]) == list(suite.PARTS)
    assert whole["machine"]["gpu"]["torch"] == torch.__version__
    for part in suite.PARTS:
        record = files[f"gpu-{part}.json"]
        assert record == whole["parts"][part]
        _check_entry(part, record)
        assert set(record["measurements"]) == set(suite.PLANNED[part]), part
        for key, entry in record["measurements"].items():
            _check_entry(f"{part}/{key}", entry)
        assert "machine" in record and "cpus" in record["machine"]
    measured = {(part, key): files[f"gpu-{part}.json"]["measurements"][key] for part, key in _all_keys(suite)}
    # The CPU-side references run everywhere.
    for key in (
        ("jpeg", "cpu_torchvision"),
        ("resnet_wait", "cache_loader_only"),
        ("resnet_wait", "volume_loader_only"),
    ):
        assert measured[key]["status"] == "ok", measured[key]
        assert measured[key]["images_per_s"] > 0
    assert measured[("sft", "loader_only")]["status"] == "ok", measured[("sft", "loader_only")]
    assert measured[("sft", "loader_only")]["row_tokens_per_s"] > 0
    assert measured[("jpeg", "cpu_fused")]["status"] in {"ok", "skipped"}
    if not torch.cuda.is_available():
        for part in ("preflight", "nccl", "h2d"):
            assert whole["parts"][part]["status"] == "skipped"
            assert whole["parts"][part]["reason"] == suite.NO_CUDA
        gpu_keys = [
            ("preflight", "node_checks"),
            ("nccl", "all_reduce"),
            ("h2d", "pinned_vs_pageable"),
            ("h2d", "image_batch"),
        ]
        gpu_keys += [("jpeg", "nvjpeg_decode"), ("jpeg", "nvjpeg_decode_crop_flip")]
        gpu_keys += [
            ("resnet_wait", key) for key in ("model_only", "cache_train", "volume_train", "cache_train_transform")
        ]
        gpu_keys += [("sft", "step_resident"), ("sft", "step_fed")]
        for key in gpu_keys:
            assert measured[key] == {"status": "skipped", "reason": suite.NO_CUDA}, key
    for part in ("jpeg", "resnet_wait"):
        assert files[f"gpu-{part}.json"]["method"]["timed"]


def _all_keys(suite):
    return [(part, key) for part in suite.PARTS for key in suite.PLANNED[part]]


def test_parts_that_do_not_fit_the_budget_are_skipped_and_the_rest_not_selected(suite, tmp_path):
    files = _run(tmp_path, "--only", "jpeg", "--budget-s", "1")
    parts = files["gpu-suite.json"]["runs"][-1]["parts"]
    assert parts["jpeg"]["status"] == "skipped" and parts["jpeg"]["reason"] == "budget"
    assert all(entry["reason"] == "budget" for entry in parts["jpeg"]["measurements"].values())
    for part in ("nccl", "h2d", "resnet_wait"):
        assert parts[part] == {"part": part, "status": "skipped", "reason": "not selected (--only)"}
        assert f"gpu-{part}.json" not in files  # an earlier run's results for it are left alone


def test_each_run_is_appended_and_earlier_runs_are_left_as_they_were(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    # A file from before the suite kept its runs itself: its keys and entries stay as written.
    earlier = {
        "suite": "gpu",
        "machine": {"cpus": 16},
        "runs": [{"parts": ["nccl"], "command": "python benchmarks/gpu_suite.py --only nccl", "note": "by hand"}],
    }
    (out / "gpu-suite.json").write_text(json.dumps(earlier))
    first = _run(tmp_path, "--only", "jpeg", "--budget-s", "1")["gpu-suite.json"]
    assert {k: v for k, v in first.items() if k != "runs"} == {k: v for k, v in earlier.items() if k != "runs"}
    assert first["runs"][0] == earlier["runs"][0] and len(first["runs"]) == 2
    assert first["runs"][1]["command"] == "python benchmarks/gpu_suite.py --budget-s 1 --only jpeg"
    assert first["runs"][1]["parts"]["jpeg"]["reason"] == "budget"
    second = _run(tmp_path, "--only", "h2d,jpeg", "--budget-s", "1")["gpu-suite.json"]
    assert second["runs"][:2] == first["runs"]
    assert len(second["runs"]) == 3 and second["runs"][2]["options"]["only"] == ["h2d", "jpeg"]


def test_a_suite_file_that_is_not_json_stops_the_run_before_any_part(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "gpu-suite.json").write_text("{ half written")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "jpeg", "--out", str(out), "--work-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode != 0 and "move it aside, or pass another --out" in done.stderr
    assert (out / "gpu-suite.json").read_text() == "{ half written"
    assert not (out / "gpu-jpeg.json").exists()


def test_only_rejects_an_unknown_part(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "nccl,disk", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "unknown part(s) disk" in done.stderr


def test_results_name_no_folder_of_this_machine(suite):
    trace = f'File "{sys.prefix}/lib/x.py", line 1\nFile "{suite.HERE}/gpu_suite.py"\n{Path.home()}/cache'
    assert (
        suite.without_paths(trace)
        == 'File "<venv>/lib/x.py", line 1\nFile "<repo>/benchmarks/gpu_suite.py"\n<home>/cache'
    )


def test_bus_bandwidth_is_nccl_tests_all_reduce_formula(suite):
    assert suite.bus_bandwidth(100.0, 8) == pytest.approx(175.0)
    assert suite.bus_bandwidth(100.0, 2) == pytest.approx(100.0)
    assert suite.bus_bandwidth(100.0, 4) == pytest.approx(150.0)
    assert suite.bus_bandwidth(100.0, 1) == 0.0  # one rank: nothing crosses a link


@pytest.mark.parametrize(
    "generation, width, limit",
    [(1, 16, 4.0), (2, 8, 4.0), (3, 16, 15.754), (4, 16, 31.508), (5, 16, 63.015), (6, 16, 121.0), (4, 8, 15.754)],
)
def test_pcie_limit_per_generation_and_width(suite, generation, width, limit):
    assert suite.pcie_limit_gb_per_s(generation, width) == pytest.approx(limit, abs=1e-3)


def test_pcie_limit_from_nvidia_smi_csv(suite):
    text = "pcie.link.gen.current, pcie.link.width.current\n5, 16\n4, 8\n"
    assert suite.parse_pcie_csv(text) == [{"gen": 5, "width": 16}, {"gen": 4, "width": 8}]
    assert suite.link_limit(text) == {"gen": 5, "width": 16, "limit_gb_per_s": pytest.approx(63.015, abs=1e-3)}
    assert suite.link_limit(text, gpu=1)["limit_gb_per_s"] == pytest.approx(15.754, abs=1e-3)
    # Columns found by name, whatever their order; no header: generation, then width.
    assert suite.parse_pcie_csv("pcie.link.width.max, pcie.link.gen.max\n16, 3\n") == [{"gen": 3, "width": 16}]
    assert suite.parse_pcie_csv("4, 16") == [{"gen": 4, "width": 16}]


@pytest.mark.parametrize(
    "text",
    [
        None,
        "",
        "pcie.link.gen.current, pcie.link.width.current\n[N/A], [N/A]\n",
        "pcie.link.gen.current, pcie.link.width.current\n[Not Supported], 16\n",
        "pcie.link.gen.current, pcie.link.width.current\n9, 16\n",  # a generation not yet known
    ],
)
def test_an_unreadable_link_is_unknown(suite, text):
    assert suite.link_limit(text)["limit_gb_per_s"] == "unknown"


def test_crop_boxes_lie_inside_the_image_and_repeat(suite):
    boxes, flips = suite.crop_boxes(500, 375, 500, seed=3)
    assert boxes.shape == (500, 4) and str(boxes.dtype) == "int32" and flips.shape == (500,)
    top, left, height, width = boxes.T
    assert (top >= 0).all() and (left >= 0).all() and (height > 0).all() and (width > 0).all()
    assert (top + height <= 375).all() and (left + width <= 500).all()
    area = height * width / (375 * 500)
    assert area.min() >= 0.079 and area.max() <= 1.0
    again, same_flips = suite.crop_boxes(500, 375, 500, seed=3)
    assert (again == boxes).all() and (same_flips == flips).all()
    assert 0 < flips.sum() < 500
