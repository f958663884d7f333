"""The base model the registry stores beside a PEFT adapter is the base, weight for weight."""

from __future__ import annotations

import torch


def test_the_stored_base_has_the_base_models_own_names_and_weights():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparkgpu.tracking._transformers import base_state_dict

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    base = LlamaForCausalLM(config)
    original = {key: value.clone() for key, value in base.state_dict().items()}
    # LoRA layers wrap q_proj/v_proj; modules_to_save keeps a trained copy of lm_head beside the original.
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(1.0)  # "trained": the adapter and the saved lm_head copy move
    stored = base_state_dict(model)
    assert sorted(stored) == sorted(original)
    for key, value in original.items():
        assert torch.equal(stored[key], value), key
