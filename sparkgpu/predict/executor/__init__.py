"""Code of ``spark.gpu.predict`` that runs inside the executors' Python workers."""
