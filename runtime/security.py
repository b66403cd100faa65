"""Transport security and caller identity, shared by the three services.

- ``ServerTLS`` / ``ClientTLS``: PEM files -> gRPC credentials. A server with a client CA
  requires every caller to present a certificate signed by it (mutual TLS).
- ``Authenticator``: who is calling the gateway. With bearer tokens configured, every call but
  health checking and reflection (probes) needs ``authorization: Bearer <token>`` and the token
  names the tenant. Without tokens but with mutual TLS, the client certificate's subject CN is
  the tenant. Without either, every caller is the same anonymous tenant ("").
- ``scoped_session_id``: a name qualified by its tenant (anonymous callers get a namespace of
  their own), so that two tenants using the same id never share (or read) each other's drafting
  memory; ``memory_scope`` checks a client's session id and scopes it by tenant and model.
- runtime/guards.py: which mutual-TLS identities may call an internal service at all.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import grpc

from pardec.runtime.errors import ConfigError, InvalidArgument, Unauthenticated

# Probes and tooling stay reachable without a token: they reveal no tenant data.
OPEN_SERVICES = (
    "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection",
)
# A tenant name becomes part of Redis keys and log lines: keep it short and plain, and free of
# the "/" that separates it from the session id (so the qualified id is unambiguous).
TENANT_NAME = re.compile(r"[A-Za-z0-9._@-]{1,48}")
_MIN_TOKEN_CHARS = 16


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"{what}: cannot read {path!r}: {error.strerror}") from error


def read_secret(path: str, what: str) -> str:
    """A password or token kept in a file (a mounted secret), without its trailing newline."""
    secret = _read(path, what).decode().rstrip("\r\n")
    if not secret:
        raise ConfigError(f"{what}: {path!r} is empty")
    return secret


@dataclass(frozen=True)
class ServerTLS:
    """What a server presents (``cert_file`` + ``key_file``, PEM) and, with ``client_ca_file``,
    the CA every client certificate must chain to (then a client without one is refused)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def __post_init__(self) -> None:
        if not self.cert_file or not self.key_file:
            raise ConfigError("tls: a server needs both a certificate (cert_file, --tls-cert) and its key (key_file, --tls-key)")
        for name in ("cert_file", "key_file", "client_ca_file"):
            _read(getattr(self, name), f"tls.{name}")  # fails at startup, not at the first call

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(_read(self.key_file, "tls.key_file"), _read(self.cert_file, "tls.cert_file"))],
            root_certificates=_read(self.client_ca_file, "tls.client_ca_file"),
            require_client_auth=self.mutual,
        )


@dataclass(frozen=True)
class ClientTLS:
    """How a client checks its server (``ca_file``; None: the system's roots) and, for mutual
    TLS, the certificate it presents (``cert_file`` + ``key_file``)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("tls: a client certificate (cert_file) and its key (key_file) go together")
        for name in ("ca_file", "cert_file", "key_file"):
            _read(getattr(self, name), f"tls.{name}")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "tls.ca_file"),
            private_key=_read(self.key_file, "tls.key_file"),
            certificate_chain=_read(self.cert_file, "tls.cert_file"),
        )


def add_server_tls_flags(parser: argparse.ArgumentParser, what: str) -> None:
    """--tls-cert, --tls-key and --tls-client-ca, the same on every service."""
    parser.add_argument("--tls-cert", help=f"PEM certificate chain of {what}: serve TLS only")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", help="PEM CA that client certificates must chain to: mutual TLS")


def server_tls_from_flags(args: argparse.Namespace) -> ServerTLS | None:
    """The ServerTLS of those flags; None (plaintext) when none is given."""
    if args.tls_cert is None and args.tls_key is None and args.tls_client_ca is None:
        return None
    return ServerTLS(args.tls_cert or "", args.tls_key or "", args.tls_client_ca)


def client_tls(ca: str | None, cert: str | None, key: str | None) -> ClientTLS | None:
    """The ClientTLS of a client's --*-tls-* flags; None (plaintext) when none is given."""
    if ca is None and cert is None and key is None:
        return None
    return ClientTLS(ca, cert, key)


def open_channel(target: str, tls: ClientTLS | None, options: Iterable[tuple] = ()) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(target, options=tuple(options))
    return grpc.secure_channel(target, tls.credentials(), options=tuple(options))


def read_tokens(pairs: Iterable[str] = (), file: str | None = None) -> dict[str, str]:
    """``{token: tenant}`` from a JSON file ``{"TOKEN": "TENANT", ...}`` and ``TENANT=TOKEN``
    pairs (the --token flag)."""
    tokens: dict[str, str] = {}
    if file is not None:
        try:
            loaded = json.loads(_read(file, "tokens_file"))
        except json.JSONDecodeError as error:
            raise ConfigError(f"tokens_file: {file!r} is not JSON: {error.msg}") from error
        if not isinstance(loaded, dict):
            raise ConfigError(f'tokens_file: {file!r} must hold one object {{"TOKEN": "TENANT", ...}}')
        tokens.update(loaded)
    for pair in pairs:
        tenant, sep, token = pair.partition("=")
        if not sep:
            raise ConfigError("--token: expected TENANT=TOKEN")
        tokens[token] = tenant
    return tokens


def _digest(token: str) -> bytes:
    # Comparing fixed-length digests keeps the comparison's time independent of the token's length.
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class BearerTokens:
    """Bearer tokens, each naming a tenant. Only SHA-256 digests are kept, so neither a repr nor
    a log line can show a token."""

    digests: tuple[tuple[bytes, str], ...] = field(default=(), repr=False)

    @classmethod
    def from_mapping(cls, tokens: Mapping[str, str]) -> "BearerTokens":
        """``{token: tenant}``; one tenant may have several tokens (rotation)."""
        for token, tenant in tokens.items():
            if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
                raise ConfigError(f"tokens: tenant {tenant!r} must match {TENANT_NAME.pattern}")
            if not isinstance(token, str) or len(token) < _MIN_TOKEN_CHARS or any(c.isspace() for c in token):
                raise ConfigError(
                    f"tokens: the token of tenant {tenant!r} must be at least {_MIN_TOKEN_CHARS} characters without spaces"
                )
        return cls(tuple((_digest(token), tenant) for token, tenant in tokens.items()))

    @classmethod
    def from_sources(cls, pairs: Iterable[str] = (), file: str | None = None) -> "BearerTokens":
        return cls.from_mapping(read_tokens(pairs, file))

    def __bool__(self) -> bool:
        return bool(self.digests)

    def tenant(self, token: str) -> str | None:
        presented = _digest(token)
        found = None
        for digest, tenant in self.digests:  # no early exit: every call compares against every token
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token:
                return token.strip()
    return None


@dataclass(frozen=True)
class Authenticator:
    """Tells the tenant of a gateway call (see the module docstring for the rules)."""

    tokens: BearerTokens = field(default_factory=BearerTokens)
    # Mutual TLS without tokens: the client certificate's CN names the tenant.
    tenant_from_client_cert: bool = False

    def tenant_of_metadata(self, metadata) -> str:
        token = bearer_token(metadata)
        if token is None:
            raise Unauthenticated("authorization: a bearer token is required (metadata 'authorization: Bearer <token>')")
        tenant = self.tokens.tenant(token)
        if tenant is None:
            raise Unauthenticated("authorization: the bearer token is not valid")
        return tenant

    def tenant(self, context: grpc.ServicerContext) -> str:
        """The caller's tenant; raises Unauthenticated when it cannot be established."""
        if self.tokens:
            return self.tenant_of_metadata(context.invocation_metadata())
        if self.tenant_from_client_cert:
            names = context.auth_context().get("x509_common_name") or []
            name = names[0].decode(errors="replace") if names else ""
            if not TENANT_NAME.fullmatch(name):
                raise Unauthenticated(f"client certificate: its subject CN {name!r} must match {TENANT_NAME.pattern}")
            return name
        return ""

    def interceptors(
        self, on_refused: Callable[[str], None] = lambda method: None
    ) -> tuple[grpc.ServerInterceptor, ...]:
        """With tokens, refuses every call without a valid one, except OPEN_SERVICES: the
        gateway's API is closed by default, whatever methods it grows. ``on_refused(method)``
        hears of each refusal (the servicer never sees those calls, so it cannot count them)."""
        return (_TokenInterceptor(self, on_refused),) if self.tokens else ()


def is_open(method: str) -> bool:
    """Whether a full method name ("/package.Service/Method") belongs to OPEN_SERVICES."""
    return method.lstrip("/").rsplit("/", 1)[0] in OPEN_SERVICES


# What a refused call's deserializer returns: the body of a call that is refused anyway is never
# parsed, so a refusal costs the same for a tiny message and for one at the size limit. (None
# would make gRPC answer INTERNAL "Exception deserializing request!".)
_UNREAD = object()


def _unread(data: bytes) -> object:
    return _UNREAD


class _TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, authenticator: Authenticator, on_refused: Callable[[str], None]):
        self._authenticator = authenticator
        self._on_refused = on_refused

    def intercept_service(self, continuation, handler_call_details):
        if is_open(handler_call_details.method):
            return continuation(handler_call_details)
        try:
            self._authenticator.tenant_of_metadata(handler_call_details.invocation_metadata)
        except Unauthenticated as error:
            handler = continuation(handler_call_details)
            # Counted under the method's own name only when the method exists: a caller who
            # makes up names must not make up metric series.
            self._on_refused(handler_call_details.method.rsplit("/", 1)[-1] if handler is not None else "unknown")
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, str(error))
        return continuation(handler_call_details)


_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _refusal(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers ``code`` without parsing the body."""

    def refuse(request_or_iterator, context):
        context.abort(code, message)

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(refuse, _unread)
    make = _MAKERS[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, _unread, handler.response_serializer)


# Anonymous callers' namespace: "~" is outside TENANT_NAME, so no tenant can be called that, and
# an anonymous gateway sharing Redis with a token gateway cannot address a tenant's keys.
ANONYMOUS = "~anonymous"
# A client's session id: plain characters, no "/" (the separator of the scope) and no braces (Redis
# Cluster hash tags); short enough that tenant, model and id stay within the drafter's limits.
SESSION_ID = re.compile(r"[A-Za-z0-9._:@-]{1,100}")
_MODEL_NAME = re.compile(r"[A-Za-z0-9._@-]{1,48}")


def scoped_session_id(tenant: str, session_id: str) -> str:
    """The name sent downstream: ``tenant/session_id``, anonymous callers under ANONYMOUS (tenant
    names hold no "/", so two tenants never map to the same name); "" for no session."""
    return f"{tenant or ANONYMOUS}/{session_id}" if session_id else session_id


def model_scope(model_name: str) -> str:
    """The model's part of a memory's name: the name itself when it is short and plain, else a
    digest of it (a Hugging Face id holds "/", a path may be long)."""
    if _MODEL_NAME.fullmatch(model_name):
        return model_name
    return "model-" + hashlib.sha256(model_name.encode()).hexdigest()[:16]


def check_session_id(session_id: str) -> str:
    """A client's session id ("" = none); INVALID_ARGUMENT naming ``session_id`` and the rule."""
    if session_id and not SESSION_ID.fullmatch(session_id):
        shown = session_id if len(session_id) <= 80 else f"{session_id[:80]}..."
        raise InvalidArgument(
            f"session_id: {shown!r} ({len(session_id)} characters) must be 1 to 100 of A-Z a-z 0-9 . _ : @ -"
        )
    return session_id


def memory_scope(tenant: str, model_name: str, session_id: str) -> str:
    """A conversation's drafting memory: ``tenant/model/session_id`` after checking the client's
    id, so that neither another tenant nor another model's gateway on the same Redis shares it;
    "" for no session."""
    check_session_id(session_id)
    return scoped_session_id(tenant, f"{model_scope(model_name)}/{session_id}") if session_id else ""


MAX_CACHE_SALT_CHARS = 256


def cache_scope(tenant: str, salt: str = "") -> str:
    """Who may share a request's cached prompt blocks (the verifier's PrefillRequest.cache_scope):
    requests of its tenant and, with a `salt` (vLLM's cache_salt: a tenant keeping its users
    apart), only those with the same salt. "~" is outside TENANT_NAME, so a salted scope is never
    a tenant's own, and its length stays bounded whatever the salt.

    >>> cache_scope("acme"), cache_scope("acme", "alice") == cache_scope("acme", "alice") != cache_scope("acme", "bob")
    ('acme', True)
    """
    if not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument(f"cache_salt: must be a string of at most {MAX_CACHE_SALT_CHARS} characters")
    if not salt:
        return tenant
    return f"{tenant}~{hashlib.sha256(salt.encode()).hexdigest()[:32]}"
