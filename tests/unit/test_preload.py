"""Which libraries a node's agent imports for a job's ranks before it forks them."""

import os
import sys
import threading

import transformers
from transformers import PretrainedConfig

from sparkgpu.launch.node.preload import fork_hazard, modules_to_preload, preload, preload_before_fork


def _helper():
    from trl import SFTConfig

    return SFTConfig


def _job():
    import json  # not a library an agent preloads

    from peft import LoraConfig
    from transformers import Trainer, TrainingArguments

    _helper()
    return json, LoraConfig, Trainer, TrainingArguments, PretrainedConfig


def test_the_imports_and_references_of_the_function_and_its_helpers_are_found_without_running_it():
    assert modules_to_preload(_job) == [
        ["peft", ["LoraConfig"]],
        ["transformers", ["Trainer", "TrainingArguments"]],
        ["transformers.configuration_utils", []],  # PretrainedConfig, a module-level reference
        ["trl", ["SFTConfig"]],  # in a helper of the same module
    ]
    assert modules_to_preload(lambda: transformers.__version__) == [["transformers", []]]

    def plain():
        import torch

        return torch.zeros(1)

    assert modules_to_preload(plain) == []


def test_a_job_wrapping_its_model_in_ddp_or_fsdp_gets_torch_dynamo_also_from_its_other_modules(tmp_path, monkeypatch):
    # A helper in another module of the caller's code (a project's package), as jobs are written.
    (tmp_path / "my_training_helpers.py").write_text(
        "import torch\n"
        "def wrap(model):\n"
        "    from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "    return DDP(model)\n"
        "def shard(model):\n"
        "    torch.distributed.fsdp.fully_shard(model)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from my_training_helpers import shard, wrap

    def ddp_job():
        return wrap(None)

    def fsdp_job():
        return shard(None)

    def plain():
        import torch

        return torch.zeros(1)

    assert modules_to_preload(ddp_job) == [["torch._dynamo", []]]
    assert modules_to_preload(fsdp_job) == [["torch._dynamo", []]]  # reached through ``torch``'s attributes
    assert modules_to_preload(plain) == []
    # An installed library's functions are not read: json's own code imports nothing preloadable
    # either way, but sparkgpu's and the standard library's are not the caller's code.
    import json

    from sparkgpu import runtime

    assert modules_to_preload(lambda: (json.dumps, runtime.get_rank)) == []


def test_a_job_function_of_an_installed_package_still_has_its_own_modules_helpers_read(tmp_path, monkeypatch):
    # A project installed as a wheel (into site-packages): its job function's helpers beside it
    # are read, as they were before other modules of the caller's code were.
    from sparkgpu.launch.node import preload as preload_module

    (tmp_path / "installed_project.py").write_text(
        "def helper():\n    from peft import LoraConfig\n    return LoraConfig\ndef job():\n    return helper()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(preload_module, "_library_roots", lambda: (os.path.join(str(tmp_path), ""),))
    from installed_project import job

    assert not preload_module._callers_code("installed_project")
    assert modules_to_preload(job) == [["peft", ["LoraConfig"]]]


def test_torch_dynamo_is_the_one_torch_module_an_agent_preloads():
    assert preload([["torch._dynamo", []], ["torch.cuda", []]]) == ["torch._dynamo"]
    assert "torch._dynamo" in sys.modules


def test_only_known_libraries_are_preloaded_and_a_failing_one_is_left_to_the_ranks():
    assert "this_module_does_not_exist" not in sys.modules
    assert preload([["json", []], ["transformers.no_such_module", []], ["transformers", ["__version__"]]]) == [
        "transformers"
    ]


def test_a_python_thread_in_the_agent_is_a_hazard_to_forking():
    assert "left-running" not in (fork_hazard() or "")
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="left-running")
    thread.start()
    try:
        assert "left-running" in fork_hazard()
        assert preload_before_fork([["transformers", []]]).startswith("after importing ['transformers'], ")
    finally:
        stop.set()
        thread.join()


class _RaisingProxy:
    def __getattribute__(self, name):
        raise RuntimeError(f"a proxy that resolves {name} remotely")


PROXY = _RaisingProxy()


def test_a_global_that_raises_on_attribute_access_is_passed_over():
    def uses_a_proxy():
        from transformers import Trainer

        return PROXY, Trainer

    assert modules_to_preload(uses_a_proxy) == [["transformers", ["Trainer"]]]
