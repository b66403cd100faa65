"""Guards around a server's handlers: which mutual-TLS identities may call an internal service.

Mutual TLS proves that a caller holds a certificate of the CA, nothing more: a tenant's client
certificate from the same CA would otherwise reach the drafter (every tenant's drafting memory)
and the verifier. ``AllowedClients`` lets through only the certificate names an internal service
is configured for (``--allowed-clients``); ``guard_handler`` is the wrapping it (and the
concurrency limit, runtime/limits.py) share.
"""

from __future__ import annotations

import hashlib
import ssl
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, ContextManager, Iterable

import grpc

from pardec.runtime.errors import ConfigError
from pardec.runtime.security import ServerTLS, is_open


def guard_handler(
    handler: grpc.RpcMethodHandler | None, around: Callable[[grpc.ServicerContext], ContextManager]
) -> grpc.RpcMethodHandler | None:
    """``handler`` with each call's behaviour run inside ``around(context)``, which may abort the
    call before it starts (streams included: the guard holds until the stream ends)."""
    if handler is None:
        return None

    def unary(behavior):
        def guarded(request, context):
            with around(context):
                return behavior(request, context)

        return guarded

    def streaming(behavior):
        def guarded(request, context):
            with around(context):
                yield from behavior(request, context)

        return guarded

    wrapped = {}
    for name, wrap in (("unary_unary", unary), ("stream_unary", unary), ("unary_stream", streaming),
                       ("stream_stream", streaming)):
        behavior = getattr(handler, name)
        if behavior is not None:
            wrapped[name] = wrap(behavior)
    return handler._replace(**wrapped)


def peer_names(context: grpc.ServicerContext) -> list[str]:
    """The names a mutual-TLS caller's certificate carries: subject CN, its alternative names,
    then "sha256:<hex>", the fingerprint of the certificate itself."""
    auth = context.auth_context()
    names = [*(auth.get("x509_common_name") or ()), *(auth.get("x509_subject_alternative_name") or ())]
    found = [name.decode(errors="replace") for name in names]
    for pem in auth.get("x509_pem_cert") or ():
        found.append(_fingerprint(pem.decode(errors="replace")))
    return found


def _fingerprint(pem: str) -> str:
    return "sha256:" + hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()


def certificate_fingerprint(cert_file: str) -> str:
    """"sha256:<hex>" of the first certificate in a PEM file: the one certificate it names, where a
    CN or an alternative name ("localhost", say) may be carried by others of the same CA too.
    (`pardec up` tells the verifier and drafters to allow its internal certificate by this.)"""
    try:
        text = Path(cert_file).read_text()
        begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
        first = text[text.index(begin):text.index(end) + len(end)]
        return _fingerprint(first)
    except (OSError, ValueError) as error:
        raise ConfigError(f"tls: cannot read a certificate in {cert_file!r}: {error}") from error


def parse_allowed_clients(value: str | None) -> tuple[str, ...]:
    """--allowed-clients NAME[,NAME...]: the certificate names (CN, alternative name, or
    "sha256:<hex>" fingerprint) allowed."""
    names = tuple(name.strip() for name in (value or "").split(",") if name.strip())
    if value is not None and not names:
        raise ConfigError("--allowed-clients: expected NAME[,NAME...] (certificate CNs or alternative names)")
    return names


class AllowedClients(grpc.ServerInterceptor):
    """Mutual TLS proves that a caller holds a certificate of the CA; this decides which of those
    identities may call: a tenant's client certificate from the same CA must not reach the
    drafter (other tenants' drafting memory) or the verifier. A certificate whose subject CN or
    one of whose alternative names is in ``names`` is let through; any other gets PERMISSION_DENIED.
    Health checking and reflection stay open for probes."""

    def __init__(self, names: Iterable[str], what: str = "this service"):
        self.names = frozenset(names)
        if not self.names:
            raise ConfigError("allowed_clients: name at least one certificate CN or alternative name")
        self._what = what

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if is_open(handler_call_details.method):
            return handler
        return guard_handler(handler, self._check)

    def _check(self, context: grpc.ServicerContext) -> ContextManager:
        names = peer_names(context)
        if not self.names.intersection(names):
            shown = ", ".join(repr(n) for n in names[:4]) or "none (no client certificate)"
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"client certificate: its names ({shown}) are not among {self._what}'s --allowed-clients",
            )
        return nullcontext()


def server_guards(tls: ServerTLS | None, allowed: Iterable[str], what: str) -> tuple[grpc.ServerInterceptor, ...]:
    """The AllowedClients interceptor of an internal service's flags (none when no names are
    given); names without mutual TLS cannot be checked, so that is a configuration error."""
    names = tuple(allowed)
    if not names:
        return ()
    if tls is None or not tls.mutual:
        raise ConfigError("--allowed-clients: needs mutual TLS (--tls-cert, --tls-key and --tls-client-ca)")
    return (AllowedClients(names, what),)


def certificate_name(cert_file: str) -> str:
    """The name a certificate is known by: its subject CN, else its first DNS alternative name.
    (`pardec up` tells the verifier and drafters to allow its internal certificate by this name.)"""
    try:
        decoded = ssl._ssl._test_decode_cert(cert_file)  # the stdlib's own PEM reader; no extra package
    except (OSError, ssl.SSLError, AttributeError) as error:
        raise ConfigError(f"tls: cannot read the names of {cert_file!r}: {error}") from error
    for rdn in decoded.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    for kind, value in decoded.get("subjectAltName", ()):
        if kind == "DNS":
            return value
    raise ConfigError(f"tls: {cert_file!r} has neither a subject CN nor a DNS alternative name")


def add_allowed_clients_flag(parser, what: str) -> None:
    parser.add_argument(
        "--allowed-clients", metavar="NAME[,NAME...]",
        help=f"with mutual TLS: only client certificates with one of these names (subject CN, alternative "
             f"name, or sha256:<hex> of the certificate) may call {what}; others get PERMISSION_DENIED "
             f"(default: any certificate of --tls-client-ca)",
    )  # fmt: skip
