"""The blocking client."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from pardec.client import _wire
from pardec.client._types import Chunk, GenerateOptions, MessageLike, Reply, ServedModel
from pardec.v1 import gateway_pb2, gateway_pb2_grpc

if TYPE_CHECKING:
    from typing_extensions import Unpack

DEFAULT_TARGET = "127.0.0.1:50051"


class Client:
    """A pardec gateway over one gRPC channel; safe to share between threads.

    ``token`` is sent as a bearer token; ``tls`` (or any of the TLS files) connects over TLS,
    ``tls_ca`` being the CA the gateway's certificate must chain to (default: the system's roots)
    and ``tls_cert``/``tls_key`` the client certificate of mutual TLS. ``timeout`` (seconds)
    bounds every call; ``wait_for_ready`` waits for a gateway that is still starting instead
    of failing with UNAVAILABLE. Failed calls raise PardecError.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        token: str | None = None,
        tls: bool = False,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ):
        creds = _wire.credentials(tls, tls_ca, tls_cert, tls_key)
        self._channel = grpc.insecure_channel(target) if creds is None else grpc.secure_channel(target, creds)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._call = _wire.call_options(token, timeout, wait_for_ready)

    def generate(
        self, prompt: str | None = None, *, messages: Iterable[MessageLike] | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Reply:
        """The completion of one user message (``prompt``), or of a conversation (``messages``)."""
        request_id = options.pop("request_id", None)
        request = _wire.build_request(prompt, messages, **options)
        try:
            return _wire.reply(self._stub.Generate(request, **_wire.with_request_id(self._call, request_id)))
        except grpc.RpcError as error:
            raise _wire.error(error) from None

    def chat(self, messages: Iterable[MessageLike], **options: Unpack[GenerateOptions]) -> Reply:
        """The next assistant message of a conversation."""
        return self.generate(messages=messages, **options)

    def stream(
        self, prompt: str | None = None, *, messages: Iterable[MessageLike] | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Iterator[Chunk]:
        """generate's reply as the tokens are committed, one chunk per step."""
        # Built here, not in the generator, so that a bad argument raises at the call.
        request_id = options.pop("request_id", None)
        return self._chunks(_wire.build_request(prompt, messages, **options), request_id)

    def _chunks(self, request: gateway_pb2.GenerateRequest, request_id: str | None = None) -> Iterator[Chunk]:
        call = self._stub.GenerateStream(request, **_wire.with_request_id(self._call, request_id))
        try:
            for response in call:
                yield _wire.chunk(response)
        except grpc.RpcError as error:
            raise _wire.error(error) from None
        finally:
            # A caller that stops reading early ends the generation on the server too.
            call.cancel()

    def tokenize(
        self, prompt: str | None = None, *, messages: Iterable[MessageLike] | None = None, raw: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """The tokens generate would send the model for this input (the chat template, with its
        variables, and the tools unless raw)."""
        request = _wire.tokenize_request(prompt, messages, raw, tools, chat_template_kwargs, continue_final_message)
        try:
            reply = self._stub.Tokenize(request, **self._call)
        except grpc.RpcError as error:
            raise _wire.error(error) from None
        return list(reply.token_ids)

    def detokenize(self, token_ids: Iterable[int]) -> str:
        """The text of ``token_ids``, as generate decodes its output."""
        try:
            reply = self._stub.Detokenize(gateway_pb2.DetokenizeRequest(token_ids=list(token_ids)), **self._call)
        except grpc.RpcError as error:
            raise _wire.error(error) from None
        return reply.text

    def served_model(self) -> ServedModel:
        """The model the gateway serves, its limits and its parallel decoding."""
        try:
            return _wire.served_model(self._stub.GetServedModel(gateway_pb2.GetServedModelRequest(), **self._call))
        except grpc.RpcError as error:
            raise _wire.error(error) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
