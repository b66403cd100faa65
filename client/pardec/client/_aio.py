"""The asyncio client: Client's methods as coroutines, over grpc.aio."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from pardec.client import _wire
from pardec.client._sync import DEFAULT_TARGET
from pardec.client._types import Chunk, GenerateOptions, MessageLike, Reply, ServedModel
from pardec.v1 import gateway_pb2, gateway_pb2_grpc

if TYPE_CHECKING:
    from typing_extensions import Unpack


class AsyncClient:
    """Client for asyncio code; create it inside the event loop that uses it, preferably as
    ``async with AsyncClient(...) as client``. The arguments are Client's."""

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
        self._channel = grpc.aio.insecure_channel(target) if creds is None else grpc.aio.secure_channel(target, creds)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._call = _wire.call_options(token, timeout, wait_for_ready)

    async def generate(
        self, prompt: str | None = None, *, messages: Iterable[MessageLike] | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Reply:
        """The completion of one user message (``prompt``), or of a conversation (``messages``)."""
        request_id = options.pop("request_id", None)
        request = _wire.build_request(prompt, messages, **options)
        try:
            return _wire.reply(await self._stub.Generate(request, **_wire.with_request_id(self._call, request_id)))
        except grpc.RpcError as error:
            raise _wire.error(error) from None

    async def chat(self, messages: Iterable[MessageLike], **options: Unpack[GenerateOptions]) -> Reply:
        """The next assistant message of a conversation."""
        return await self.generate(messages=messages, **options)

    def stream(
        self, prompt: str | None = None, *, messages: Iterable[MessageLike] | None = None,
        **options: Unpack[GenerateOptions],
    ) -> AsyncIterator[Chunk]:
        """generate's reply as the tokens are committed: ``async for chunk in client.stream(...)``."""
        # Built here, not in the generator, so that a bad argument raises at the call.
        request_id = options.pop("request_id", None)
        return self._chunks(_wire.build_request(prompt, messages, **options), request_id)

    async def _chunks(self, request: gateway_pb2.GenerateRequest, request_id: str | None = None) -> AsyncIterator[Chunk]:
        call = self._stub.GenerateStream(request, **_wire.with_request_id(self._call, request_id))
        try:
            async for response in call:
                yield _wire.chunk(response)
        except grpc.RpcError as error:
            raise _wire.error(error) from None
        finally:
            # A caller that stops reading early ends the generation on the server too.
            call.cancel()

    async def tokenize(
        self, prompt: str | None = None, *, messages: Iterable[MessageLike] | None = None, raw: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """The tokens generate would send the model for this input (the chat template, with its
        variables, and the tools unless raw)."""
        request = _wire.tokenize_request(prompt, messages, raw, tools, chat_template_kwargs, continue_final_message)
        try:
            reply = await self._stub.Tokenize(request, **self._call)
        except grpc.RpcError as error:
            raise _wire.error(error) from None
        return list(reply.token_ids)

    async def detokenize(self, token_ids: Iterable[int]) -> str:
        """The text of ``token_ids``, as generate decodes its output."""
        try:
            reply = await self._stub.Detokenize(gateway_pb2.DetokenizeRequest(token_ids=list(token_ids)), **self._call)
        except grpc.RpcError as error:
            raise _wire.error(error) from None
        return reply.text

    async def served_model(self) -> ServedModel:
        """The model the gateway serves, its limits and its parallel decoding."""
        try:
            served = await self._stub.GetServedModel(gateway_pb2.GetServedModelRequest(), **self._call)
        except grpc.RpcError as error:
            raise _wire.error(error) from None
        return _wire.served_model(served)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
