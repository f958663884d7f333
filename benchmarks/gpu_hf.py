"""The Hugging Face stack on a GPU, inside sparkgpu jobs: gpu_suite.py's ``hf`` part.

Three ways users fine-tune, each a plain ``Trainer`` written as for GPUs (no ``use_cpu``, no
resume code) in ``@distributed(gpus=1, max_restarts=1)`` on the local backend:

  * ``lora``: a PEFT LoRA adapter on a Llama built from a config, bf16
  * ``fsdp2``: the whole Llama through Accelerate's FSDP2 plugin (``fsdp="full_shard"``,
    ``fsdp_config={"fsdp_version": 2, ...}``), bf16
  * ``zero3``: the whole Llama through DeepSpeed ZeRO-3 (``deepspeed={...}``), bf16; skipped with
    the reason where DeepSpeed is not installed

Each runs twice: uninterrupted, and with its rank killed (SIGKILL) at the step after a sealed
checkpoint, the next attempt resuming by itself. Recorded per mode: where the model trained
(``cuda:0``), the world size the Trainer saw, what wrapped the model, the step the restart
resumed from, the time from the kill to the end of the first resumed step, and whether the
loss of every step and the final trainable weights are bitwise equal to the uninterrupted run
(deterministic algorithms where torch has them, warning where it has not; eager attention). The GPU is one: FSDP's and
ZeRO's resharding across ranks needs more than one and is not measured here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from common import method

MODES = ("lora", "fsdp2", "zero3")
VOCAB = 32000


def llama(hidden: int, layers: int, seq: int, attention: str):
    """A Llama of ``hidden`` x ``layers`` from a config (no hub), seeded: the same weights each call.
    Also the sft part's model (gpu_suite.py)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=seq,
        use_cache=False,
        attn_implementation=attention,
    )
    return LlamaForCausalLM(config)


class Samples:
    """A map-style dataset of token sequences, the same on every run."""

    def __init__(self, count: int, seq: int):
        self.count, self.seq = count, seq

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict:
        import torch

        ids = torch.randint(3, VOCAB, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def _arguments(mode: str, steps: int, save_steps: int, batch: int):
    from transformers import TrainingArguments

    extra: dict = {}
    if mode == "fsdp2":
        extra = {
            "fsdp": "full_shard",
            "fsdp_config": {
                "fsdp_version": 2,
                "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                "state_dict_type": "SHARDED_STATE_DICT",
            },
        }
    elif mode == "zero3":
        extra = {
            "deepspeed": {
                "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
                "bf16": {"enabled": "auto"},
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "train_batch_size": "auto",
                "gradient_clipping": "auto",
                "zero_allow_untested_optimizer": True,  # the Trainer's own (fused) AdamW
            }
        }
    return TrainingArguments(
        output_dir="out",
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=1e-4,
        save_steps=save_steps,
        logging_steps=steps,
        bf16=True,
        seed=7,
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **extra,
    )


def finetune(mode: str, folder: str, steps: int, save_steps: int, kill_step: int, size: dict) -> dict:
    """One rank of a job: a plain Trainer as written for GPUs, plus the benchmark's recording
    (a forward hook for each step's loss, and a callback that kills the rank once)."""
    import signal

    import torch
    from transformers import Trainer, TrainerCallback

    from sparkgpu import runtime
    from sparkgpu.train import sealed_files

    attempt, rank = runtime.attempt(), runtime.get_global_rank()
    # TrainingArguments(full_determinism=True) without its error for an op torch has no
    # deterministic kernel for: such an op warns, and the bitwise comparison tells.
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    timeline = Path(folder) / "timeline.jsonl"

    def record(event: str, **facts) -> None:
        with open(timeline, "a") as f:
            f.write(json.dumps({"event": event, "time": time.time(), "attempt": attempt, "rank": rank, **facts}) + "\n")

    model = llama(size["hidden"], size["layers"], size["seq"], attention="eager")
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        model = get_peft_model(model, lora)
    losses: list[str] = []

    def keep_loss(_module, _inputs, output) -> None:
        if torch.is_grad_enabled() and getattr(output, "loss", None) is not None:
            losses.append(float(output.loss.detach().float()).hex())

    model.register_forward_hook(keep_loss)

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            record("train_begin", step=state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            record("step", step=state.global_step, loss=losses[-1] if losses else None)
            if attempt == 0 and kill_step and state.global_step == kill_step + 1:
                folder = Path(runtime.checkpoint_dir(), sealed_files.TRAINER_FOLDER, f"checkpoint-{kill_step}")
                sealed = folder / sealed_files.SEALED_MARKER
                while not sealed.exists():  # the next attempt must find it
                    time.sleep(0.01)
                record("killed", step=state.global_step)
                os.kill(os.getpid(), signal.SIGKILL)

    samples = Samples(steps * size["batch"] + size["batch"], size["seq"])
    args = _arguments(mode, steps, save_steps, size["batch"])
    trainer = Trainer(model=model, args=args, train_dataset=samples, callbacks=[Recorder()])
    trainer.train()  # resumes by itself in a restarted attempt
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # gathered under FSDP and ZeRO-3
    digest = hashlib.sha256()
    for name in sorted(state or {}):
        if mode != "lora" or "lora_" in name:  # the adapter is what LoRA trains
            digest.update(name.encode())
            digest.update(state[name].detach().float().cpu().numpy().tobytes())
    parameter = next(trainer.model.parameters())
    return {
        "device": str(parameter.device),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "world_size": trainer.args.world_size,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "wrapped": type(trainer.model_wrapped).__name__,
        "global_step": trainer.state.global_step,
        "weights_sha256": digest.hexdigest() if state else None,
    }


def _run(mode: str, work: Path, size: dict, kill_step: int, gpu_type: str | None) -> dict:
    from sparkgpu import distributed
    from sparkgpu.config import settings

    folder = work / f"{mode}-{'killed' if kill_step else 'whole'}"
    folder.mkdir(parents=True)
    here = os.getcwd()
    os.chdir(folder)  # the Trainer's output_dir="out": one per run
    started = time.time()
    try:
        job = distributed(gpus=1, gpu_type=gpu_type, max_restarts=1, log_ranks=None)(finetune)
        (result,) = job.distributed(mode, str(folder), size["steps"], size["save_steps"], kill_step, size)
    finally:
        os.chdir(here)
    events = [json.loads(line) for line in (folder / "timeline.jsonl").read_text().splitlines()]
    steps: dict[int, str] = {}
    for event in events:
        if event["event"] == "step":
            steps[event["step"]] = event["loss"]  # the resumed attempt's, where a step ran twice
    run_dir = settings().staging_root / job.last_job_id
    state = json.loads((run_dir / "state.json").read_text())
    failures = []  # what each failed attempt's processes said last, for the record
    for attempt in state["attempts"]:
        if attempt.get("status") == "failed":
            logs = sorted((run_dir / "attempts" / str(attempt["attempt"]) / "logs").glob("*.log"))
            tails = {log.name: log.read_text(errors="replace")[-2500:] for log in logs}
            failures.append({"attempt": attempt["attempt"], "cause": attempt.get("cause"), "logs": tails})
    result.update(
        failures=failures,
        seconds=time.time() - started,
        attempts=len(state["attempts"]),
        losses=[steps[s] for s in sorted(steps)],
        events=events,
    )
    shutil.rmtree(folder / "out", ignore_errors=True)
    return result


def measure_mode(mode: str, work: Path, size: dict, gpu_type: str | None = None) -> dict:
    """One mode, uninterrupted and killed; the figures and checks of gpu-hf.json. ``gpu_type``
    "cpu" runs it on a CPU rank (a check of this code where no GPU is)."""
    if mode == "zero3":
        try:
            import deepspeed  # noqa: F401
        except ImportError as exc:
            return {"skipped": f"DeepSpeed is not installed here ({exc})"}
    whole = _run(mode, work, size, 0, gpu_type)
    killed = _run(mode, work, size, size["kill_step"], gpu_type)
    events = killed.pop("events")
    whole.pop("events")
    expected = {"uninterrupted": (whole, 1), "killed": (killed, 2)}
    unexpected = {name: run["failures"] for name, (run, n) in expected.items() if run["attempts"] != n}
    if unexpected or not any(e["event"] == "killed" for e in events):
        return {"error": "a run did not go as planned (attempts or the kill)", "failures": unexpected}
    kill = next(e for e in events if e["event"] == "killed")
    resumed = [e for e in events if e["attempt"] > 0]
    begin = next(e for e in resumed if e["event"] == "train_begin")
    first = next(e for e in resumed if e["event"] == "step")
    losses_equal = killed["losses"] == whole["losses"]
    weights_equal = killed["weights_sha256"] == whole["weights_sha256"]
    figures = {
        "device": killed["device"],
        "cuda_device": killed["cuda_device"],
        "world_size": killed["world_size"],
        "distributed_type": killed["distributed_type"],
        "wrapped": killed["wrapped"],
        "attempts": killed["attempts"],
        "resumed_from_step": begin["step"],
        "kill_to_first_resumed_step_s": first["time"] - kill["time"],
        "losses_bitwise_equal": losses_equal,
        "steps": len(killed["losses"]),
        "weights_bitwise_equal": weights_equal,
        "job_seconds": {"whole": whole["seconds"], "killed": killed["seconds"]},
        "summary": (
            f"{killed['device']} {killed['wrapped']}, resumed from step {begin['step']} "
            f"{first['time'] - kill['time']:.1f} s after the kill; losses "
            f"{'equal' if losses_equal else 'DIFFER'}, weights {'equal' if weights_equal else 'DIFFER'}"
        ),
    }
    checks = {
        "trained on cuda": killed["device"].startswith("cuda") or gpu_type == "cpu",
        "two attempts": killed["attempts"] == 2,
        "resumed from the sealed checkpoint": begin["step"] == size["kill_step"],
        "every step ran": len(killed["losses"]) == size["steps"] == killed["global_step"],
    }
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        figures["error"] = "check failed: " + ", ".join(failed)
    return figures


def part_hf(record, work: Path, sizes: dict, small: bool) -> None:
    """gpu_suite.py's ``hf`` part."""
    size = {key.removeprefix("hf_"): value for key, value in sizes.items() if key.startswith("hf_")}
    os.environ["SPARKGPU_HOME"] = str(work / "home")  # the jobs' run dirs and checkpoints
    os.environ["SPARKGPU_TRACKING"] = "0"  # MLflow is not what is measured here
    from sparkgpu.config import settings

    settings.cache_clear()
    record.data["config"] = {
        "model": f"LlamaForCausalLM, hidden {size['hidden']}, {size['layers']} layers, vocab {VOCAB}, bf16, eager attention",
        "steps": size["steps"],
        "save_steps": size["save_steps"],
        "kill_after_step": size["kill_step"],
        "batch_size": size["batch"],
        "seq_len": size["seq"],
        "job": "@distributed(gpus=1, max_restarts=1), local backend",
    }
    record.data["method"] = method(
        "from the kill (the rank's clock, just before SIGKILL) to the end of the first resumed step",
        startup="inside the timed span: failure detection, the restart, imports, the model, the restore",
        repeats=1,
        statistic="the one run",
        what="each mode run uninterrupted, then with its rank SIGKILLed at the step after the checkpoint of "
        "kill_after_step is sealed; the job restarts and the Trainer resumes by itself",
    )
    for mode in MODES:
        entry = record.measure(mode, lambda mode=mode: measure_mode(mode, work, size), needs_cuda=True)
        if "skipped" in entry:  # DeepSpeed missing: a skip with its reason, not a failure
            entry.update(status="skipped", reason=entry.pop("skipped"))
            record.write()
