"""What installing sparkgpu brings: the core stays out of the Hugging Face stack's way."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import subprocess
import sys

from packaging.requirements import Requirement
from packaging.markers import default_environment

_ENV = default_environment()


def _core_requirements(distribution: str, extras: tuple[str, ...] = ()) -> list[Requirement]:
    """The requirements `pip install distribution[extras]` resolves directly, markers applied."""
    found = []
    for line in metadata.requires(distribution) or []:
        requirement = Requirement(line)
        if requirement.marker is None:
            found.append(requirement)
            continue
        if any(requirement.marker.evaluate({**_ENV, "extra": extra}) for extra in ("", *extras)):
            found.append(requirement)
    return found


def _closure(distribution: str, extras: tuple[str, ...] = ()) -> dict[str, Requirement]:
    """Every distribution installing sparkgpu[extras] pulls in, with the requirement that named it."""
    seen: dict[str, Requirement] = {}
    pending = [(distribution, extras)]
    while pending:
        name, wanted = pending.pop()
        for requirement in _core_requirements(name, wanted):
            key = re.sub(r"[-_.]+", "-", requirement.name).lower()
            if key in seen:
                continue
            seen[key] = requirement
            try:
                metadata.distribution(requirement.name)
            except metadata.PackageNotFoundError:
                continue
            pending.append((requirement.name, tuple(requirement.extras)))
    return seen


def test_the_core_pulls_in_neither_transformers_nor_mosaic_streaming():
    closure = _closure("sparkgpu")
    assert "transformers" not in closure, closure.get("transformers")
    assert "mosaicml-streaming" not in closure
    # The cloud SDKs Mosaic Streaming brought along (oci alone is about 500 MB) are not shipped either.
    assert "oci" not in closure and "azure-storage-blob" not in closure and "paramiko" not in closure


def test_the_hf_extra_brings_the_current_stack_without_a_conflict():
    closure = _closure("sparkgpu", ("hf",))
    for name in ("transformers", "peft", "accelerate", "trl", "datasets", "tokenizers"):
        assert name in closure, name
    assert not any(Requirement(str(r)).specifier.contains("4.99") for r in [closure["transformers"]])
    # Every requirement of the installed stack holds, except the declared pins of Mosaic Streaming,
    # which the test environment installs without them (interop tests only; see the Makefile).
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    problems = [line for line in check.stdout.splitlines() if line and not line.startswith("mosaicml-streaming ")]
    assert problems == [], check.stdout
