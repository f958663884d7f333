"""Tune a LoRA fine-tune with ``sparkgpu.sweep``: Optuna samples, prunes and keeps the study;
every trial is a 2-rank sparkgpu job running a plain Hugging Face ``Trainer``.

What a user of the Hugging Face stack writes:

1. the trial is a function that builds its ``Trainer`` from the trial's parameters (``lr`` and
   the LoRA rank ``r`` arrive as keyword arguments; ``runtime.trial()`` returns them all), trains,
   and returns ``trainer.evaluate()["eval_loss"]`` with the model and its tokenizer;
2. a ``TrainerCallback`` reports each evaluation with ``runtime.report(step, eval_loss)`` and stops
   training when it returns True: the sweep's pruner (successive halving) decided, and every rank
   stops at the same evaluation, so no rank is left waiting in a collective;
3. the sweep is one MLflow parent run with a child run per trial, and the best trial's adapter is
   registered as ``main.demo.lora_sweep``.

No hub: a tiny Llama built from a config learns a counting task (each token is the one before
plus a stride). Run: ``.venv/bin/python examples/sweep_lora.py [--trials 6] [--steps 24]``
(a few minutes on a 2-core laptop; each trial runs its 2 ranks on CPU with gloo).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

VOCAB, SEQ, STRIDE = 32, 16, 3


def sequences(count: int, seed: int) -> list[list[int]]:
    """Rows of ``SEQ`` token ids where each id is the one before plus ``STRIDE`` (mod ``VOCAB``)."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        first = rng.randrange(VOCAB)
        rows.append([(first + STRIDE * i) % VOCAB for i in range(SEQ)])
    return rows


def build_tokenizer():
    """A fast tokenizer of the task's ``VOCAB`` ids (``t0`` ... ``t31``), what users load from the hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", pad_token="t0")


def tune(steps: int, output_dir: str, lr: float = 1e-3, r: int = 4):
    """One trial, written as for GPUs: a plain Trainer on a LoRA model, no device settings."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from sparkgpu import runtime

    class Rows(torch.utils.data.Dataset):
        def __init__(self, rows):
            self.rows = [torch.tensor(row) for row in rows]

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {"input_ids": self.rows[i], "labels": self.rows[i]}

    class ReportToSweep(TrainerCallback):
        """Every rank evaluates at the same step; rank 0's loss goes to the sweep's pruner."""

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            if runtime.report(state.global_step, float(metrics["eval_loss"])):
                control.should_training_stop = True  # pruned: every rank stops here

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
    )
    model = get_peft_model(
        LlamaForCausalLM(config), LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"])
    )
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=16,
        learning_rate=lr,
        lr_scheduler_type="constant",
        eval_strategy="steps",
        eval_steps=max(1, steps // 4),  # four evaluations: the pruner's rungs
        save_strategy="no",
        report_to=[],
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Rows(sequences(256, seed=1)),
        eval_dataset=Rows(sequences(32, seed=2)),
        callbacks=[ReportToSweep()],
    )
    trainer.train()
    value = trainer.evaluate()["eval_loss"]
    return {"value": value, "model": trainer.model, "tokenizer": build_tokenizer()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--concurrent", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    options = parser.parse_args(argv)
    started = time.time()

    import optuna

    import sparkgpu
    from sparkgpu import registry

    work = tempfile.mkdtemp(prefix="sparkgpu-sweep-lora-")
    result = sparkgpu.sweep(
        tune,
        space={
            "lr": optuna.distributions.FloatDistribution(1e-4, 3e-2, log=True),
            "r": optuna.distributions.CategoricalDistribution([2, 4, 8]),
        },
        direction="minimize",
        sampler=optuna.samplers.TPESampler(seed=0),
        pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
        n_trials=options.trials,
        max_concurrent=options.concurrent,
        gpus=2,
        gpu_type="cpu",
        kwargs={"steps": options.steps, "output_dir": os.path.join(work, "trainer-out")},
        experiment="/sparkgpu/sweep-lora",
        register_best_as="main.demo.lora_sweep",
    )
    states: dict[str, int] = {}
    for trial in result.study.trials:
        states[trial.state.name] = states.get(trial.state.name, 0) + 1
        value = "-" if trial.value is None else f"{trial.value:.3f}"
        print(
            f"  trial {trial.number}: {trial.state.name:<8} lr={trial.params['lr']:.2e} r={trial.params['r']} loss={value}"
        )
    version = result.model_version.version
    best = registry.load(f"main.demo.lora_sweep/{version}")["model"]  # the adapter on its base model
    print()
    print(f"sparkgpu LoRA sweep example: done in {time.time() - started:.0f}s (sweep {result.sweep_id})")
    print(f"  trials by state: {', '.join(f'{k} {v}' for k, v in sorted(states.items()))}")
    print(f"  best: lr={result.best_params['lr']:.2e} r={result.best_params['r']} eval_loss={result.best_value:.3f}")
    print(f"  registered main.demo.lora_sweep version {version} ({type(best).__name__})")


if __name__ == "__main__":
    main()
