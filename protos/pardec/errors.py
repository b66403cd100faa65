"""Errors every service raises from its protobuf-free core, each bound to one gRPC status.

The servicers only translate: a core raises ``InvalidArgument("max_new_tokens: ...")`` and the
client sees INVALID_ARGUMENT with that message. Messages name the field and the rule broken.
"""

from __future__ import annotations

import grpc


class PardecError(Exception):
    """Base class; ``status`` is the gRPC status the error maps to."""

    status: grpc.StatusCode = grpc.StatusCode.INTERNAL


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


class ConfigError(ValueError):
    """A configuration that breaks a rule; raised at startup, never mid-request."""
