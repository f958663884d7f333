"""matplotlib for the figures the package draws (usage, volume reports); an optional dependency."""

from __future__ import annotations

from sparkgpu.errors import MissingDependencyError


def pyplot(what: str):
    """``matplotlib.pyplot`` on the file-only Agg backend.

    Args:
        what: What is being drawn, for the error (``"plotting usage"``).

    Raises:
        MissingDependencyError: matplotlib is not installed; names the pip command.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError(what, "pip install matplotlib") from None
    return plt
