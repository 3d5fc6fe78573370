"""Credentials for kvpager's gRPC servers and clients: TLS, bearer tokens and roles (docs/security.md).

Pure grpc (no torch, no manager or worker imports), used by the manager, the workers and the
clients alike:

- ``TokenTable``: the ``--auth-tokens`` file, ``{"tokens": [{"token": "...", "tenant": "a",
  "role": "scheduler"}, ...]}`` (``"sha256": HEX`` may stand instead of ``"token"``; an optional
  ``"quota_blocks": N`` sets the tenant's block quota, ``"quota_sequences": N`` its live sequences). Only the SHA-256 digests are kept; a
  presented token is hashed and compared with every entry in constant time.
- ``AuthInterceptor``: the one server interceptor that checks ``authorization: Bearer TOKEN``:
  none or an unknown token answers UNAUTHENTICATED, a role that may not call the method
  PERMISSION_DENIED. Health checking and reflection stay open. The handler of an accepted call
  runs with ``current_identity()`` answering the caller's ``Identity`` (tenant and role).
- ``server_credentials`` / ``channel``: TLS (mutual when a client CA is given) for servers and
  channels, and a channel that sends a token on every call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import contextvars
import logging
import os
from typing import Iterable, Mapping, Optional, Sequence, Union

import grpc

log = logging.getLogger("kvpager.auth")

ROLES = ("scheduler", "worker", "admin")
BLOCK_MANAGER = "/kvpager.v1.BlockManager/"
CACHE_WORKER = "/kvpager.v1.CacheWorker/"
# Open to anyone who can connect: health checking and server reflection.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")
SCHEDULER_METHODS = ("Allocate", "Append", "Fork", "Free", "SwapOut", "SwapIn", "Step", "GetBlockTable", "GetStats",
                     "Ping")
WORKER_METHODS = ("RegisterWorker", "Heartbeat")
# Which roles may call which method of the block manager (admin: every method, listed or not).
MANAGER_PERMISSIONS: dict[str, frozenset[str]] = {
    **{BLOCK_MANAGER + m: frozenset({"scheduler", "admin"}) for m in SCHEDULER_METHODS},
    **{BLOCK_MANAGER + m: frozenset({"worker", "admin"}) for m in WORKER_METHODS},
}
MANAGER_ROLE = "manager"  # the one identity a worker's CacheWorker service accepts


class CredentialError(ValueError):
    """A credentials file that cannot be used (missing, unreadable, malformed)."""


def read_bytes(source: Union[str, bytes, os.PathLike, None], what: str = "file") -> Optional[bytes]:
    """PEM bytes as given, or a file's contents (None stays None)."""
    if source is None or isinstance(source, bytes):
        return source
    try:
        with open(source, "rb") as f:
            return f.read()
    except OSError as err:
        raise CredentialError(f"cannot read {what} {source}: {err.strerror or err}") from err


def read_token(path: Union[str, os.PathLike, None], what: str = "token file") -> Optional[str]:
    """A token file's contents, stripped (one token, surrounding whitespace ignored). A bearer
    token travels in the authorization header, which gRPC takes in printable ASCII only: any
    other character is refused here, naming its index (never the secret), instead of failing
    every call later."""
    if path is None:
        return None
    token = read_bytes(path, what).decode("utf-8", "replace").strip()
    if not token:
        raise CredentialError(f"{what} {path} is empty")
    bad = unsendable_index(token)
    if bad is not None:
        raise CredentialError(f"{what} {path}: its character at index {bad} is not printable ASCII, which a bearer "
                              "token must be")
    return token


def unsendable_index(token: str) -> Optional[int]:
    """The index of the first character of ``token`` that a bearer token in the authorization
    header cannot hold (gRPC takes its value in printable ASCII only), or None."""
    return next((i for i, ch in enumerate(token) if not " " <= ch <= "~"), None)


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclasses.dataclass(frozen=True, slots=True)
class Identity:
    tenant: str
    role: str
    quota_blocks: Optional[int] = None  # the tenant's block quota named by this token's entry (None: none)
    quota_sequences: Optional[int] = None  # the tenant's quota of live sequences named by this entry (None: none)


# The identity of the caller whose RPC this thread serves (set by ``AuthInterceptor`` around the
# handler; None when no token check runs: an open server, health, reflection).
_IDENTITY: contextvars.ContextVar[Optional[Identity]] = contextvars.ContextVar("kvpager_identity", default=None)


def current_identity() -> Optional[Identity]:
    """The authenticated caller of the RPC being served, or None on a server without tokens."""
    return _IDENTITY.get()


class TokenTable:
    """Bearer tokens (kept only as SHA-256 digests) and the identity each one stands for."""

    def __init__(self, entries: Iterable[tuple[bytes, Identity]]) -> None:
        self._entries = list(entries)

    def __len__(self) -> int:
        return len(self._entries)

    @classmethod
    def single(cls, token: str, role: str, tenant: str = "") -> "TokenTable":
        return cls([(digest(token), Identity(tenant, role))])

    @classmethod
    def from_json(cls, document: Mapping, where: str = "tokens file") -> "TokenTable":
        items = document.get("tokens") if isinstance(document, Mapping) else None
        if not isinstance(items, list) or not items:
            raise CredentialError(f'{where}: expected {{"tokens": [{{"token": ..., "tenant": ..., "role": ...}}, ...]}}')
        entries, seen = [], set()
        for i, item in enumerate(items):
            if not isinstance(item, Mapping):
                raise CredentialError(f"{where}: tokens[{i}] is not an object")
            role = item.get("role")
            if role not in ROLES:
                raise CredentialError(f"{where}: tokens[{i}]: role must be one of {', '.join(ROLES)}, got {role!r}")
            tenant = item.get("tenant", "")
            if not isinstance(tenant, str) or "\0" in tenant:
                raise CredentialError(f"{where}: tokens[{i}]: tenant must be a string without NUL characters")
            quota, sequences = item.get("quota_blocks"), item.get("quota_sequences")
            for name, value in (("quota_blocks", quota), ("quota_sequences", sequences)):
                if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                    raise CredentialError(f"{where}: tokens[{i}]: {name} must be an integer >= 0")
            if ("token" in item) == ("sha256" in item):
                raise CredentialError(f'{where}: tokens[{i}]: give exactly one of "token" and "sha256"')
            if "token" in item:
                if not isinstance(item["token"], str) or len(item["token"]) < 16:
                    raise CredentialError(f"{where}: tokens[{i}]: a token must be a string of at least 16 characters")
                key = digest(item["token"])
            else:
                try:
                    key = bytes.fromhex(item["sha256"])
                except (TypeError, ValueError):
                    key = b""
                if len(key) != 32:
                    raise CredentialError(f"{where}: tokens[{i}]: sha256 must be 64 hex digits")
            if key in seen:
                raise CredentialError(f"{where}: tokens[{i}]: the same token appears twice")
            seen.add(key)
            entries.append((key, Identity(tenant, role, quota, sequences)))
        for name in ("quota_blocks", "quota_sequences"):
            quotas: dict[str, int] = {}
            for _, identity in entries:
                value = getattr(identity, name)
                if value is not None and quotas.setdefault(identity.tenant, value) != value:
                    raise CredentialError(f"{where}: tenant {identity.tenant!r} has two different {name}")
        return cls(entries)

    def quotas(self) -> dict[str, int]:
        """Tenant -> block quota, from the entries that name one (one value per tenant)."""
        return {identity.tenant: identity.quota_blocks for _, identity in self._entries
                if identity.quota_blocks is not None}

    def sequence_quotas(self) -> dict[str, int]:
        """Tenant -> quota of live sequences, from the entries that name one (one value per tenant)."""
        return {identity.tenant: identity.quota_sequences for _, identity in self._entries
                if identity.quota_sequences is not None}

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "TokenTable":
        raw = read_bytes(path, "tokens file")
        try:
            document = json.loads(raw)
        except ValueError as err:
            raise CredentialError(f"tokens file {path} is not JSON: {err}") from err
        return cls.from_json(document, f"tokens file {path}")

    def lookup(self, token: str) -> Optional[Identity]:
        """The identity of ``token``, or None. Every entry is compared (constant time per entry)."""
        presented = digest(token)
        found = None
        for key, identity in self._entries:
            if hmac.compare_digest(key, presented):
                found = identity
        return found


def bearer_token(metadata: Optional[Sequence[tuple[str, Union[str, bytes]]]]) -> Optional[str]:
    for key, value in metadata or ():
        if key == "authorization":
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def _deny(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    def abort(_request, context):
        context.abort(code, message)

    # No deserializer: the request's bytes are never parsed for a refused call.
    return grpc.unary_unary_rpc_method_handler(abort)


class AuthInterceptor(grpc.ServerInterceptor):
    """Checks ``authorization: Bearer TOKEN`` on every call but health and reflection.

    ``permissions`` maps a full method name (``/pkg.Service/Method``) to the roles that may call
    it; ``admin`` may call anything (``admin_role=None``: no such role). A method not listed is
    for admin only."""

    def __init__(self, tokens: TokenTable, permissions: Mapping[str, frozenset[str]],
                 admin_role: Optional[str] = "admin", open_prefixes: Sequence[str] = OPEN_PREFIXES) -> None:
        self.tokens = tokens
        self.permissions = dict(permissions)
        self.admin_role = admin_role
        self.open_prefixes = tuple(open_prefixes)
        self._unauthenticated = _deny(grpc.StatusCode.UNAUTHENTICATED,
                                      "missing or unknown credentials: send 'authorization: Bearer TOKEN'")

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(self.open_prefixes):
            return continuation(handler_call_details)
        token = bearer_token(handler_call_details.invocation_metadata)
        identity = self.tokens.lookup(token) if token else None
        if identity is None:
            return self._unauthenticated
        if identity.role != self.admin_role and identity.role not in self.permissions.get(method, ()):
            return _deny(grpc.StatusCode.PERMISSION_DENIED,
                         f"role {identity.role!r} may not call {method.rsplit('/', 1)[-1]}")
        return _with_identity(continuation(handler_call_details), identity)


def _with_identity(handler: Optional[grpc.RpcMethodHandler], identity: Identity):
    """``handler``, run with ``current_identity()`` answering ``identity`` (unary requests only:
    every method of kvpager's services is one)."""
    if handler is None or handler.unary_unary is None:
        return handler
    behavior = handler.unary_unary

    def run(request, context):
        token = _IDENTITY.set(identity)
        try:
            return behavior(request, context)
        finally:
            _IDENTITY.reset(token)

    return grpc.unary_unary_rpc_method_handler(run, request_deserializer=handler.request_deserializer,
                                               response_serializer=handler.response_serializer)


def manager_interceptor(tokens: TokenTable) -> AuthInterceptor:
    return AuthInterceptor(tokens, MANAGER_PERMISSIONS)


def worker_interceptor(manager_token: str) -> AuthInterceptor:
    """A worker's CacheWorker service: only the manager's token may call it."""
    return AuthInterceptor(TokenTable.single(manager_token, MANAGER_ROLE), {}, admin_role=MANAGER_ROLE)


# ---- TLS ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TLS:
    """PEM bytes. As a server: its certificate and key, and ``client_ca`` for mutual TLS. As a
    client: ``ca`` verifies the server; the certificate and key, when set, are its client
    certificate."""

    cert: Optional[bytes] = None
    key: Optional[bytes] = None
    client_ca: Optional[bytes] = None
    ca: Optional[bytes] = None

    @classmethod
    def load(cls, cert=None, key=None, client_ca=None, ca=None) -> "TLS":
        if (cert is None) != (key is None):
            raise CredentialError("a TLS certificate needs its key and a key its certificate (--tls-cert with --tls-key)")
        tls = cls(read_bytes(cert, "TLS certificate"), read_bytes(key, "TLS key"),
                  read_bytes(client_ca, "client CA"), read_bytes(ca, "CA certificate"))
        tls.check()
        return tls

    def check(self) -> None:
        """CredentialError naming what does not load: the certificate with its key (a key of
        another certificate, or not PEM), or a CA that is not a PEM certificate. Without this
        gRPC reports such material only as a failed bind, or at the first handshake. The pair is
        written to a private temporary directory for the ssl module, which reads only files."""
        import ssl
        import tempfile

        if self.cert is not None and self.key is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            with tempfile.TemporaryDirectory() as folder:   # 0700
                paths = []
                for name, data in (("cert.pem", self.cert), ("key.pem", self.key)):
                    path = os.path.join(folder, name)
                    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                        f.write(data)
                    paths.append(path)
                try:
                    context.load_cert_chain(*paths, password=lambda: b"")
                except ssl.SSLError as err:
                    raise CredentialError(f"the TLS certificate and key do not load together ({_ssl_reason(err)}): "
                                          "each must be PEM, and the key the certificate's own, unencrypted") from None
        for what, pem in (("client CA", self.client_ca), ("CA certificate", self.ca)):
            if pem is not None:
                try:
                    ssl.create_default_context(cadata=pem.decode("ascii"))
                except (ssl.SSLError, ValueError) as err:   # UnicodeDecodeError is a ValueError
                    raise CredentialError(f"the {what} is not a PEM certificate ({_ssl_reason(err)})") from None

    def __repr__(self) -> str:
        return (f"TLS(cert={'set' if self.cert else 'unset'}, key={'set' if self.key else 'unset'}, "
                f"client_ca={'set' if self.client_ca else 'unset'}, ca={'set' if self.ca else 'unset'})")

    @property
    def serves(self) -> bool:
        return self.cert is not None


def _ssl_reason(err: Exception) -> str:
    return str(getattr(err, "reason", None) or err)


def server_credentials(tls: TLS) -> grpc.ServerCredentials:
    if not tls.serves:
        raise CredentialError("serving TLS needs a certificate and its key")
    tls.check()
    return grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.client_ca,
                                       require_client_auth=tls.client_ca is not None)


def add_port(server: grpc.Server, address: str, tls: Optional[TLS]) -> int:
    """Bind ``address`` with TLS when ``tls`` serves, in plaintext otherwise."""
    if tls is not None and tls.serves:
        return server.add_secure_port(address, server_credentials(tls))
    return server.add_insecure_port(address)


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _details(self, details):
        metadata = [m for m in (details.metadata or ()) if m[0] != "authorization"] + [self.header]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


@dataclasses.dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: Optional[float]
    metadata: Optional[list]
    credentials: Optional[grpc.CallCredentials]
    wait_for_ready: Optional[bool]
    compression: Optional[grpc.Compression]


def raw_channel(target: str, ca: Optional[bytes] = None, cert: Optional[bytes] = None,
                key: Optional[bytes] = None, options: Sequence = ()) -> grpc.Channel:
    """A TLS channel when ``ca`` is given (with a client certificate when ``cert``/``key`` are),
    else a plaintext one."""
    if ca is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        return grpc.secure_channel(target, creds, options=list(options))
    return grpc.insecure_channel(target, options=list(options))


def with_token(channel: grpc.Channel, token: Optional[str]) -> grpc.Channel:
    """``channel``, sending ``authorization: Bearer token`` on every call when a token is given."""
    return grpc.intercept_channel(channel, _TokenInterceptor(token)) if token else channel


def channel(target: str, tls: Optional[TLS] = None, token: Optional[str] = None) -> grpc.Channel:
    """A channel to ``target``: TLS when ``tls.ca`` is set (``tls.cert``/``key`` as the client
    certificate), sending ``token`` on every call when given."""
    tls = tls or TLS()
    return with_token(raw_channel(target, tls.ca, tls.cert, tls.key), token)


@dataclasses.dataclass(frozen=True)
class WorkerCredentials:
    """What a cache worker needs in a secured deployment (PEM bytes and token strings, so a Ray
    actor gets them with its configuration). ``tls``: its server certificate and key (also its
    client certificate towards the manager), ``client_ca`` for mutual TLS on its CacheWorker
    service, ``ca`` to verify the manager. ``auth_token``: its ``worker``-role token for
    RegisterWorker and Heartbeat. ``manager_token``: the token its CacheWorker service requires
    (the manager's --worker-service-token); None: no token check (mutual TLS, or insecure)."""

    tls: TLS = dataclasses.field(default_factory=TLS)
    auth_token: Optional[str] = None
    manager_token: Optional[str] = None

    def __repr__(self) -> str:  # never print the secrets
        return (f"WorkerCredentials(tls={'on' if self.tls.serves else 'off'}, "
                f"mutual_tls={self.tls.client_ca is not None}, manager_tls={self.tls.ca is not None}, "
                f"auth_token={'set' if self.auth_token else 'unset'}, "
                f"manager_token={'set' if self.manager_token else 'unset'})")

    def manager_channel(self, target: str) -> grpc.Channel:
        """The channel to the block manager: TLS when a CA is set, sending the worker token."""
        return channel(target, self.tls, self.auth_token)

    def interceptors(self) -> list:
        return [worker_interceptor(self.manager_token)] if self.manager_token else []
