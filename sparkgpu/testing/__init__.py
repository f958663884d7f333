"""Aids for tests and benchmarks: an object store's link and an S3 server, simulated on loopback.

Not needed to train. ``sparkgpu data bench --profile s3-like`` (and ``--table``) measures a
local dataset or table as a training node would see it behind S3, and the benchmarks and the
package's own tests use the same stand-ins:

- :mod:`sparkgpu.testing.simulated_link`: a local folder served over HTTP behind a proxy that
  adds latency before each request and caps each connection's rate;
- :mod:`sparkgpu.testing.simulated_s3`: an S3-protocol server (moto's) behind that proxy, its
  endpoint and dummy credentials set in the usual ``AWS_*`` variables.
"""
