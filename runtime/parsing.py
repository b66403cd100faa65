"""Requests that do not parse get INVALID_ARGUMENT naming the field, not gRPC's INTERNAL.

gRPC Python answers a request its deserializer cannot parse with INTERNAL ("Exception
deserializing request!"), although the fault is the caller's: invalid UTF-8 in a string field
(protobuf refuses it for proto3 strings), a truncated message, a field of the wrong wire type.
``add_servicer`` registers a servicer as the generated ``add_*Servicer_to_server`` does, but its
deserializers hand such bytes on as ``Malformed`` and its methods answer that with
INVALID_ARGUMENT and a message that names the offending field.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

# Wire types (protobuf encoding): varint, 64-bit, length-delimited, 32-bit.
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5
_INDEXED = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE)


@dataclass(frozen=True)
class Malformed:
    """Stands in for a request that did not parse; ``reason`` names the field."""

    reason: str


def add_servicer(server: grpc.Server, servicer, service) -> None:
    """Registers every method of ``service`` (a ServiceDescriptor) on ``server``, served by the
    servicer's method of the same name."""
    handlers = {}
    for method in service.methods:
        if method.client_streaming:
            raise ValueError(f"{method.full_name}: client streaming is not supported here")
        request_class = GetMessageClass(method.input_type)
        response_class = GetMessageClass(method.output_type)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            _refusing_malformed(getattr(servicer, method.name), method.server_streaming),
            request_deserializer=_parser(request_class),
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _parser(message_class):
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError:
            return Malformed(explain(message_class.DESCRIPTOR, data))

    return parse


def _refusing_malformed(behavior, streaming: bool):
    if streaming:
        def stream(request, context):
            if isinstance(request, Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            yield from behavior(request, context)

        return stream

    def unary(request, context):
        if isinstance(request, Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return behavior(request, context)

    return unary


def explain(descriptor, data: bytes) -> str:
    """Why ``data`` is not a valid ``descriptor`` message, naming the field."""
    return _problem(descriptor, data, "") or f"request: not a valid {descriptor.full_name} message"


def _problem(descriptor, data: bytes, prefix: str) -> str | None:
    """Walks the wire format and checks what protobuf checks: lengths, wire types, the UTF-8 of
    strings, nested messages and packed numbers. None when nothing is wrong."""
    position, seen = 0, {}
    while position < len(data):
        key, position = _varint(data, position)
        if key is None:
            return f"{prefix or 'request'}: truncated field key at byte {position}"
        number, wire_type = key >> 3, key & 7
        field = descriptor.fields_by_number.get(number)
        name = prefix + (field.name if field else f"field {number}")
        if field is not None and field.is_repeated and field.type in _INDEXED:  # not packed numbers
            name += f"[{seen.get(number, 0)}]"
            seen[number] = seen.get(number, 0) + 1
        if wire_type == _VARINT:
            value, position = _varint(data, position)
            if value is None:
                return f"{name}: truncated number"
        elif wire_type in (_FIXED64, _FIXED32):
            position += 8 if wire_type == _FIXED64 else 4
            if position > len(data):
                return f"{name}: truncated number"
        elif wire_type == _LENGTH_DELIMITED:
            length, position = _varint(data, position)
            if length is None or position + length > len(data):
                return f"{name}: truncated (its length runs past the end of the message)"
            value, position = data[position : position + length], position + length
            problem = _value_problem(field, value, name) if field is not None else None
            if problem:
                return problem
        else:
            return f"{name}: wire type {wire_type} is not valid"
    return None


def _value_problem(field, value: bytes, name: str) -> str | None:
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            value.decode("utf-8")
        except UnicodeDecodeError as error:
            return f"{name}: not valid UTF-8 (byte {error.start}: {value[error.start:error.start + 4]!r})"
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        return _problem(field.message_type, value, f"{name}.")
    elif field.type != FieldDescriptor.TYPE_BYTES:  # packed numbers
        position = 0
        while position < len(value):
            number, position = _varint(value, position)
            if number is None:
                return f"{name}: truncated packed numbers"
    return None


def _varint(data: bytes, position: int) -> tuple[int | None, int]:
    value, shift = 0, 0
    while position < len(data) and shift < 64:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
    return None, position
