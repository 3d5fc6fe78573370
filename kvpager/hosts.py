"""Host names and addresses, as the servers' bind checks read them."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 bracketed or not) is this machine's loopback:
    ``localhost``, or an address in 127.0.0.0/8 or ::1 (a name like ``127.example.com`` is not)."""
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
