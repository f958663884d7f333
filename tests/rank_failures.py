"""A rank's failure record for what a function raises, as the rank's entrypoint writes it."""

from __future__ import annotations

import traceback

from sparkgpu.errors import RankFailure


def raised(fn, rank: int = 0, at: float = 1.0) -> tuple[RankFailure, BaseException]:
    """The RankFailure a rank writes for what ``fn`` raises (as serialize_error builds it)."""
    try:
        fn()
    except Exception as exc:
        name = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return RankFailure(rank, name, str(exc), text, timestamp=at), exc
    raise AssertionError("fn raised nothing")
