"""What runs once per node, beside its ranks: the agent that starts them, where they listen,
how each exits, what accelerators the host has.
"""
