"""The run dir's format, shared by both sides: written and signed on the client, read and
checked on every worker (its file names, the payload's pickling and signature, the job key,
the generated entrypoint, control files, the staging store's mirror).
"""
