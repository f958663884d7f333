"""Who gets GPUs when, decided on the client: this host's GPU queue and leases, a Spark
cluster's queue, an elastic job's resizing.
"""
