"""Straggler detection's arithmetic: arrivals lined up by sequence number, the step time, the factor."""

from __future__ import annotations

import pytest

from sparkgpu.launch.client.stragglers import MIN_SAMPLES, find_stragglers, step_time
from sparkgpu.launch.rank.arrivals import latest_arrivals, look_seconds
from sparkgpu.rundir.progress import RankProgress


def _arrivals(late: dict[int, float], period: float = 0.3, first: int = 1, n: int = 12, skip=()) -> dict:
    """Ranks reaching collectives ``first..first+n-1`` every ``period`` s, each ``late[rank]`` s after t0."""
    return {
        rank: [
            [seq, 1000.0 + (seq - first) * period + lag] for seq in range(first, first + n) if (rank, seq) not in skip
        ]
        for rank, lag in late.items()
    }


def test_a_rank_that_arrives_late_every_time_is_named_with_the_factor_it_costs():
    # Steps take 0.3 s; rank 2 reaches each collective 0.25 s after rank 0: without it they would take 0.05 s.
    (named,) = find_stragglers(_arrivals({0: 0.0, 1: 0.002, 2: 0.25}), step=0.3, factor=1.5, nodes={2: 1})
    assert (named.rank, named.node, named.collectives) == (2, 1, 12)
    assert named.lateness == pytest.approx(0.25)
    assert named.factor == pytest.approx(0.3 / 0.05)
    assert "rank 2 on node 1 is a straggler" in named.words and "6.0x" in named.words


def test_the_factor_is_a_threshold_and_ranks_within_it_are_not_named():
    # 0.09 s late of 0.3 s: 0.3 / 0.21 = 1.43x, under 1.5.
    assert find_stragglers(_arrivals({0: 0.0, 1: 0.09}), step=0.3, factor=1.5) == []
    (named,) = find_stragglers(_arrivals({0: 0.0, 1: 0.11}), step=0.3, factor=1.5)
    assert named.rank == 1 and named.factor == pytest.approx(0.3 / 0.19)


def test_the_median_judges_so_a_few_late_arrivals_do_not_name_a_rank():
    lags = {seq: (0.25 if seq % 4 == 0 else 0.0) for seq in range(1, 13)}  # late at 3 of 12: a hiccup, not a pace
    arrivals = {0: [[s, 1000.0 + s * 0.3] for s in lags], 1: [[s, 1000.0 + s * 0.3 + lag] for s, lag in lags.items()]}
    assert find_stragglers(arrivals, step=0.3, factor=1.5) == []


def test_only_collectives_every_rank_reached_count_and_too_few_name_nobody():
    skip = {(1, seq) for seq in range(1, 12 - MIN_SAMPLES + 2)}  # rank 1 has only MIN_SAMPLES - 1 in common
    assert find_stragglers(_arrivals({0: 0.0, 1: 0.25}, skip=skip), step=0.3, factor=1.5) == []
    # The latest collective, which the quick rank reached and the slow one not yet, is left out.
    arrivals = _arrivals({0: 0.0, 1: 0.25})
    arrivals[0].append([13, 1000.0 + 12 * 0.3])
    (named,) = find_stragglers(arrivals, step=0.3, factor=1.5)
    assert named.collectives == 12
    assert find_stragglers({0: arrivals[0]}, step=0.3, factor=1.5) == []  # one rank: nobody to wait for


def test_a_lateness_as_long_as_the_step_is_an_unbounded_factor_capped_in_words():
    (named,) = find_stragglers(_arrivals({0: 0.0, 1: 0.3}), step=0.3, factor=1.5)
    assert named.factor == 1000.0 and "more than 100x" in named.words


def _progress(count: int, step: int | None, last: float) -> RankProgress:
    return RankProgress(pid=1, node=0, count=count, step=step, last=last, slowest=0.0, started=0.0)


def test_the_step_time_comes_from_noted_steps_then_from_notes_then_from_the_collectives_pace():
    before = {0: _progress(10, 4, 100.0), 1: _progress(10, 4, 100.1)}
    after = {0: _progress(30, 14, 103.0), 1: _progress(30, 14, 103.1)}  # two notes a step (a loader and a Trainer)
    assert step_time(before, after, {}) == pytest.approx(0.3)
    no_steps = {r: _progress(p.count, None, p.last) for r, p in after.items()}
    assert step_time({r: _progress(p.count, None, p.last) for r, p in before.items()}, no_steps, {}) == pytest.approx(
        0.15
    )
    still = {r: _progress(p.count, p.step, p.last) for r, p in before.items()}
    assert step_time(before, still, _arrivals({0: 0.0, 1: 0.1}, period=0.2)) == pytest.approx(0.2)
    assert step_time(before, still, {}) is None


def test_a_rank_keeps_its_latest_collectives_on_the_jobs_group_without_point_to_point():
    entries = [
        {"collective_seq_id": seq, "time_created_ns": seq * 10**9, "process_group": ["0", "default_pg"]}
        for seq in range(1, 40)
    ]
    entries += [
        {"collective_seq_id": 99, "time_created_ns": 5, "process_group": ["1", "other"]},
        {
            "collective_seq_id": 0,
            "p2p_seq_id": 3,
            "is_p2p": True,
            "time_created_ns": 7,
            "process_group": ["0", "default_pg"],
        },
    ]
    found = latest_arrivals(entries, samples=16)
    assert [seq for seq, _ in found] == list(range(24, 40)) and found[0][1] == 24.0
    assert latest_arrivals([]) == []
    assert look_seconds(60) == 15 and look_seconds(3) == 0.75 and look_seconds(0.1) == 0.25
