"""What the HTTP API answers beyond its routes: browsers' cross-origin calls (CORS) and request
ids, under vLLM's flag names.

A page in a browser may call the API only from an origin named in ``allowed_origins`` (none by
default, as TGI's default: any site the user visits could otherwise use a server on their
machine, and read its answers). The browser's preflight (``OPTIONS`` with
``Access-Control-Request-Method``) is answered before routes and tokens, as it carries no token;
the call itself then needs one as any other. With ``request_id_headers`` every response carries
``X-Request-Id``: the request's own, else a new one (vLLM's ``--enable-request-id-headers``),
and pages of an allowed origin may read it.

    >>> options = HttpOptions.from_flags(allowed_origins='["http://localhost:3000"]')
    >>> options.allowed_origins, options.allowed_methods
    (('http://localhost:3000',), ('*',))
    >>> HttpOptions.from_flags(allowed_origins="http://localhost:3000/")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pardec.runtime.errors.ConfigError: --allowed-origins: 'http://localhost:3000/' must be ... with no path ...
"""

from __future__ import annotations

import argparse
import json
import re
import uuid
from dataclasses import dataclass

from pardec.runtime.errors import ConfigError
from pardec.runtime.tracing import request_id_of, trace_of

ANY = "*"
# An Origin as browsers send it: a scheme (http, https, an app's own: tauri, chrome-extension), a
# host, maybe a port; nothing after.
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://(\[[0-9a-f:.]+\]|[a-z0-9_.~-]+)(:[0-9]{1,5})?", re.IGNORECASE)
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP method or header name (RFC 9110's token)
REQUEST_ID = b"x-request-id"


@dataclass(frozen=True)
class HttpOptions:
    # Origins whose pages may call the API from a browser: "*" any, () none.
    allowed_origins: tuple[str, ...] = ()
    # What those pages may send: methods and request headers ("*" any).
    allowed_methods: tuple[str, ...] = (ANY,)
    allowed_headers: tuple[str, ...] = (ANY,)
    # Whether those pages' calls may carry the browser's cookies and HTTP authentication.
    allow_credentials: bool = False
    # Every response carries X-Request-Id: the request's own, else a new one.
    request_id_headers: bool = False

    def __post_init__(self) -> None:
        for origin in self.allowed_origins:
            if origin != ANY and not _ORIGIN.fullmatch(origin):
                raise ConfigError(f"--allowed-origins: {origin!r} must be '*' or SCHEME://HOST[:PORT], with no path "
                                  "(a browser's Origin header has none)")
        # As browsers write an Origin, and methods as they send them: compared exactly, nothing else matches.
        object.__setattr__(self, "allowed_origins", tuple(_as_sent(origin) for origin in self.allowed_origins))
        object.__setattr__(self, "allowed_methods", tuple(method.upper() for method in self.allowed_methods))
        if not self.allowed_origins and (self.allowed_methods, self.allowed_headers) != ((ANY,), (ANY,)):
            raise ConfigError("--allowed-methods, --allowed-headers: only with --allowed-origins (no page may call "
                              "from another origin without it)")
        for flag, names in (("--allowed-methods", self.allowed_methods), ("--allowed-headers", self.allowed_headers)):
            if not names:
                raise ConfigError(f"{flag}: must name at least one (or '*')")
            for name in names:
                if not _TOKEN.fullmatch(name):
                    raise ConfigError(f"{flag}: {name!r} is not an HTTP token")
        if self.allow_credentials and ANY in self.allowed_origins:
            raise ConfigError("--allow-credentials: not with --allowed-origins '*' (any site could call with the "
                              "browser's credentials); name the origins")

    @classmethod
    def from_flags(cls, allowed_origins: str = "", allowed_methods: str = ANY, allowed_headers: str = ANY,
                   allow_credentials: bool = False, request_id_headers: bool = False) -> "HttpOptions":
        """From the flags' text: each list a JSON array (as vLLM takes them) or comma-separated."""
        return cls(_names("--allowed-origins", allowed_origins), _names("--allowed-methods", allowed_methods),
                   _names("--allowed-headers", allowed_headers), allow_credentials, request_id_headers)

    def flags(self) -> list[str]:
        """The command-line flags that give these options (`pardec up` passes them to its gateway)."""
        out = ["--allowed-origins", json.dumps(list(self.allowed_origins)),
               "--allowed-methods", json.dumps(list(self.allowed_methods)),
               "--allowed-headers", json.dumps(list(self.allowed_headers))]
        out += ["--allow-credentials"] if self.allow_credentials else []
        return out + (["--enable-request-id-headers"] if self.request_id_headers else [])

    def wrap(self, app):
        """``app`` answering browsers' cross-origin calls and request ids as these options say."""
        if self.allowed_origins:
            from starlette.middleware.cors import CORSMiddleware

            app = CORSMiddleware(app, allow_origins=list(self.allowed_origins), allow_methods=list(self.allowed_methods),
                                 allow_headers=list(self.allowed_headers), allow_credentials=self.allow_credentials,
                                 expose_headers=["X-Request-Id"] if self.request_id_headers else [])
        return _RequestIds(app) if self.request_id_headers else app  # outside: preflights get an id too


def _as_sent(origin: str) -> str:
    """An origin as a browser's Origin header writes it: scheme and host in lower case, no
    default port.

    >>> _as_sent("HTTPS://Chat.Example:443"), _as_sent("http://localhost:3000")
    ('https://chat.example', 'http://localhost:3000')
    """
    origin = origin.lower()
    for scheme, port in (("http://", ":80"), ("https://", ":443")):
        if origin.startswith(scheme) and origin.endswith(port):
            return origin[: -len(port)]
    return origin


def _names(flag: str, text: str) -> tuple[str, ...]:
    text = text.strip()
    if text.startswith("["):
        try:
            names = json.loads(text)
        except ValueError as error:
            raise ConfigError(f"{flag}: not a JSON array of strings ({error})") from None
        if not all(isinstance(name, str) for name in names):
            raise ConfigError(f"{flag}: not a JSON array of strings")
    else:
        names = text.split(",") if text else []
    return tuple(name.strip() for name in names if name.strip())


class _RequestIds:
    """ASGI: the response's X-Request-Id is the request's own (runtime/tracing.py's rule), else a
    new one, which the request then carries as if its client had sent it (its log line and span
    say the id the client reads)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers", ())
        request_id = request_id_of(trace_of(headers)).encode()
        if not request_id:
            request_id = uuid.uuid4().hex.encode()
            scope = {**scope, "headers": [*(pair for pair in headers if pair[0] != REQUEST_ID), (REQUEST_ID, request_id)]}

        async def with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(key, value) for key, value in message.get("headers", ()) if key.lower() != REQUEST_ID]
                message = {**message, "headers": [*headers, (REQUEST_ID, request_id)]}
            await send(message)

        await self.app(scope, receive, with_id)


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    """The HTTP API's options as flags (the gateway's and `pardec up`'s)."""
    parser.add_argument("--allowed-origins", default="", metavar="ORIGINS",
                        help="origins whose browser pages may call the HTTP API (CORS): a JSON array or a comma list "
                             "of SCHEME://HOST[:PORT], or '*' (default: none)")
    parser.add_argument("--allowed-methods", default=ANY, metavar="METHODS",
                        help="methods those pages may use (default '*')")
    parser.add_argument("--allowed-headers", default=ANY, metavar="HEADERS",
                        help="request headers those pages may send (default '*')")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="those pages' calls may carry the browser's cookies and HTTP authentication")
    parser.add_argument("--enable-request-id-headers", action="store_true",
                        help="every HTTP response carries X-Request-Id: the request's own, else a new one")


def http_options_from_flags(args: argparse.Namespace) -> HttpOptions:
    return HttpOptions.from_flags(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                                  args.allow_credentials, args.enable_request_id_headers)
