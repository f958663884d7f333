"""What runs in the caller's process (or in ``sparkgpu resume``'s): the supervisor's
attempt loop, attempts read back from the run dir, live logs, resume, retention and the
launcher's subcommands.
"""
