"""The diagnosis of a hung attempt from its ranks' stacks: who is behind, and where every rank is.

The stacks are as :mod:`faulthandler` writes them into a rank's stacks file: recorded from hung
ranks of a gloo job (paths shortened to a user's and a virtual environment's), and one dumped
for real from a process that sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from sparkgpu.rundir.progress import RankProgress
from sparkgpu.launch.client.hang_diagnosis import (
    DUMP_MARKER,
    Frame,
    RankState,
    diagnose,
    parse_stacks,
    place_of,
    rank_list,
)

SITE = "/home/me/.venv/lib/python3.11/site-packages"
STDLIB = "/usr/lib/python3.11"
MAIN = 0x00007F3657672B80
WORKER_THREAD = 0x00007F36401FF640


def _file(rank: int, frames: list[str], *, current_is_main: bool = True) -> str:
    """A rank's stacks file: its header, a first dump of another thread only, then the dump asked for."""
    header = f"sparkgpu rank {rank} on node 0, pid {1000 + rank}, main thread 0x{MAIN:016x}\n"
    helper = (
        f"Thread 0x{WORKER_THREAD:016x} (most recent call first):\n"
        f'  File "{STDLIB}/threading.py", line 324 in wait\n'
        f'  File "{STDLIB}/threading.py", line 1002 in _bootstrap\n'
    )
    main = f"{'Current thread' if current_is_main else 'Thread'} 0x{MAIN:016x} (most recent call first):\n" + "".join(
        f"  {line}\n" for line in frames
    )
    return f"{header}\n{DUMP_MARKER}\n{helper}\n\n{DUMP_MARKER}\n{helper}\n{main}\n"


OUTER = [
    'File "/home/me/sparkgpu/launch/rank/entrypoint.py", line 218 in _run',
    'File "/home/me/runs/train-1/_air.py", line 129 in <module>',
]
ALL_REDUCE = [
    f'File "{SITE}/torch/distributed/distributed_c10d.py", line 2952 in all_reduce',
    f'File "{SITE}/torch/distributed/c10d_logger.py", line 83 in wrapper',
    'File "/home/me/train.py", line 31 in train_step',
    'File "/home/me/train.py", line 40 in train',
    *OUTER,
]
SLEEPING = ['File "/home/me/train.py", line 28 in train_step', 'File "/home/me/train.py", line 40 in train', *OUTER]
LOADER = [
    f'File "{STDLIB}/threading.py", line 327 in wait',
    f'File "{STDLIB}/queue.py", line 180 in get',
    f'File "{SITE}/torch/utils/data/dataloader.py", line 1133 in _try_get_data',
    f'File "{SITE}/torch/utils/data/dataloader.py", line 1295 in _get_data',
    f'File "{SITE}/torch/utils/data/dataloader.py", line 1459 in _next_data',
    f'File "{SITE}/torch/utils/data/dataloader.py", line 733 in __next__',
    'File "/home/me/train.py", line 25 in train',
    *OUTER,
]
#: Rank 0 of a checkpoint save: dcp's own "all_reduce" helper runs the write on rank 0 (working, not waiting).
SAVING = [
    'File "/home/me/sparkgpu/train/_checkpoint_writes.py", line 222 in close',
    f'File "{SITE}/torch/distributed/checkpoint/state_dict_saver.py", line 509 in finish_checkpoint',
    f'File "{SITE}/torch/distributed/checkpoint/utils.py", line 254 in all_reduce',
    f'File "{SITE}/torch/distributed/checkpoint/state_dict_saver.py", line 196 in save',
    'File "/home/me/sparkgpu/train/checkpoint.py", line 261 in maybe_save',
    'File "/home/me/train.py", line 33 in train',
    *OUTER,
]
BROADCAST_OBJECTS = [
    f'File "{SITE}/torch/distributed/distributed_c10d.py", line 3787 in broadcast',
    f'File "{SITE}/torch/distributed/c10d_logger.py", line 83 in wrapper',
    f'File "{SITE}/torch/distributed/distributed_c10d.py", line 4759 in broadcast_object_list',
    f'File "{SITE}/torch/distributed/c10d_logger.py", line 83 in wrapper',
    'File "/home/me/train.py", line 44 in train',
    *OUTER,
]


def _record(count: int) -> RankProgress:
    return RankProgress(pid=1, node=0, count=count, step=count, last=0.0, slowest=0.1, started=0.0)


def _stacks(**frames_by_rank):
    return {int(rank[1:]): parse_stacks(_file(int(rank[1:]), frames)) for rank, frames in frames_by_rank.items()}


def test_the_last_dump_is_read_and_its_main_thread_found_by_the_header():
    stacks = parse_stacks(_file(1, SLEEPING, current_is_main=False))
    assert stacks is not None and (stacks.rank, stacks.node, stacks.pid, stacks.threads) == (1, 0, 1001, 2)
    assert [f.name for f in stacks.main] == ["<module>", "_run", "train", "train_step"]  # outermost first
    assert parse_stacks("no header here") is None
    assert parse_stacks(f"sparkgpu rank 0 on node 0, pid 1, main thread 0x{MAIN:016x}\n") is None  # no dump yet


def test_a_rank_that_blocks_before_a_collective_is_behind_the_one_waiting_in_all_reduce():
    found = diagnose(_stacks(r0=ALL_REDUCE, r1=SLEEPING), {0: _record(5), 1: _record(5)}, {0: 3.2, 1: 3.4}, 3.0, 2)
    assert found.behind == (1,)
    assert found.summary == (
        "rank 1 on node 0 is in `train_step` at train.py:28; no progress for 3.4s (progress_timeout=3s); "
        "rank 0 waits in `all_reduce`, called from `train_step` at train.py:31"
    )
    assert found.to_json()["ranks"]["0"] == {
        "node": 0,
        "state": "waiting",
        "where": "waits in `all_reduce`, called from `train_step` at train.py:31",
    }


def test_a_rank_whose_loader_blocks_is_named_where_it_entered_the_loader():
    place = place_of(parse_stacks(_file(3, LOADER)))
    assert place.state is RankState.ELSEWHERE
    assert place.words == (
        "is in `torch.utils.data.dataloader.__next__` (innermost: `threading.wait` at threading.py:327), "
        "called from `train` at train.py:25"
    )


def test_ranks_are_grouped_by_place_and_ranges():
    stacks = _stacks(r0=ALL_REDUCE, r1=ALL_REDUCE, r2=ALL_REDUCE, r3=LOADER, r4=ALL_REDUCE, r5=ALL_REDUCE)
    found = diagnose(stacks, {r: _record(9) for r in range(6)}, {3: 700.0}, 600.0, 6)
    assert found.behind == (3,)
    assert found.summary.startswith("rank 3 on node 0 is in `torch.utils.data.dataloader.__next__`")
    assert found.summary.endswith("; ranks 0-2, 4, 5 wait in `all_reduce`, called from `train_step` at train.py:31")
    assert rank_list([7, 0, 1, 2, 4, 5, 6]) == "ranks 0-2, 4-7" and rank_list([3]) == "rank 3"


def test_a_rank_inside_a_checkpoint_write_is_working_not_waiting():
    place = place_of(parse_stacks(_file(0, SAVING)))
    assert place.state is RankState.ELSEWHERE
    assert place.words == (
        "is in `sparkgpu.train.checkpoint.maybe_save` (innermost: `sparkgpu.train._checkpoint_writes.close` at "
        "_checkpoint_writes.py:222), called from `train` at train.py:33"
    )
    assert place_of(parse_stacks(_file(0, BROADCAST_OBJECTS))).words.startswith("waits in `broadcast_object_list`")


def test_when_every_rank_waits_in_a_collective_those_that_noted_least_are_behind():
    stacks = _stacks(r0=ALL_REDUCE, r1=BROADCAST_OBJECTS)
    found = diagnose(stacks, {0: _record(7), 1: _record(6)}, {0: 4.0, 1: 4.0}, 3.0, 2)
    assert found.behind == (1,) and found.summary.startswith("rank 1 on node 0 waits in `broadcast_object_list`")
    same = diagnose(stacks, {0: _record(7), 1: _record(7)}, {0: 4.0, 1: 4.0}, 3.0, 2)
    assert same.behind == (0, 1)
    assert same.summary.startswith("no rank made progress for 4.0s (progress_timeout=3s): ")
    assert same.summary.endswith(
        "every rank waits in a collective: they called different collectives, or a peer's link is stuck"
    )


def test_a_rank_without_stacks_is_named_so():
    found = diagnose({0: parse_stacks(_file(0, ALL_REDUCE)), 1: None}, {0: _record(2)}, {1: 5.0}, 3.0, 2)
    assert found.behind == (1,) and found.summary.startswith("rank 1 on node 0 gave no stacks; ")


def test_stacks_dumped_for_real_by_faulthandler_are_read(tmp_path):
    path = tmp_path / "rank-0.txt"
    child = textwrap.dedent(
        f"""
        import faulthandler, signal, sys, threading, time
        out = open({str(path)!r}, "a")
        out.write("sparkgpu rank 0 on node 0, pid 7, main thread 0x%016x\\n" % threading.main_thread().ident)
        out.flush()
        faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        def stuck_here():
            print("ready", flush=True)
            time.sleep(60)
        stuck_here()
        """
    )
    process = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        with open(path, "a") as out:
            out.write(f"\n{DUMP_MARKER}\n")
        os.kill(process.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while "stuck_here" not in path.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        process.kill()
        process.wait()
    stacks = parse_stacks(path.read_text())
    assert stacks is not None and stacks.threads == 2
    assert stacks.main[-1].name == "stuck_here" and stacks.main[-1].file == "<string>"


def test_the_callers_code_as_a_node_rehydrates_it_is_user_code_though_under_a_sparkgpu_folder():
    shipped = Frame("/home/u/.cache/sparkgpu/env/e60b/path/0/jobs/train.py", 52, "train_step")
    assert not shipped.library and shipped.module == "jobs.train"
    own = Frame("/opt/venv/src/sparkgpu/launch/rank/entrypoint.py", 10, "main")
    assert own.library and own.module == "sparkgpu.launch.rank.entrypoint"
