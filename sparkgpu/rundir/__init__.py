"""The run dir's format, below the launcher: what the client writes and signs, and what the node
agents, the ranks and the libraries they run (runtime, train, tracking, data) read and write.

Its file names (:mod:`~sparkgpu.rundir.layout`) and one run dir on a machine
(:mod:`~sparkgpu.rundir.directory`); the states its files hold (:mod:`~sparkgpu.rundir.states`)
and the ranks' exit codes (:mod:`~sparkgpu.rundir.exit_codes`); the job key, kept
(:mod:`~sparkgpu.rundir.keyring`) and handed to the job's processes
(:mod:`~sparkgpu.rundir.key_handover`); the payload's pickling and signature
(:mod:`~sparkgpu.rundir.serialization`, :mod:`~sparkgpu.rundir.signature`), the generated
entrypoint (:mod:`~sparkgpu.rundir.entrypoint_template`), the sealed control files
(:mod:`~sparkgpu.rundir.control`) and a rank's progress record (:mod:`~sparkgpu.rundir.progress`).

It imports nothing of the launcher, the entry points or the command line
(``tests/unit/test_layering.py``); importing this package imports none of its modules.
"""
