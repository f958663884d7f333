"""What a rank forked from the agent shares with a shipped environment's overlay."""

import importlib.util
import sys
import types

from sparkgpu.launch.node.shipped_overlay import shared_with_overlay


def _tree(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _import(name, root):
    """Imports ``name`` (and its parents) from ``root`` into a module table of its own."""
    modules: dict[str, types.ModuleType] = {}
    parts = name.split(".")
    for depth in range(1, len(parts) + 1):
        dotted = ".".join(parts[:depth])
        folder = root.joinpath(*parts[:depth])
        if (folder / "__init__.py").exists():
            spec = importlib.util.spec_from_file_location(
                dotted, folder / "__init__.py", submodule_search_locations=[str(folder)]
            )
        else:
            spec = importlib.util.spec_from_file_location(dotted, folder.with_suffix(".py"))
        module = importlib.util.module_from_spec(spec)
        modules[dotted] = module
    return modules


FILES = {"lib/__init__.py": "", "lib/core.py": "X = 1\n", "lib/later.py": "Y = 2\n", "single.py": "Z = 3\n"}


def test_modules_the_overlay_holds_byte_for_byte_are_shared_and_rebased(tmp_path):
    agent, overlay = tmp_path / "agent", tmp_path / "overlay"
    _tree(agent, FILES)
    _tree(overlay, {**FILES, "lib/later.py": "Y = 'the overlay's'\n", "other.py": ""})
    modules = {**_import("lib.core", agent), **_import("single", agent), "json": sys.modules["json"]}
    shared = shared_with_overlay([str(overlay)], modules)
    assert shared is not None  # lib/later.py differs, but the agent never imported it
    assert set(shared.roots) == {"lib", "single"}  # other.py: the rank imports it from the overlay

    shared.rebase(modules)
    assert modules["lib"].__path__ == [str(overlay / "lib")]  # lib.later now comes from the overlay
    assert modules["lib.core"].__file__ == str(overlay / "lib" / "core.py")
    assert modules["lib.core"].__spec__.origin == str(overlay / "lib" / "core.py")
    assert modules["lib.core"].__loader__.path == str(overlay / "lib" / "core.py")
    assert modules["single"].__file__ == str(overlay / "single.py")
    assert modules["json"].__file__ == sys.modules["json"].__file__  # not the overlay's: untouched


def test_an_imported_module_with_other_bytes_in_the_overlay_is_not_shared(tmp_path):
    agent, overlay = tmp_path / "agent", tmp_path / "overlay"
    _tree(agent, FILES)
    _tree(overlay, {**FILES, "lib/core.py": "X = 2\n"})
    assert shared_with_overlay([str(overlay)], _import("lib.core", agent)) is None
    assert shared_with_overlay([str(overlay)], _import("single", agent)) is not None


def test_an_imported_module_missing_from_the_overlay_is_not_shared(tmp_path):
    agent, overlay = tmp_path / "agent", tmp_path / "overlay"
    _tree(agent, FILES)
    _tree(overlay, {"lib/__init__.py": ""})
    assert shared_with_overlay([str(overlay)], _import("lib.core", agent)) is None


def test_the_first_import_root_providing_a_name_is_the_one_compared(tmp_path):
    agent, first, second = tmp_path / "agent", tmp_path / "first", tmp_path / "second"
    _tree(agent, FILES)
    _tree(first, {"single.py": "Z = 'shadowing'\n"})
    _tree(second, FILES)
    assert shared_with_overlay([str(second), str(first)], _import("single", agent)) is not None
    assert shared_with_overlay([str(first), str(second)], _import("single", agent)) is None


def test_a_namespace_package_the_overlay_also_provides_is_not_shared(tmp_path):
    agent, overlay = tmp_path / "agent", tmp_path / "overlay"
    _tree(agent, {"ns/part.py": ""})
    _tree(overlay, {"ns/part.py": ""})
    namespace = types.ModuleType("ns")
    namespace.__path__ = [str(agent / "ns")]
    assert shared_with_overlay([str(overlay)], {"ns": namespace}) is None
