"""A manager that serves tenants in a test: TLS and a tokens table, on a real gRPC server on
127.0.0.1, with one client per token; the invariants are checked when the test is done."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from kvpager import auth
from kvpager import client as C
from kvpager.manager import ManagerConfig
from kvpager.manager.service import BlockManagerService, create_server


@contextlib.contextmanager
def tenant_clients(config: ManagerConfig, tokens: dict[str, Any], cert: Any, ca_cert: bytes,
                   named_tokens: dict[str, str]) -> Iterator[tuple[dict[str, C.BlockManagerClient],
                                                                    BlockManagerService]]:
    """(a client per name of ``named_tokens``, the service) of a server with ``tokens`` (the
    tokens file's JSON) and TLS (``cert``: the server's, from tests/support/tls.py's CA)."""
    server, port, service, _ = create_server(config, "127.0.0.1:0", tokens=auth.TokenTable.from_json(tokens),
                                             tls=auth.TLS(cert=cert.cert, key=cert.key))
    server.start()
    with contextlib.ExitStack() as stack:
        clients = {name: stack.enter_context(C.BlockManagerClient(f"127.0.0.1:{port}", timeout=5, token=token,
                                                                  root_certificates=ca_cert))
                   for name, token in named_tokens.items()}
        try:
            yield clients, service
            with service.lock:
                service.manager.check_invariants()
        finally:
            server.stop(None)
            service.close()
