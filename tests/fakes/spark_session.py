"""A Spark session stand-in for the job-tag plumbing: actions block until their tag is interrupted.

Only what :func:`sparkgpu.launch.backends.spark.capacity.run_tagged` touches: ``addTag`` /
``removeTag`` (thread-local, as in Spark Connect), ``interruptTag``, and a frame whose
``collect`` runs until it finishes or its tag is interrupted.
"""

from __future__ import annotations

import threading


class InterruptedAction(Exception):
    """What ``collect`` raises when its tag was interrupted (Spark raises its own error)."""


class BlockingFrame:
    def __init__(self, session: "TaggedSession", rows=None, seconds: float | None = None):
        self.session, self.rows, self.seconds = session, rows or [], seconds

    def collect(self):
        tags = set(self.session._local.tags)
        event = threading.Event()
        self.session._running.append((tags, event))
        if event.wait(self.seconds):
            raise InterruptedAction(f"interrupted: {sorted(tags)}")
        return self.rows


class TaggedSession:
    def __init__(self):
        self._local = threading.local()
        self._running: list[tuple[set, threading.Event]] = []
        self.interrupted: list[str] = []

    def addTag(self, tag: str) -> None:
        self._local.__dict__.setdefault("tags", set()).add(tag)

    def removeTag(self, tag: str) -> None:
        self._local.__dict__.setdefault("tags", set()).discard(tag)

    def interruptTag(self, tag: str) -> list[str]:
        self.interrupted.append(tag)
        hit = [event for tags, event in self._running if tag in tags]
        for event in hit:
            event.set()
        return [tag] * len(hit)
