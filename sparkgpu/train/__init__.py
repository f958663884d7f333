"""Training-side helpers: checkpoint-and-restart.

```python
from sparkgpu.train import Checkpointer
ckpt = Checkpointer(every_steps=100)
start = ckpt.restore(model=model, optimizer=opt, loader=ds)
```
"""

from __future__ import annotations

__all__ = ["Checkpointer", "CheckpointInfo", "list_checkpoints", "latest_checkpoint"]

_CHECKPOINT_NAMES = frozenset(__all__)


def __getattr__(name):
    # torch is imported only when a training helper is used, not by `import sparkgpu.train`.
    if name in _CHECKPOINT_NAMES:
        from sparkgpu.train import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'sparkgpu.train' has no attribute {name!r}")
