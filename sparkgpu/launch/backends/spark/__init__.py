"""The Spark backend, client side: placement, capacity, sessions, the cluster queue's seats,
following an attempt's nodes. What runs inside the Spark tasks is ``executor``.
"""
