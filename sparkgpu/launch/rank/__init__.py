"""What runs inside every rank process: the entrypoint behind ``_air.py``, the process group,
its CPU thread settings.
"""
