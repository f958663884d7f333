"""Batched text generation on an executor: prompts in, completions out, one seed per row.

Prompts of a chunk are sorted by length before they are cut into batches, so each batch pads
to its own longest prompt rather than the chunk's; padding is on the left, as decoder-only
models need. Sampling draws each row's tokens from its own ``torch.Generator`` seeded from
the row's key, so a row gets the same completion whichever batch, task or attempt runs it.
Greedy decoding (``do_sample=False``) is plain ``model.generate``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Sequence

__all__ = ["GenerationConfig", "row_seed", "generate_completions"]


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How completions are generated.

    Attributes:
        max_new_tokens: Tokens generated per prompt at most.
        do_sample: Sample (``True``) or decode greedily.
        temperature: Softmax temperature when sampling.
        top_k: Keep the ``top_k`` likeliest tokens when sampling (0: all).
        top_p: Keep the smallest set of tokens whose probability reaches ``top_p`` (1.0: all).
        seed: Base seed; each row's seed is derived from it and the row's key.
        batch_size: Prompts per ``generate`` call.
        max_prompt_tokens: Prompts longer than this are cut from the left (``None``: never).
        extra: More ``generate`` keyword arguments (``repetition_penalty``, ...).
    """

    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 16
    max_prompt_tokens: int | None = None
    extra: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        from sparkgpu.errors import ConfigurationError

        if self.max_new_tokens < 1:
            raise ConfigurationError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        if self.batch_size < 1:
            raise ConfigurationError(f"batch_size={self.batch_size} must be at least 1")
        if self.do_sample and self.temperature <= 0:
            raise ConfigurationError(f"temperature={self.temperature} must be > 0 when sampling")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigurationError(f"top_p={self.top_p} must be in (0, 1]")


def row_seed(base: int, key: Any) -> int:
    """A 63-bit seed for one row: the same for the same base seed and key, wherever it runs."""
    digest = hashlib.blake2b(f"{base}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class _PerRowSampler:
    """A logits processor that samples each row from its own generator.

    ``generate`` runs greedily around it: this processor leaves only the sampled token
    finite, so the greedy pick is the sample, and temperature, top-k and top-p are applied
    here rather than by ``generate``'s warpers (which draw from one global generator).
    """

    def __init__(self, generators, config: GenerationConfig):
        self.generators = generators
        self.config = config

    def __call__(self, input_ids, scores):
        import torch

        config = self.config
        logits = scores.float() / config.temperature
        if config.top_k and config.top_k < logits.shape[-1]:
            kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if config.top_p < 1.0:
            ordered, order = torch.sort(logits, descending=True, dim=-1)
            cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
            drop = cumulative - torch.softmax(ordered, dim=-1) >= config.top_p
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        probs = torch.softmax(logits, dim=-1).cpu()
        chosen = [
            int(torch.multinomial(probs[i], 1, generator=self.generators[i]).item()) for i in range(probs.shape[0])
        ]
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(len(chosen)), torch.tensor(chosen, device=scores.device)] = 0.0
        return out


def generate_completions(
    model, tokenizer, prompts: Sequence[str], keys: Sequence[Any], config: GenerationConfig, device: str = "cpu"
) -> list[str]:
    """Completions of ``prompts``, in their order.

    Args:
        model: A causal LM with ``generate`` (a transformers model or a PEFT model around one).
        tokenizer: Its tokenizer; a pad token is taken from EOS when it has none.
        prompts: Prompt texts.
        keys: One key per prompt; sampled rows are seeded from ``config.seed`` and it.
        config: Generation settings.
        device: Where the model is.

    Returns:
        The generated text of each prompt, without the prompt.
    """
    import torch
    from transformers import LogitsProcessorList

    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    encoded = tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
    if config.max_prompt_tokens:
        encoded = [ids[-config.max_prompt_tokens :] for ids in encoded]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    completions: list[str] = [""] * len(encoded)
    pad = tokenizer.pad_token_id
    for start in range(0, len(order), config.batch_size):
        rows = order[start : start + config.batch_size]
        width = max(len(encoded[i]) for i in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for j, i in enumerate(rows):
            ids = encoded[i]
            if ids:
                input_ids[j, width - len(ids) :] = torch.tensor(ids)
                attention[j, width - len(ids) :] = 1
        options: dict[str, Any] = dict(config.extra)
        if config.do_sample:
            generators = [torch.Generator().manual_seed(row_seed(config.seed, keys[i])) for i in rows]
            options["logits_processor"] = LogitsProcessorList([_PerRowSampler(generators, config)])
        with torch.inference_mode():
            output = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                max_new_tokens=config.max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                **options,
            )
        new_tokens = output[:, width:].cpu()
        for j, i in enumerate(rows):
            completions[i] = tokenizer.decode(new_tokens[j], skip_special_tokens=True)
    return completions


def vllm_usable() -> bool:
    """vLLM is installed and a CUDA device is there (vLLM needs one)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def vllm_sampling(config: GenerationConfig, seed: int):
    """vLLM ``SamplingParams`` of one row: greedy is temperature 0; a sampled row carries its own seed."""
    from vllm import SamplingParams

    if not config.do_sample:
        return SamplingParams(max_tokens=config.max_new_tokens, temperature=0.0)
    return SamplingParams(
        max_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k if config.top_k else -1,
        seed=seed,
    )


def generate_with_vllm(
    llm, prompts: Sequence[str], keys: Sequence[Any], config: GenerationConfig, lora_request=None
) -> list[str]:
    """Completions of ``prompts`` by a ``vllm.LLM`` (its scheduler batches them), one seed per row."""
    params = [vllm_sampling(config, row_seed(config.seed, key)) for key in keys]
    outputs = llm.generate(list(prompts), params, lora_request=lora_request, use_tqdm=False)
    return [output.outputs[0].text for output in outputs]
