"""A model that training wrapped comes out of a job as the plain module, and is saved when its result cannot be.

The wrappers are the real ones: an Accelerator in bf16 on the CPU (what a Trainer or
SFTTrainer makes of a model with TRL's defaults), DDP over a gloo world of one, ``torch.compile``,
and a PEFT LoRA model, on a tiny Llama built from its config.
"""

from __future__ import annotations

import io
import pickle
import threading

import cloudpickle
import pytest
import torch

from tests.fakes.tiny_models import tokenizer as word_tokenizer

from sparkgpu.errors import ResultError, SerializationError
from sparkgpu.rundir.serialization import dump_result
from sparkgpu.train.trained_models import find_models, save_models, unwrap_model, unwrap_models
from tests.fakes import tiny_models


def tiny_llama(seed: int = 0):
    return tiny_models.tiny_llama(seed=seed)


@pytest.fixture
def bf16_accelerator():
    """Accelerate's mixed precision on the CPU, as a Trainer with ``bf16=True`` and ``use_cpu`` sets it up."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # A process-wide singleton: an earlier test of this worker (a Trainer's) may have set it up otherwise.
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    yield accelerator
    AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton: leave none behind


@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(model, expected: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


IDS = torch.tensor([[1, 5, 7, 9, 2]])


def test_a_bf16_prepared_model_pickles_once_unwrapped_with_its_weights(bf16_accelerator):
    model = tiny_llama()
    before = weights(model)
    prepared = bf16_accelerator.prepare(model)
    with pytest.raises(pickle.PicklingError, match="automatic mixed precision"):
        cloudpickle.dumps(prepared)  # what a rank's result met before

    returned = unwrap_models({"model": prepared, "tokenizer": word_tokenizer(), "steps": 3})

    assert returned["steps"] == 3 and hasattr(returned["tokenizer"], "save_pretrained")
    loaded = cloudpickle.loads(cloudpickle.dumps(returned))["model"]
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert_same_weights(loaded, before)
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


def test_a_ddp_module_unwraps_to_the_module_it_wraps(world_of_one):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = tiny_llama()
    ddp = DDP(model)
    returned = unwrap_models([ddp, {"inner": (ddp, "text")}])
    assert returned[0] is model and returned[1]["inner"][0] is model and returned[1]["inner"][1] == "text"


def test_a_ddp_module_of_a_bf16_prepared_model_unwraps_to_a_plain_model(world_of_one, bf16_accelerator):
    model = tiny_llama()
    before = weights(model)
    prepared = bf16_accelerator.prepare(model)  # in a world of one Accelerate wraps nothing but the forward
    from torch.nn.parallel import DistributedDataParallel as DDP

    plain = unwrap_model(DDP(prepared))
    assert plain is model and "_original_forward" not in vars(plain)
    assert_same_weights(cloudpickle.loads(cloudpickle.dumps(plain)), before)


def test_a_compiled_module_unwraps_to_its_original():
    model = tiny_llama()
    compiled = torch.compile(model)
    assert compiled is not model
    assert unwrap_model(compiled) is model
    assert unwrap_models({"model": compiled})["model"] is model


def test_a_peft_model_stays_a_peft_model(bf16_accelerator):
    import peft

    lora = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    before = weights(lora)
    plain = unwrap_model(bf16_accelerator.prepare(lora))
    assert isinstance(plain, peft.PeftModel) and plain is lora
    loaded = cloudpickle.loads(cloudpickle.dumps(plain))
    assert isinstance(loaded, peft.PeftModel)
    assert_same_weights(loaded, before)


def test_anything_but_a_wrapped_model_is_returned_as_it_is():
    model = tiny_llama()
    value = {"model": model, "losses": [1.0, 0.5], "nested": ({"a": 1},)}
    assert unwrap_models(value) is value
    assert unwrap_model(model) is model and unwrap_model("text") == "text"
    cyclic: list = [model]
    cyclic.append(cyclic)
    assert unwrap_models(cyclic) is cyclic


def test_the_models_of_a_result_are_saved_where_they_load(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llama, head = tiny_llama(), torch.nn.Linear(4, 2)
    result = {"model": llama, "tokenizer": word_tokenizer(), "extra": [head], "lock": threading.Lock()}
    assert set(find_models(result)) == {"model", "extra.0"}

    saved = save_models(result, tmp_path / "models")

    assert set(saved) == {"model", "extra.0"}
    loaded = AutoModelForCausalLM.from_pretrained(saved["model"])
    assert_same_weights(loaded, weights(llama))
    assert AutoTokenizer.from_pretrained(saved["model"])("the cat")["input_ids"]  # saved beside its model
    fresh = torch.nn.Linear(4, 2)
    fresh.load_state_dict(torch.load(saved["extra.0"]))
    assert_same_weights(fresh, weights(head))


def test_a_result_that_does_not_pickle_names_the_item_that_does_not():
    with pytest.raises(SerializationError, match=r"its item \['out'\]\['lock'\] \(_thread\.lock\)"):
        dump_result({"model": torch.nn.Linear(2, 2), "out": {"lock": threading.Lock()}}, io.BytesIO(), rank=1)


def test_a_result_error_survives_pickling_with_where_its_models_went():
    error = ResultError("rank 0's function returned, but ...", {"model": "attempts/0/results/rank-0.models/model"})
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is ResultError and isinstance(copy, SerializationError)
    assert str(copy) == str(error) and copy.saved == error.saved
