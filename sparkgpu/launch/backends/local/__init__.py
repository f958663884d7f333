"""The local backends: ranks on this host, started by a fresh node agent or forked from a
warm zygote (the client side in ``zygote_client``, the zygote process in ``zygote``).
"""
