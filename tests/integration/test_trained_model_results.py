"""A job returns the model its SFTTrainer trained, with TRL's defaults, and a result that cannot be returned is not retrained.

Two gloo CPU ranks fine-tune a tiny Llama (built from a config, no hub) with ``SFTTrainer`` and
``SFTConfig``'s defaults: bf16, which a CPU rank trains in through Accelerate's autocast, and
which wraps the model's ``forward`` in a converter that refuses to be pickled. The function
returns ``{"model": trainer.model, "tokenizer": tok}`` as the fine-tuning guide writes it. Each
run of the function appends a line to a file, so the test counts the ranks' runs.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.integration.test_hf_trainer import VOCAB, tiny_llama, word_tokenizer

from sparkgpu import distributed
from sparkgpu.config import settings
from sparkgpu.errors import ResultError, SerializationError

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

WORLD, STEPS = 2, 2
IDS = [[3, 7, 11, 5, 9, 4]]


@pytest.fixture(autouse=True)
def _in_a_folder_of_its_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the Trainer writes output_dir="out" there


def fine_tune(runs_file: str, with_a_lock: bool = False):
    """SFTTrainer with SFTConfig's defaults; returns the model as the fine-tuning guide does."""
    import random
    import threading

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from sparkgpu import runtime

    with open(runs_file, "a") as f:
        f.write(json.dumps({"attempt": runtime.attempt(), "rank": runtime.get_global_rank()}) + "\n")
    rng = random.Random(0)
    texts = [" ".join(f"w{rng.randrange(VOCAB - 3)}" for _ in range(8)) for _ in range(16)]
    tok = word_tokenizer()
    config = SFTConfig(output_dir="out", max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-2)
    trainer = SFTTrainer(
        model=tiny_llama(), args=config, train_dataset=Dataset.from_dict({"text": texts}), processing_class=tok
    )
    trainer.train()
    with open(f"{runs_file}.trained", "a") as f:
        # Accelerate's fp32 converter is on the model's forward: what refused to pickle before.
        wrapped = "_original_forward" in vars(trainer.model)
        f.write(json.dumps({"bf16": trainer.args.bf16, "forward_wrapped": wrapped}) + "\n")
    returned = {"model": trainer.model, "tokenizer": tok}
    if with_a_lock:
        returned["lock"] = threading.Lock()
    return returned


def runs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def job_state(job_id: str) -> dict:
    return json.loads((settings().staging_root / job_id / "state.json").read_text())


def initial_weights() -> dict:
    return tiny_llama().state_dict()


def changed_by_training(model) -> bool:
    import torch

    start = initial_weights()
    return any(not torch.equal(v, start[k]) for k, v in model.state_dict().items())


@pytest.fixture
def tracked(monkeypatch):
    from sparkgpu.config import reset_settings

    monkeypatch.setenv("SPARKGPU_TRACKING", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    reset_settings()


def test_a_bf16_sft_trainer_returns_and_registers_its_model_without_a_restart(tmp_path, tracked):
    import torch
    from transformers import LlamaForCausalLM

    from sparkgpu import registry

    name = f"main.ml.sft_{time.time_ns()}"
    runs_file = tmp_path / "runs.jsonl"
    job = distributed(gpus=WORLD, gpu_type="cpu", max_restarts=1, register_as=name)(fine_tune)

    results = job.distributed(str(runs_file))

    trained = runs(Path(f"{runs_file}.trained"))
    assert len(trained) == WORLD and all(t["bf16"] and t["forward_wrapped"] for t in trained)
    model = results[0]["model"]
    assert type(model) is LlamaForCausalLM and "_original_forward" not in vars(model)
    assert changed_by_training(model)
    with torch.no_grad():
        logits = model(torch.tensor(IDS)).logits
    assert logits.shape == (1, len(IDS[0]), VOCAB) and logits.dtype == torch.float32
    state = job_state(job.last_job_id)
    assert state["restarts"] == 0 and len(state["attempts"]) == 1
    assert sorted((r["attempt"], r["rank"]) for r in runs(runs_file)) == [(0, 0), (0, 1)]

    loaded = registry.load(f"{name}/{job.last_model_version.version}")
    with torch.no_grad():
        assert torch.equal(loaded["model"](torch.tensor(IDS)).logits, logits)


def test_a_result_that_cannot_be_pickled_ends_the_job_at_once_with_its_model_saved(tmp_path, capfd):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    runs_file = tmp_path / "runs.jsonl"
    job = distributed(gpus=WORLD, gpu_type="cpu", max_restarts=1)(fine_tune)

    with pytest.raises(SerializationError) as raised:
        job.distributed(str(runs_file), with_a_lock=True)

    error = raised.value
    assert isinstance(error, ResultError)
    message = str(error)
    assert "its item ['lock'] (_thread.lock)" in message and "The job is not restarted" in message
    state = job_state(job.last_job_id)
    assert state["restarts"] == 0 and len(state["attempts"]) == 1
    assert sorted((r["attempt"], r["rank"]) for r in runs(runs_file)) == [(0, 0), (0, 1)]  # trained once
    assert "attempt 0 failed after its function returned" in capfd.readouterr().out

    saved = re.search(r"'model' at (\S+/rank-0\.models/model)", message)
    assert saved is not None, message
    folder = Path(job.last_run_dir) / saved.group(1)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert changed_by_training(model)  # the trained model, not the one the function started from
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        assert model(**tok("w1 w2 w3", return_tensors="pt")).logits.shape[-1] == VOCAB
