"""Capture and restore the random number generators a training loop draws from.

Python's ``random``, NumPy's global generator, torch's CPU generator and, when CUDA has been
initialised in this process, every CUDA device's generator. Restoring them makes dropout
masks, shuffles and augmentations after a restart the same as in an uninterrupted run.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["capture_rng_state", "restore_rng_state"]


def capture_rng_state() -> dict[str, Any]:
    """The state of every generator, as plain picklable values."""
    import numpy as np
    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": None,
    }
    # Asking for CUDA states would initialise CUDA in a process that never used it.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Puts back a state returned by :func:`capture_rng_state`."""
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        # A restart may see fewer devices (each rank sees its own GPU only).
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
