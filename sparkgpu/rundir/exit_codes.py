"""The exit codes of a rank that both sides read: the rank exits with them, its node's launcher
(the agent, the warm pool) records them in the node exit file (``node-<n>.json``), and the
client tells from them how the attempt ended.

A rank that returned exits 0; one killed by a signal reads as its negated number, as
:mod:`subprocess` reports it.
"""

from __future__ import annotations

__all__ = ["EXIT_FAILED", "EXIT_PREEMPTED"]

#: The rank's function raised, or the rank could not run it (no key, a payload that does not verify).
EXIT_FAILED = 1
#: ``EX_TEMPFAIL``: the rank checkpointed and stopped on request; the job resumes in a new attempt.
EXIT_PREEMPTED = 75
