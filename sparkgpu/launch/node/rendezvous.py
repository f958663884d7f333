"""Where a job's ranks listen: only on the address their peers use.

torch's TCPStore server (the rendezvous store every rank of a job talks to) listens on every
interface whatever host it is given, and it has no authentication: anyone who reaches the
port can read and write the job's rendezvous keys. gloo and NCCL pick their interface from the
host name, which resolves to an external address. A local job has no peer off this host, so
all of it belongs on loopback; a multi-node job belongs on the one interface that reaches
node 0.

* The store: node 0's agent opens the listening socket itself, bound to the rendezvous
  address, and hands it to the TCPStore (``master_listen_fd``). The agent registers the
  ``sparkgpu-static`` rendezvous for that (torch's ``static`` one otherwise); the warm pool
  serves each job's store from a forked child the same way (:func:`serve_store`).
* The collectives: ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name the interface that
  holds the address this host uses to reach node 0 (``lo`` for a local job); a value the user
  set is kept.
"""

from __future__ import annotations

import os
import signal
import socket

from sparkgpu._util.report import report

__all__ = [
    "listening_socket",
    "route_interface",
    "collective_interface_env",
    "register",
    "serve_store",
    "RENDEZVOUS_BACKEND",
]

RENDEZVOUS_BACKEND = "sparkgpu-static"
_registered = False


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (``port`` 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _local_address_towards(host: str) -> str:
    """The address of this host that packets to ``host`` leave from (no packet is sent)."""
    info = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(info[0], socket.SOCK_DGRAM) as probe:
        probe.connect(info[4])  # a UDP connect only picks the route
        return probe.getsockname()[0]


def route_interface(host: str) -> str | None:
    """The name of the interface this host reaches ``host`` through, ``None`` if unknown."""
    import psutil

    try:
        address = _local_address_towards(host)
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6)):
            return name
    return None


def collective_interface_env(master_addr: str, environ=None) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` for ranks that meet at ``master_addr``.

    Returns:
        The variables to set: those the environment does not set already, naming the
        interface towards ``master_addr``; empty when that interface cannot be told.
    """
    environ = os.environ if environ is None else environ
    interface = route_interface(master_addr)
    if interface is None:
        return {}
    return {name: interface for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if not environ.get(name)}


def register() -> None:
    """Registers the ``sparkgpu-static`` rendezvous with torch's elastic launcher.

    It is torch's ``static`` rendezvous whose node 0 serves the store on a socket bound to
    the rendezvous address alone.
    """
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous, create_rdzv_handler

    class BoundStaticRendezvous(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return RENDEZVOUS_BACKEND

        def next_rendezvous(self):
            if self._store is None and self.rank == 0:
                from torch.distributed import TCPStore

                # Port 0 (a one-node job): the store listens on a port taken here, not on one found
                # free earlier, which another process can take meanwhile on a busy machine.
                self._listener = listening_socket(self.master_addr, self.master_port)
                self.master_port = self._listener.getsockname()[1]
                self._store = TCPStore(
                    self.master_addr,
                    self.master_port,
                    self.world_size,
                    True,
                    self.timeout,
                    multi_tenant=True,
                    master_listen_fd=self._listener.fileno(),
                )
            return super().next_rendezvous()

    def create(params):
        static = create_rdzv_handler(params)  # torch's checks and parsing of the parameters
        return BoundStaticRendezvous(
            static.master_addr,
            static.master_port,
            static.rank,
            static.world_size,
            static.run_id,
            int(static.timeout.total_seconds()),
        )

    global _registered
    if not _registered:
        rendezvous_handler_registry.register(RENDEZVOUS_BACKEND, create)
        _registered = True


def serve_store(listener: socket.socket, world_size: int) -> None:
    """Serves a job's rendezvous store on ``listener`` until SIGTERM; never returns.

    The warm pool runs this in a child forked per job, so the store lives exactly as long as
    the job and the ranks are its clients (``TORCHELASTIC_USE_AGENT_STORE``), as under
    torch's own agent.
    """
    code = 0
    try:
        from torch.distributed import TCPStore

        host, port = listener.getsockname()[:2]
        store = TCPStore(
            host, port, world_size, True, wait_for_workers=False, multi_tenant=True, master_listen_fd=listener.fileno()
        )
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        while store is not None:  # the store serves from its own thread; SIGTERM ends the process
            signal.pause()
    except BaseException as exc:  # the warm zygote's child must never return into its loop
        report(f"the job's rendezvous store failed: {exc!r}")
        code = 1
    finally:
        os._exit(code)
