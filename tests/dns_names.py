"""A DNS server of the tests' own: one name whose A records (loopback addresses) a test changes while
clients run, as a headless Kubernetes Service's name follows its ready pods. gRPC's own resolver asks
it when a target names it as its authority, ``dns://127.0.0.1:PORT/NAME:PORT``, so the mechanism a
gateway uses in a cluster (resolve a name, re-resolve when a connection closes) runs unchanged,
with no /etc/hosts entry and no resolver of the host involved.

It answers UDP queries only (its answers are small enough never to be truncated), A records for its
name, an empty answer for the name's other types (AAAA) and NXDOMAIN for any other name."""

from __future__ import annotations

import socket
import struct
import threading

_A, _IN = 1, 1
_NXDOMAIN = 3
# A response (QR), recursion desired and available: what a stub resolver expects from its server.
_RESPONSE_FLAGS = 0x8180


class DnsNames:
    def __init__(self, name: str, addresses: list[str]):
        self.name = name.lower().rstrip(".")
        self._addresses = list(addresses)
        self._lock = threading.Lock()
        self.queries = 0
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind(("127.0.0.1", 0))
        self.server = f"127.0.0.1:{self._socket.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, name="dns-names", daemon=True)
        self._thread.start()

    def target(self, port: int) -> str:
        """The gRPC target that resolves the name through this server."""
        return f"dns://{self.server}/{self.name}:{port}"

    def set(self, addresses: list[str]) -> None:
        with self._lock:
            self._addresses = list(addresses)

    def close(self) -> None:
        self._socket.close()

    def _serve(self) -> None:
        while True:
            try:
                query, peer = self._socket.recvfrom(4096)
            except OSError:  # closed
                return
            try:
                self._socket.sendto(self._answer(query), peer)
            except (IndexError, struct.error, UnicodeDecodeError):
                continue  # not a query this server reads: a real server would drop it too
            except OSError:
                return

    def _answer(self, query: bytes) -> bytes:
        ident, _, questions = struct.unpack(">HHH", query[:6])
        if questions != 1:
            raise IndexError("one question per query")
        position, labels = 12, []
        while query[position]:
            length = query[position]
            labels.append(query[position + 1 : position + 1 + length].decode("ascii"))
            position += 1 + length
        qtype, qclass = struct.unpack(">HH", query[position + 1 : position + 5])
        question = query[12 : position + 5]
        with self._lock:
            self.queries += 1
            addresses = list(self._addresses)
        records = []
        if ".".join(labels).lower() != self.name:
            flags = _RESPONSE_FLAGS | _NXDOMAIN
        else:
            flags = _RESPONSE_FLAGS
            if qtype == _A and qclass == _IN:
                # A pointer to the question's name (offset 12), TTL 0: clients must not cache it.
                records = [b"\xc0\x0c" + struct.pack(">HHIH", _A, _IN, 0, 4) + socket.inet_aton(a) for a in addresses]
        return struct.pack(">HHHHHH", ident, flags, 1, len(records), 0, 0) + question + b"".join(records)
