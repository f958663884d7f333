"""Every loader's ``state_dict()`` keeps its checkpoint layout: the keys, their order and the
refusals of a state that is not its own, so checkpoints written by earlier versions still load."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkgpu import data
from sparkgpu.errors import ConfigurationError


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from streaming import MDSWriter

    root = tmp_path_factory.mktemp("layout")
    rng = np.random.default_rng(0)
    with MDSWriter(
        out=str(root / "sft"),
        columns={"input_ids": "ndarray:int32", "loss_mask": "ndarray:uint8"},
        size_limit=1 << 11,
    ) as writer:
        for _ in range(120):
            n = int(rng.integers(2, 40))
            writer.write({"input_ids": np.arange(n, dtype=np.int32) + 1, "loss_mask": np.ones(n, np.uint8)})
    with MDSWriter(out=str(root / "plain"), columns={"id": "int64", "x": "float32"}, size_limit=1 << 10) as writer:
        for i in range(120):
            writer.write({"id": i, "x": np.float32(i / 2)})
    table = root / "table"
    table.mkdir()
    pq.write_table(pa.table({"id": np.arange(50, dtype=np.int64)}), table / "part-0.parquet", row_group_size=16)
    files = root / "files"
    files.mkdir()
    for i in range(9):
        (files / f"f{i}.bin").write_bytes(b"x" * i)
    return {"plain": str(root / "plain"), "mds": str(root / "sft"), "table": str(table), "files": str(files)}


def _opened(folders, kind):
    one = dict(rank=0, world_size=1, shuffle=True, seed=3)
    if kind == "mds":
        return data.dataset(local=folders["plain"], batch_size=4, **one)
    if kind == "mixture":
        streams = [
            data.Stream(local=folders["plain"], proportion=0.5),
            data.Stream(local=folders["plain"], proportion=0.5),
        ]
        return data.dataset(streams=streams, epoch_size=60, batch_size=4, **one)
    if kind == "tokens":
        return data.token_dataset(local=folders["mds"], column="input_ids", seq_len=8, batch_size=2, eos_id=0, **one)
    if kind == "sft":
        return data.sft_dataset(local=folders["mds"], seq_len=32, batch_size=2, pad_id=0, **one)
    if kind == "table":
        return data.table_dataset(folders["table"], batch_size=4, **one)
    return data.files_dataset(folders["files"], "*.bin", **one)


LAYOUTS = {
    "mds": ["version", "epoch", "samples_consumed", "seed", "shuffle", "shuffle_block_size", "world_size",
            "batch_size", "num_samples", "dataset"],
    "mixture": ["version", "epoch", "samples_consumed", "seed", "shuffle", "shuffle_block_size", "counts", "datasets"],
    "tokens": ["version", "epoch", "blocks_consumed", "seed", "shuffle", "shuffle_block_size", "seq_len", "width",
               "num_tokens", "eos_id", "column", "dataset"],
    "sft": ["version", "epoch", "rows_consumed", "seed", "shuffle", "shuffle_block_size", "seq_len", "overflow",
            "pack_window", "world_size", "columns", "dataset"],
    "table": ["version", "epoch", "samples_consumed", "seed", "shuffle", "shuffle_block_size", "world_size",
              "batch_size", "num_samples", "dataset"],
    "files": ["version", "epoch", "samples_consumed", "seed", "shuffle", "world_size", "num_samples", "dataset"],
}  # fmt: skip
REFUSAL = {
    "mds": "not a loader state (expected a dict from MDSLoader.state_dict()",
    "mixture": "not a mixture state (expected a dict from MixtureLoader.state_dict()",
    "tokens": "not a token loader state (expected a dict from TokenLoader.state_dict()",
    "sft": "not an SFT loader state (expected a dict from SFTLoader.state_dict()",
    "table": "not a table dataset state (expected a dict from TableDataset.state_dict()",
    "files": "not a files dataset state (expected a dict from FilesDataset.state_dict()",
}
MISMATCH = {
    "mds": "this loader has seed=3; open the dataset with the same seed to resume",
    "mixture": "this mixture has seed=3; open the same streams with the same weights, seed and shuffle to resume",
    "tokens": "this loader has seed=3; open the dataset with the same seed to resume",
    "sft": "this loader has seed=3; open the dataset with the same seed to resume",
    "table": "this dataset has seed=3; open the same table version",
    "files": "this dataset has seed=3; open the same files with the same seed and shuffle to resume",
}


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_state_keeps_its_keys_and_a_saved_state_resumes(folders, kind):
    loader = _opened(folders, kind)
    iterator = iter(loader)
    next(iterator)
    saved = loader.state_dict()
    assert list(saved) == LAYOUTS[kind]
    assert saved["version"] == 1 and saved["epoch"] == 0 and saved[LAYOUTS[kind][2]] > 0
    rest = [repr(batch) for batch in iterator]
    again = _opened(folders, kind)
    again.load_state_dict(dict(saved))  # a plain dict, as read back from a checkpoint's JSON
    assert again.state_dict() == saved
    assert [repr(batch) for batch in again] == rest


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_a_state_that_is_not_its_own_is_refused(folders, kind):
    loader = _opened(folders, kind)
    saved = loader.state_dict()
    for bad in ([], dict(saved, version=2)):
        with pytest.raises(ConfigurationError, match=REFUSAL[kind].replace("(", r"\(").replace(")", r"\)")):
            loader.load_state_dict(bad)
    with pytest.raises(ConfigurationError, match=f"has seed=4 but {MISMATCH[kind]}"):
        loader.load_state_dict(dict(saved, seed=4))
    with pytest.raises(ConfigurationError, match="is outside this"):
        loader.load_state_dict(dict(saved, **{LAYOUTS[kind][2]: 10**9}))
