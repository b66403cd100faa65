"""Errors every service raises from its protobuf-free core, each bound to one gRPC status.

The servicers only translate: a core raises ``InvalidArgument("max_new_tokens: ...")`` and the
client sees INVALID_ARGUMENT with that message. Messages name the field and the rule broken.
"""

from __future__ import annotations

import grpc


# Messages quote the client's values (session ids, names). gRPC drops a status whose details
# pass its 16 KiB metadata limit and reports RESOURCE_EXHAUSTED instead, so a quote is cut.
MAX_MESSAGE_CHARS = 1000


class PardecError(Exception):
    """Base class; ``status`` is the gRPC status the error maps to."""

    status: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str = ""):
        if len(message) > MAX_MESSAGE_CHARS:
            message = f"{message[:MAX_MESSAGE_CHARS]}... ({len(message)} characters)"
        super().__init__(message)

    def reworded(self, message: str) -> "PardecError":
        """The same error (its class, its status) with another message: a field renamed as the
        API the client called names it. Subclasses with state of their own keep it."""
        copy = type(self).__new__(type(self))
        copy.__dict__.update(self.__dict__)
        PardecError.__init__(copy, message)
        return copy


class InvalidArgument(PardecError):
    status = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(PardecError):
    status = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(PardecError):
    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(PardecError):
    status = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(PardecError):
    status = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(PardecError):
    status = grpc.StatusCode.UNAUTHENTICATED


class ConfigError(ValueError):
    """A configuration that breaks a rule; raised at startup, never mid-request."""
