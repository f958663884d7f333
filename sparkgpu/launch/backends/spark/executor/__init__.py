"""What runs inside Spark tasks on the executors: one node of a job (its hub, its channel to
the others, what it is handed) and the capacity probe. Nothing here imports the client side.
"""
