"""Fine-tune a causal LM with LoRA from a Spark table of chats, on a laptop, end to end.

What a user of the Hugging Face stack writes, run the sparkgpu way:

1. a Spark DataFrame of chat ``messages`` is tokenized on the executors with the user's tokenizer
   and chat template (``sparkgpu.data.tokenize``): token ids plus a loss mask on the assistant's turns;
2. ``spark.gpu.train`` runs a plain ``transformers.Trainer`` with a PEFT LoRA model on 2 CPU ranks,
   its ``train_dataset`` the packed SFT loader (``sparkgpu.data.sft_dataset``) — no ``use_cpu``, no
   resume code. Rank 1 kills itself (SIGKILL) in the first attempt; the job restarts and the
   Trainer resumes from its newest sealed checkpoint by itself;
3. the adapter is registered as ``main.demo.chat`` (its base model stored beside it) with the
   alias ``champion``, and loads back by that alias as a model that generates;
4. ``spark.gpu.generate`` answers a held-out DataFrame of questions with the registered adapter.

No hub: the model is built from a ``LlamaConfig`` and the tokenizer with the ``tokenizers``
library, here. Run: ``.venv/bin/python examples/finetune_llm.py`` (about a minute or two).
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time

# Questions and answers the tiny model learns: "what color is the sun" -> "the sun is yellow".
THINGS = {
    "sun": "yellow",
    "sky": "blue",
    "grass": "green",
    "snow": "white",
    "night": "black",
    "rose": "red",
    "orange": "orange",
    "plum": "purple",
}
COLORS = sorted(set(THINGS.values()))
WORDS = ["what", "color", "is", "the", "tell", "me", "of", "please", *THINGS, *COLORS]
# ChatML with the assistant's turns marked, so the loss mask is the template's own.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
KILL_AT_STEP = 24


def build_tokenizer(folder: str):
    """A word-level fast tokenizer with a chat template, saved to ``folder`` (what users load from the hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "<|im_start|>", "<|im_end|>", "\n"]
    vocab = {token: i for i, token in enumerate(specials + ["user", "assistant"] + sorted(set(WORDS)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.add_special_tokens(specials)
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        # As chat models do, a turn's end is the end of a generation.
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer


def question(thing: str, rng: random.Random) -> str:
    return rng.choice(
        ["what color is the {}", "tell me the color of the {}", "what is the color of the {} please"]
    ).format(thing)


def train(data_url: str, tokenizer_dir: str, output_dir: str, steps: int):
    """Written as for GPUs: a plain Trainer, a LoRA model, no resume code, no device settings."""
    import signal

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from sparkgpu import data, runtime

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    base = LlamaForCausalLM(config)
    lora = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], modules_to_save=["lm_head"]
    )
    model = get_peft_model(base, lora)
    # Rows of 64 tokens packed best-fit, labels only on the assistant's turns, each rank its own share.
    rows = data.sft_dataset(local=data_url, seq_len=64, batch_size=4, shuffle=True, seed=0)

    class KillRankOneOnce(TrainerCallback):
        """Stands in for a lost machine: rank 1 dies at a late step of the first attempt."""

        def on_step_end(self, args, state, control, **kwargs):
            if runtime.attempt() == 0 and runtime.get_global_rank() == 1 and state.global_step == KILL_AT_STEP:
                os.kill(os.getpid(), signal.SIGKILL)

    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        save_steps=10,
        logging_steps=5,
        report_to=[],
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[KillRankOneOnce()])
    trainer.train()
    if runtime.is_main_process():
        return {"model": trainer.model, "tokenizer": tokenizer}
    return None


def main() -> None:
    started = time.time()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from sparkgpu.testing.local_spark import local_session, workers_run_this_environment

    # The local executors are processes of this venv: only editable installs and this script travel.
    workers_run_this_environment()

    import sparkgpu  # noqa: F401 - attaches spark.gpu
    from sparkgpu import data, registry

    work = tempfile.mkdtemp(prefix="sparkgpu-finetune-")
    tokenizer_dir = os.path.join(work, "tokenizer")
    build_tokenizer(tokenizer_dir)

    print("starting a local Spark Connect server ...", flush=True)
    spark = local_session(cores=2)
    rng = random.Random(0)
    chats = [
        [
            {"role": "user", "content": question(thing, rng)},
            {"role": "assistant", "content": f"the {thing} is {color}"},
        ]
        for _ in range(60)
        for thing, color in THINGS.items()
    ]
    df = spark.createDataFrame([(chat,) for chat in chats], "messages array<struct<role: string, content: string>>")

    # 1. Tokenized on the executors, with the chat template's own assistant markers as the loss mask.
    tokens = data.tokenize(df, os.path.join(work, "chats-mds"), tokenizer=tokenizer_dir)
    print(f"tokenized {tokens.samples} chats into {tokens.url}", flush=True)

    # 2. Two ranks; rank 1 is killed at step KILL_AT_STEP and the job resumes by itself.
    spark.gpu.train(
        train,
        gpus=2,
        gpu_type="cpu",
        kwargs={
            "data_url": tokens.url,
            "tokenizer_dir": tokenizer_dir,
            "output_dir": os.path.join(work, "trainer-out"),
            "steps": 60,
        },
        experiment="/sparkgpu/finetune",
        register_as="main.demo.chat",
        max_restarts=1,
    )

    # 3. The adapter, registered with its base model, back by alias.
    version = registry.versions("main.demo.chat")[-1].version
    registry.set_alias("main.demo.chat", "champion", version)
    champion = registry.load("main.demo.chat@champion")
    print(f"registered main.demo.chat version {version} ({type(champion['model']).__name__}), alias champion")

    # 4. Answers for held-out questions, generated on the executors with the registered adapter.
    tokenizer = champion["tokenizer"]
    held_out = [(thing, question(thing, random.Random(7 + i))) for i, thing in enumerate(THINGS)]
    prompts = spark.createDataFrame(
        [
            (
                thing,
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
                ),
            )
            for thing, q in held_out
        ],
        "thing string, prompt string",
    )
    answers = spark.gpu.generate(
        prompts, "main.demo.chat@champion", gpus=1, gpu_type="cpu", generation={"max_new_tokens": 6}
    ).toPandas()
    correct = 0
    for thing, completion in zip(answers["thing"], answers["completion"]):
        print(f"  {thing:>7}: {completion}")
        correct += f"is {THINGS[thing]}" in completion
    print()
    print(f"sparkgpu fine-tuning example: done in {time.time() - started:.0f}s (job {spark.gpu.last_job_id})")
    print(f"  held-out answers with the right color: {correct} of {len(held_out)}")
    print(f"  run dir with every rank's log (the restart is in it): {spark.gpu.last_run_dir}")
    spark.stop()


if __name__ == "__main__":
    main()
