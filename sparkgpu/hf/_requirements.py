"""The guarded import of the Hugging Face stack."""

from __future__ import annotations

from sparkgpu.errors import MissingDependencyError

INSTALL = "pip install 'sparkgpu[hf]'"


def require_transformers(feature: str) -> None:
    """Raises MissingDependencyError naming the extra when ``transformers`` is not installed."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise MissingDependencyError(feature, INSTALL) from None
