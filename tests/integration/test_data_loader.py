"""The loader with real processes: ranks, DataLoader workers, a volume served over HTTP, CUDA."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from sparkgpu import data
from tests.unit.test_data_loader_support import check_tabular_batch, collect_ids, write_tabular

pytestmark = pytest.mark.integration

_RANK_SCRIPT = textwrap.dedent("""
    import sys, numpy as np
    from sparkgpu import data
    from tests.unit.test_data_loader_support import collect_ids
    remote, cache, out = sys.argv[1:4]
    ds = data.dataset(remote=remote, local=cache, batch_size=25, shuffle=True, seed=9, shuffle_block_size=200,
                      num_workers=2, download_threads=2)
    np.save(out, np.concatenate(collect_ids(ds)))
""")


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    return write_tabular(tmp_path_factory.mktemp("volume") / "ds", 1001, size_limit=2500, hashes=["xxh64"])


def test_two_ranks_with_two_workers_each_read_every_sample_once(volume, tmp_path):
    # Ranks are real processes sharing one cache folder, as on one node; each runs two workers.
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "PYTHONPATH": os.getcwd()}
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _RANK_SCRIPT,
                    volume,
                    str(tmp_path / "cache"),
                    str(tmp_path / f"rank{rank}.npy"),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for proc in procs:
        output, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, output
    per_rank = [np.load(tmp_path / f"rank{rank}.npy") for rank in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 500
    union = np.concatenate(per_rank)
    assert len(np.unique(union)) == 1000, "one sample (1001 % 2) is left out, none is read twice"
    # The number of workers does not change the order a rank sees.
    same_rank_in_process = data.dataset(
        remote=volume,
        local=tmp_path / "cache",
        batch_size=25,
        shuffle=True,
        seed=9,
        shuffle_block_size=200,
        rank=1,
        world_size=2,
    )
    np.testing.assert_array_equal(np.concatenate(collect_ids(same_rank_in_process)), per_rank[1])


def test_workers_resume_where_the_in_process_loader_stopped(volume, tmp_path):
    def open_loader(workers):
        return data.dataset(
            remote=volume, local=tmp_path / "cache", batch_size=30, shuffle=True, seed=4, num_workers=workers
        )

    everything = np.concatenate(collect_ids(open_loader(0)))
    first = open_loader(0)
    head = []
    for batch in first:
        head.append(check_tabular_batch(batch))
        if len(head) == 7:
            break
    resumed = open_loader(2)
    resumed.load_state_dict(first.state_dict())
    np.testing.assert_array_equal(np.concatenate(head + collect_ids(resumed)), everything)


@contextlib.contextmanager
def _http_server(folder):
    code = (
        "import functools, http.server, sys\n"
        "handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[1])\n"
        "http.server.ThreadingHTTPServer.request_queue_size = 1024\n"
        "server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)\n"
        "print(server.server_address[1], flush=True)\n"
        "server.serve_forever()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_remote_volume_over_http_with_compressed_hashed_shards(tmp_path):
    write_tabular(tmp_path / "served" / "ds", 700, size_limit=2000, compression="zstd", hashes=["sha1", "xxh64"])
    with _http_server(tmp_path / "served") as base:
        ds = data.dataset(
            remote=f"{base}/ds", local=tmp_path / "cache", batch_size=64, shuffle=True, seed=1, download_threads=4
        )
        epoch1 = np.concatenate(collect_ids(ds))
    # The server is gone: epoch 2 comes from the cache alone.
    epoch2 = np.concatenate(collect_ids(ds))
    ds.close()
    assert sorted(epoch1.tolist()) == sorted(epoch2.tolist()) == list(range(700))
    assert not np.array_equal(epoch1, epoch2)


def test_a_server_that_ignores_byte_ranges_gets_whole_file_downloads(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from sparkgpu.data.storage.volume import Volume

    (tmp_path / "served").mkdir()
    payload = np.random.default_rng(1).integers(0, 255, size=50_000, dtype=np.uint8).tobytes()
    (tmp_path / "served" / "blob.bin").write_bytes(payload)
    with _http_server(tmp_path / "served") as base, ThreadPoolExecutor(4) as pool:
        volume = Volume(base)  # Python's SimpleHTTPRequestHandler answers a range with the whole file
        for name in ("first.bin", "second.bin"):
            volume.download("blob.bin", str(tmp_path / name), size=len(payload), pool=pool, part_bytes=4_000)
            assert (tmp_path / name).read_bytes() == payload
    assert volume.ranges_supported is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_batches_arrive_on_the_gpu_equal_to_the_cpu_batches(volume):
    cpu = list(data.dataset(local=volume, batch_size=100, shuffle=True, seed=2))
    gpu = list(data.dataset(local=volume, batch_size=100, shuffle=True, seed=2, pin_memory=True, device="cuda"))
    assert len(cpu) == len(gpu) > 0
    for want, got in zip(cpu, gpu):
        for name, tensor in want.items():
            assert got[name].device.type == "cuda"
            assert torch.equal(got[name].cpu(), tensor)
