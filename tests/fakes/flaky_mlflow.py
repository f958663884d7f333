"""A real ``MlflowClient`` that fails on chosen calls, standing for a store that is down."""

from __future__ import annotations


class FlakyClient:
    """Wraps a real client; its calls number ``fail_calls`` (counted from 1) raise instead of
    running. It remembers every metric point of the ``log_batch`` calls that went through.

    Args:
        client: The real ``MlflowClient``.
        fail_calls: Numbers of the calls that fail; ``range(1, 10**9)`` for a store that is down.
    """

    def __init__(self, client, fail_calls=(1,)):
        self._client = client
        self.fail_calls = fail_calls
        self.calls = 0
        self.sent_metrics: list[tuple] = []

    def _call(self, name, *args, **kwargs):
        self.calls += 1
        if self.calls in self.fail_calls:
            raise ConnectionError(f"store unreachable (call {self.calls})")
        return getattr(self._client, name)(*args, **kwargs)

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        result = self._call("log_batch", run_id, metrics=list(metrics), params=list(params), tags=list(tags))
        self.sent_metrics.extend((m.key, m.step, m.value) for m in metrics)
        return result

    def log_text(self, *args, **kwargs):
        return self._call("log_text", *args, **kwargs)

    def set_tag(self, *args, **kwargs):
        return self._call("set_tag", *args, **kwargs)

    def set_terminated(self, *args, **kwargs):
        return self._call("set_terminated", *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)
