"""The table and files datasets in torch DataLoader workers: the same batches, and an exact position."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sparkgpu import data
from sparkgpu.errors import ConfigurationError
from tests.unit.test_data_table import dv_table, ids_of


def _ids(batches) -> list[int]:
    return [i for batch in batches for i in batch["id"].tolist()]


def test_table_loader_in_two_workers_keeps_the_position_exact_across_epochs(tmp_path):
    uri, gone = dv_table(tmp_path)

    def open_(rank=0, world_size=1):
        return data.table_dataset(
            uri,
            filter="id >= 20",
            batch_size=16,
            shuffle=True,
            seed=7,
            shuffle_block_size=100,
            rank=rank,
            world_size=world_size,
        )

    epoch0, epoch1 = ids_of(open_()), ids_of(open_())  # (the second: a fresh dataset, epoch 0 again)
    plain = open_()
    epochs = [ids_of(plain), ids_of(plain)]
    rows = open_()
    loader = rows.loader(num_workers=2)
    assert len(loader) == len(rows)
    iterator = iter(loader)
    head = _ids(next(iterator) for _ in range(7))
    state = rows.state_dict()
    del iterator  # stops the workers mid-epoch, as a crash would
    assert state["samples_consumed"] == 7 * 16 and state["epoch"] == 0
    again = open_()
    again.load_state_dict(json.loads(json.dumps(state)))
    resumed = again.loader(num_workers=2)
    assert head + _ids(resumed) == epochs[0] == epoch0
    assert _ids(resumed) == epochs[1] != epoch1  # the loader moved the dataset to the next epoch
    # Two ranks, two workers each: disjoint, the same number of batches, every surviving row but the remainder.
    parts = [list(open_(rank, 2).loader(num_workers=2)) for rank in range(2)]
    assert len(parts[0]) == len(parts[1])
    seen = _ids(parts[0]) + _ids(parts[1])
    survivors = {i for i in range(600) if i not in gone and i >= 20}
    assert len(seen) == len(set(seen)) and set(seen) <= survivors and len(survivors) - len(seen) == len(survivors) % 2


def test_files_loader_in_two_workers_resumes_exactly(tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    for i in range(21):
        (root / f"img{i:02d}.jpg").write_bytes(b"x" * i)
    files = data.files_dataset(str(root), "*.jpg", shuffle=True, seed=1, rank=0, world_size=1)
    everything = [name for name, _ in files]
    files = data.files_dataset(str(root), "*.jpg", shuffle=True, seed=1, rank=0, world_size=1)
    iterator = iter(files.loader(num_workers=2))
    head = [next(iterator)[0] for _ in range(9)]
    state = files.state_dict()
    del iterator
    again = data.files_dataset(str(root), "*.jpg", shuffle=True, seed=1, rank=0, world_size=1)
    again.load_state_dict(state)
    assert head + [name for name, _ in again.loader(num_workers=2)] == everything


def test_loader_refuses_options_the_position_cannot_follow(tmp_path):
    root = tmp_path / "f"
    root.mkdir()
    (root / "a.bin").write_bytes(b"a")
    files = data.files_dataset(str(root), rank=0, world_size=1)
    with pytest.raises(ConfigurationError, match="persistent_workers"):
        files.loader(num_workers=2, persistent_workers=True)
    with pytest.raises(ConfigurationError, match="batch_size= is set on the dataset"):
        files.loader(batch_size=4)


_TRAINER = textwrap.dedent("""
    import json, os, sys
    from sparkgpu import data
    uri, saved, out = sys.argv[1:4]
    rows = data.table_dataset(uri, filter="id >= 20", batch_size=8, shuffle=True, seed=2, rank=0, world_size=1)
    if os.path.exists(saved):
        rows.load_state_dict(json.load(open(saved)))
    with open(out, "a") as log:
        for batch in rows.loader(num_workers=2):
            log.write(json.dumps(batch["id"].tolist()) + "\\n"); log.flush()   # the step's work...
            with open(saved + ".tmp", "w") as f:
                json.dump(rows.state_dict(), f)
            os.replace(saved + ".tmp", saved)                                    # ...then its checkpoint
""")


def test_kill_9_mid_epoch_with_workers_resumes_exactly(tmp_path):
    uri, _ = dv_table(tmp_path)
    expected = ids_of(
        data.table_dataset(uri, filter="id >= 20", batch_size=8, shuffle=True, seed=2, rank=0, world_size=1)
    )
    script, saved, out = tmp_path / "train.py", tmp_path / "state.json", tmp_path / "steps.jsonl"
    script.write_text(_TRAINER)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    child = subprocess.Popen([sys.executable, str(script), uri, str(saved), str(out)], env=env, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 10):
        assert child.poll() is None, "the trainer ended before it was killed"
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)  # the trainer and its DataLoader workers
    child.wait()
    steps = [json.loads(line) for line in out.read_text().splitlines()]
    done = json.loads(saved.read_text())["samples_consumed"] // 8
    assert 10 <= done < len(expected) // 8
    # A step logged after its checkpoint was written is kept; one logged without it is redone.
    subprocess.run([sys.executable, str(script), uri, str(saved), str(out)], env=env, check=True, timeout=300)
    replayed = [json.loads(line) for line in out.read_text().splitlines()]
    assert [i for step in replayed[:done] + replayed[len(steps) :] for i in step] == expected
