"""Which failed attempts are restarted: never what no restart can fix.

The failures are the ranks' own records (:class:`RankFailure`, with the traceback a rank writes),
made from real exceptions raised in real functions.
"""

from __future__ import annotations

import json

from sparkgpu.errors import RankFailure, ResultError
from sparkgpu.launch.client.failure_policy import Decision, FailurePolicy, failure_location
from tests.rank_failures import raised


def bad_batch(step: int = 3):
    raise ValueError(f"bad batch at step {step}")


def other_bad_batch():
    raise ValueError("bad batch at step 9")


def lost_key():
    return {}["labels"]


def test_a_failure_after_the_function_returned_is_raised_with_restarts_left():
    error = ResultError("rank 0's function returned, but its result could not be written back: ...")
    failure = RankFailure(0, "sparkgpu.errors.ResultError", str(error), "", timestamp=1.0)
    policy = FailurePolicy(max_restarts=3)
    assert policy.decide(0, {0: error}, [failure]) is Decision.RAISE
    # Known by its type's name too, where the exception did not unpickle on the client.
    assert policy.decide(0, {}, [failure]) is Decision.RAISE
    assert policy.unrestartable({}, [failure]) == "after its function returned: its result could not be written back"


def test_the_same_exception_at_the_same_place_twice_is_raised():
    policy = FailurePolicy(max_restarts=3)
    first, exc = raised(lambda: bad_batch(3))
    again, exc_again = raised(lambda: bad_batch(7))  # another message, the same place
    assert policy.decide(0, {0: exc}, [first]) is Decision.RESTART
    assert policy.decide(1, {0: exc_again}, [again], previous=[first]) is Decision.RAISE
    why = policy.unrestartable({0: exc_again}, [again], previous=[first])
    assert why is not None and why.startswith("with ValueError at ") and "in bad_batch again" in why


def test_an_exception_at_another_place_is_restarted_while_restarts_are_left():
    policy = FailurePolicy(max_restarts=2)
    first, _ = raised(bad_batch)
    elsewhere, exc = raised(other_bad_batch)  # same type, another line
    other_type, key_error = raised(lost_key)
    assert policy.decide(1, {0: exc}, [elsewhere], previous=[first]) is Decision.RESTART
    assert policy.decide(1, {0: key_error}, [other_type], previous=[first]) is Decision.RESTART
    assert policy.decide(2, {0: exc}, [elsewhere], previous=[first]) is Decision.RAISE  # none left


def test_a_death_without_an_exception_is_no_place_and_is_restarted():
    policy = FailurePolicy(max_restarts=3)
    killed = RankFailure(1, None, "the process died from signal 9", exitcode=-9, timestamp=1.0)
    assert failure_location([killed]) is None
    assert policy.decide(1, {}, [killed], previous=[killed]) is Decision.RESTART


def test_the_place_is_the_first_failure_and_its_innermost_frame_of_user_code():
    def through_a_library():
        json.loads("{")  # raised inside the standard library's json, called from here

    cause, _ = raised(through_a_library, rank=1, at=1.0)
    follower, _ = raised(lost_key, rank=0, at=5.0)  # later: not the root cause
    kind, where = failure_location([follower, cause])
    assert kind == "json.decoder.JSONDecodeError"
    assert where.endswith("in through_a_library") and "test_failure_policy.py" in where


def test_failure_policy_and_decision_are_still_importable_from_the_supervisor():
    from sparkgpu.launch.client import supervisor

    assert supervisor.FailurePolicy is FailurePolicy and supervisor.Decision is Decision
