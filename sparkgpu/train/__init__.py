"""Training-side helpers: checkpoint-and-restart.

```python
from sparkgpu.train import Checkpointer
ckpt = Checkpointer(every_steps=100)
start = ckpt.restore(model=model, optimizer=opt, loader=ds)
```
"""

from __future__ import annotations

from sparkgpu._util.modules import lazy_attributes

__all__ = ["Checkpointer", "CheckpointInfo", "list_checkpoints", "latest_checkpoint"]

# torch is imported only when a training helper is used, not by `import sparkgpu.train`.
__getattr__ = lazy_attributes(__name__, {name: ("sparkgpu.train.checkpoint", name) for name in __all__})
