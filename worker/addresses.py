"""Where a worker is reached: the host it advertises (to the manager and Prometheus) and
``host:port`` strings as gRPC and URLs want them."""

from __future__ import annotations

import socket
from typing import Optional

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def advertised_host(host: str, advertise_host: Optional[str] = None) -> str:
    """The host the manager and Prometheus reach a worker bound to ``host`` at: ``advertise_host``
    if set, else ``host``, unless that is a wildcard (which no one can connect to): then the
    node's address (Ray's view of it inside Ray, else what the host name resolves to)."""
    if advertise_host:
        return advertise_host
    if host not in WILDCARD_HOSTS:
        return host
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def host_port(host: str, port: int) -> str:
    """host:port, with an IPv6 literal in brackets (as gRPC and URLs want it)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
