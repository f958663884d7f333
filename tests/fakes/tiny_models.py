"""Tiny models built in a test, no downloads: a tabular MLP, a small torch transformer, a Llama with its tokenizer, a LoRA adapter."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "what is two plus two",
    "the answer is four",
    "spark scores tables on gpus",
]


def tabular_model(features: int = 4, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(features, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1), torch.nn.Sigmoid())


def tiny_transformer(vocab_size: int = 16, width: int = 16, seed: int = 0):
    """A 1-layer transformer encoder over ``vocab_size`` tokens with a token-level head, pure torch (no download, no HF)."""
    import torch

    torch.manual_seed(seed)

    class TinyTransformer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab_size, width)
            layer = torch.nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=2 * width, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
            self.head = torch.nn.Linear(width, vocab_size)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens)))

    return TinyTransformer()


def tokenizer():
    """A word-level tokenizer over :data:`CORPUS`, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def tiny_llama(vocab_size: int = 32, seed: int = 0, max_positions: int = 32, **config):
    """A 2-layer Llama of hidden size 32, built from its config (``config``: more of its fields)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        **config,
    )
    return LlamaForCausalLM(config)


def llama_dir(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama of hidden size 32 with its tokenizer, saved with ``save_pretrained``."""
    tok = tokenizer()
    model = tiny_llama(
        len(tok),
        seed,
        max_positions=128,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def adapter_dir(base: Path, path: Path, seed: int = 1) -> Path:
    """A LoRA adapter on :func:`llama_dir`'s model with non-zero weights (so it changes the output)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    peft_model.save_pretrained(path)
    return path
