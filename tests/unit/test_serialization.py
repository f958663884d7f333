"""The payload's pickling keeps what a rank's traceback needs to show the user's own code."""

from __future__ import annotations

import pickle
import traceback
from pathlib import Path

from sparkgpu.rundir.serialization import client_sys_path, serialize_payload, unpack_payload


def test_a_function_pickled_by_value_keeps_its_file_so_rank_tracebacks_show_the_users_lines():
    def fails(shard):
        def parse():
            raise ValueError(f"shard {shard} has a corrupt header")

        return parse()

    payload = pickle.loads(serialize_payload(fails, (3,), {}, []))
    fn, args, _, _ = unpack_payload(payload)
    assert fn.__code__.co_filename == __file__
    assert fn.__code__.co_consts and all(
        c.co_filename == __file__ for c in fn.__code__.co_consts if hasattr(c, "co_filename")
    )  # nested functions too
    try:
        fn(*args)
    except ValueError as exc:
        text = "".join(traceback.format_exception(exc))
    assert 'raise ValueError(f"shard {shard} has a corrupt header")' in text
    assert f'File "{__file__}"' in text


def test_the_workers_import_sparkgpu_from_where_the_client_does_and_never_from_inside_it():
    import sparkgpu

    package = Path(sparkgpu.__file__).resolve().parent
    paths = client_sys_path()
    assert str(package.parent) in paths
    # sparkgpu's own folder on the path would shadow top-level modules by its sub-packages (ray, ...)
    assert not any(Path(p).resolve() == package or package in Path(p).resolve().parents for p in paths)
