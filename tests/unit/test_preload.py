"""Which libraries a node's agent imports for a job's ranks before it forks them."""

import sys
import threading

import transformers
from transformers import PretrainedConfig

from sparkgpu.launch.rundir.preload import fork_hazard, modules_to_preload, preload, preload_before_fork


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
