"""Scoring and generation on the session's GPU executors: ``spark.gpu.predict`` / ``spark.gpu.generate``.

```python
scored = spark.gpu.predict(features, "main.ml.ctr@champion", gpus=4, gpu_type="A10")   # a DataFrame
result = spark.gpu.generate(prompts, "/models/adapter", gpus=2, gpu_type="H100",
                            output="/tables/answers", generation={"max_new_tokens": 64})
```

See :meth:`sparkgpu.api.spark_gpu.GPUNamespace.predict` and the "Scoring and generation" guide.
"""

from __future__ import annotations

from sparkgpu.predict.executor.generation import GenerationConfig, row_seed
from sparkgpu.predict.job import PredictionResult, predict
from sparkgpu.predict.models import ModelSource, register_loader, resolve_model

__all__ = [
    "predict",
    "PredictionResult",
    "GenerationConfig",
    "ModelSource",
    "resolve_model",
    "register_loader",
    "row_seed",
]
