"""Each rank's last collective read from torch's flight-recorder dump, and the rank behind named by it."""

from __future__ import annotations

from sparkgpu.launch.client.flight_record import LastCollective, behind_by_sequence, last_collective, read_record
from sparkgpu.launch.client.hang_diagnosis import diagnose
from sparkgpu.launch.rank.flight_recorder import FR_ENTRIES, recorder_env
from tests.unit.test_hang_diagnosis import ALL_REDUCE, BROADCAST_OBJECTS, _record, _stacks


def _entry(seq: int, name: str = "gloo:all_reduce", retired: bool = True, group: str = "default_pg", **more):
    # The fields torch 2.14's _dump_fr_trace_json writes for a gloo collective (some left out).
    return {
        "collective_seq_id": seq,
        "op_id": seq,
        "is_p2p": False,
        "p2p_seq_id": 0,
        "pg_id": 0,
        "process_group": ["0", group],
        "profiling_name": name,
        "retired": retired,
        "state": "scheduled",
        "input_sizes": [[10]],
        **more,
    }


def test_the_last_collective_of_the_jobs_group_is_read_with_whether_it_completed():
    dump = {
        "entries": [
            _entry(3),
            _entry(4, retired=False),
            _entry(9, group="sub", name="gloo:broadcast"),
            {**_entry(12), "is_p2p": True},
        ]
    }
    assert last_collective(dump) == LastCollective(4, "gloo:all_reduce", False, "default_pg")
    assert last_collective(dump).words == "collective #4 (gloo:all_reduce, not completed)"  # type: ignore[union-attr]
    # Without the job's group, the group with the most entries; NCCL's own completed state counts.
    nccl = {"entries": [_entry(7, "nccl:all_gather", retired=False, group="tp", state="completed")]}
    assert last_collective(nccl) == LastCollective(7, "nccl:all_gather", True, "tp")
    assert last_collective({"error": "the rank had no process group yet"}) is None and last_collective(None) is None


def test_a_dump_that_is_missing_or_cut_short_reads_as_none(tmp_path):
    assert read_record(tmp_path / "rank-0.json") is None
    (tmp_path / "rank-1.json").write_text('{"entries": [')
    assert read_record(tmp_path / "rank-1.json") is None


def test_the_ranks_whose_last_collective_comes_first_are_behind():
    at = {0: LastCollective(7, "gloo:all_reduce", False, "default_pg")}
    assert behind_by_sequence({**at, 1: LastCollective(6, "gloo:all_reduce", True, "default_pg")}) == [1]
    assert behind_by_sequence({**at, 1: LastCollective(7, "gloo:broadcast", False, "default_pg")}) == []
    assert behind_by_sequence({**at, 1: None}) == []  # one unknown: no claim
    assert behind_by_sequence({**at, 1: LastCollective(2, "gloo:all_reduce", True, "sub")}) == []


def test_when_every_rank_waits_in_a_collective_the_recorder_names_the_one_behind_where_notes_cannot():
    stacks = _stacks(r0=ALL_REDUCE, r1=BROADCAST_OBJECTS)
    records = {0: _record(7), 1: _record(7)}  # the same notes: they alone would blame both
    collectives = {
        0: LastCollective(12, "gloo:all_reduce", False, "default_pg"),
        1: LastCollective(11, "gloo:broadcast", True, "default_pg"),
    }
    found = diagnose(stacks, records, {0: 4.0, 1: 4.0}, 3.0, 2, collectives)
    assert found.behind == (1,) and found.summary.startswith("rank 1 on node 0 waits in `broadcast_object_list`")
    assert found.summary.endswith(
        "; flight recorder: rank 0 at collective #12 (gloo:all_reduce, not completed); "
        "rank 1 at collective #11 (gloo:broadcast, completed)"
    )
    assert diagnose(stacks, records, {0: 4.0, 1: 4.0}, 3.0, 2).behind == (0, 1)  # without it


def test_the_recorder_is_turned_on_for_every_backend_unless_the_user_sized_it():
    assert recorder_env({}) == {"TORCH_FR_BUFFER_SIZE": str(FR_ENTRIES)}
    assert recorder_env({"TORCH_FR_BUFFER_SIZE": "64"}) == {}
