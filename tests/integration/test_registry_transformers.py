"""A PEFT model fine-tuned in a job registers with ``register_as`` and generates the same after loading.

A tiny Llama with a LoRA adapter trains on 2 CPU ranks; rank 0 returns ``{"model", "tokenizer"}``.
The registered adapter (base weights stored beside it), its merged weights, and an adapter whose
base is referenced by a local folder each load back by alias and generate, greedily, the tokens
the trained model generated inside the job.
"""

from __future__ import annotations

import time

import pytest

from sparkgpu import distributed

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

PROMPT, NEW_TOKENS = "w1 w2 w3", 8


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(60)} | {"<unk>": 60, "<s>": 61, "</s>": 62, "<pad>": 63}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def tiny_llama(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        bos_token_id=61,
        eos_token_id=62,
        pad_token_id=63,
    )
    return LlamaForCausalLM(config)


def with_lora(base):
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(base, config)


def greedy(model, tokenizer) -> list[int]:
    import torch

    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=63)
    return out[0].tolist()


def fine_tune(steps: int):
    """Trains the adapter with DDP; rank 0 returns the model and tokenizer, the others what it generates."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparkgpu import runtime

    tokenizer = tiny_tokenizer()
    model = with_lora(tiny_llama())
    ddp = DDP(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    text = [" ".join(f"w{(i * 7 + j) % 60}" for j in range(12)) for i in range(4)]
    batch = tokenizer(text[runtime.get_global_rank() :: 2], return_tensors="pt")
    for _ in range(steps):
        loss = ddp(**batch, labels=batch["input_ids"]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    if runtime.is_main_process():
        return {"model": model, "tokenizer": tokenizer}
    return greedy(model, tokenizer)


@pytest.fixture
def tracked(monkeypatch):
    from sparkgpu.config import reset_settings

    monkeypatch.setenv("SPARKGPU_TRACKING", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    reset_settings()


def test_a_lora_adapter_registered_from_a_job_loads_by_alias_and_generates_the_same(tracked):
    import peft
    from transformers import LlamaForCausalLM

    from sparkgpu import registry

    name = f"main.ml.chat_{time.time_ns()}"
    job = distributed(gpus=2, gpu_type="cpu", register_as=name)(fine_tune)
    returned, in_job = job.distributed(steps=5)
    version = job.last_model_version
    assert version.tags["sparkgpu.adapter.type"] == "LORA" and version.tags["sparkgpu.adapter.merged"] == "false"
    assert version.tags["sparkgpu.base_model.architecture"] == "LlamaForCausalLM"
    assert version.tags["sparkgpu.base_model.weights"] == "stored"
    assert "sparkgpu.base_model.name_or_path" in version.tags and version.tags["sparkgpu.job_id"] == job.last_job_id
    assert in_job != greedy(with_lora(tiny_llama()), tiny_tokenizer())  # training changed what it generates

    registry.set_alias(name, "champion", version.version)
    loaded = registry.load(f"{name}@champion")
    assert isinstance(loaded["model"], peft.PeftModel)
    assert greedy(loaded["model"], loaded["tokenizer"]) == in_job

    merged = registry.register(returned, name, merge=True, alias="merged")
    assert merged.tags["sparkgpu.adapter.merged"] == "true"
    loaded = registry.load(f"{name}@merged")
    assert type(loaded["model"]) is LlamaForCausalLM
    assert greedy(loaded["model"], loaded["tokenizer"]) == in_job
    assert isinstance(returned["model"], peft.PeftModel)  # merging worked on a copy


def test_an_adapter_on_a_local_base_folder_stores_only_the_adapter(tracked, tmp_path):
    import os

    import torch
    from transformers import LlamaForCausalLM

    from sparkgpu import registry

    tiny_llama(seed=3).save_pretrained(tmp_path / "base")
    torch.manual_seed(4)
    model = with_lora(LlamaForCausalLM.from_pretrained(tmp_path / "base"))
    tokenizer = tiny_tokenizer()
    name = f"main.ml.local_base_{time.time_ns()}"
    version = registry.register(
        {"model": model, "tokenizer": tokenizer}, name, base_model_path=str(tmp_path / "base"), alias="a"
    )
    assert version.tags["sparkgpu.base_model.weights"] == "referenced"
    assert version.tags["sparkgpu.base_model.name_or_path"] == str(tmp_path / "base")
    assert version.tags["sparkgpu.base_model.path"] == str(tmp_path / "base")
    files = [f for _, _, names in os.walk(version.source.removeprefix("file://")) for f in names]
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    loaded = registry.load(f"{name}@a")
    assert greedy(loaded["model"], loaded["tokenizer"]) == greedy(model, tokenizer)


def test_transformers_models_without_a_tokenizer_or_adapter_options_are_refused(tracked):
    from sparkgpu import registry
    from sparkgpu.errors import ConfigurationError

    name = f"main.ml.refused_{time.time_ns()}"
    with pytest.raises(ConfigurationError, match="needs its tokenizer"):
        registry.register(with_lora(tiny_llama()), name)
    with pytest.raises(ConfigurationError, match="are for PEFT models"):
        registry.register({"model": tiny_llama(), "tokenizer": tiny_tokenizer()}, name, merge=True)
    with pytest.raises(ConfigurationError, match="for transformers and PEFT models"):
        import torch

        registry.register(torch.nn.Linear(2, 1), name, merge=True)
