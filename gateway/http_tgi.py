"""Text Generation Inference's routes on the gateway's HTTP API (tgi_api.py): POST /generate and
/generate_stream (server-sent events, no closing [DONE]) over the same `Generator`, with the same
body bounds, authentication, admission, counting and deadlines as the OpenAI routes
(http_front.py) and TGI's error JSON; GET /info, what TGI says of the model it serves."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from starlette.responses import JSONResponse

from pardec.gateway.http_front import OpenAIFront, _Generation
from pardec.gateway.openai_api import completion_request, streamed
from pardec.gateway.served import PLAIN
from pardec.gateway.tgi_api import TgiErrors, TgiEvents, completion_body, renamed, reply
from pardec.runtime.errors import InvalidArgument, PardecError

_ERRORS = TgiErrors()


def _version() -> str:
    try:
        return metadata.version("pardec")
    except metadata.PackageNotFoundError:
        return "unknown"


def add_routes(front: OpenAIFront) -> None:
    """Serves TGI's paths on ``front``'s app."""

    async def generate(request):
        return TgiGeneration(front, stream=False)

    async def generate_stream(request):
        return TgiGeneration(front, stream=True)

    async def root(request):  # where TGI's clients post: the body's stream says which, the reply a list
        return TgiGeneration(front, stream=None)

    async def info(request):
        with front._counted("TGIInfo", _ERRORS) as failed:
            front._tenant(request.scope)
            served = front.generator.served_model()
            return JSONResponse({
                "model_id": served.model, "model_sha": None, "model_dtype": served.quantization,
                "model_device_type": served.device, "model_pipeline_tag": "text-generation",
                "max_concurrent_requests": front.limit.limit, "max_best_of": 1, "max_stop_sequences": 16,
                "max_input_tokens": served.max_input_tokens, "max_input_length": served.max_input_tokens,
                "max_total_tokens": served.max_seq_len, "validation_workers": 1, "max_client_batch_size": 1,
                "router": "pardec", "version": _version(), "sha": None, "docker_label": None,
                "parallel_decoding": served.decoding.method})
        return failed.response

    front.app.add_route("/", root, methods=["POST"])
    front.app.add_route("/generate", generate, methods=["POST"])
    front.app.add_route("/generate_stream", generate_stream, methods=["POST"])
    front.app.add_route("/info", info, methods=["GET"])


class TgiGeneration(_Generation):
    shape = _ERRORS
    stream_end = b""  # TGI's stream ends with its last event, no [DONE]

    def __init__(self, front: OpenAIFront, stream: bool | None):
        super().__init__(front, "TGIGenerateStream" if stream else "TGIGenerate", chat=False)
        self.stream = stream  # None: as the body's stream says (POST /)

    async def _run(self, body: dict[str, Any], tenant: str, receive, send) -> None:
        generator, deadline = self.front.generator, self.deadline
        plain = generator.served_model().decoding.method == PLAIN
        stream, listed = (streamed(body), True) if self.stream is None else (self.stream, False)
        try:
            completion = completion_body(body, plain)
            if stream and (body.get("parameters") or {}).get("decoder_input_details"):  # optional, as TGI's
                raise InvalidArgument("parameters.decoder_input_details: not when streaming tokens (TGI's rule)")
            request = completion_request(completion, tenant, generator.model.model_name)
        except PardecError as error:
            raise renamed(error) from None
        # The seed drawn with, where it was the server's choice (completion_body's).
        parameters, tokenizer = {**(body.get("parameters") or {}), "seed": completion.get("seed")}, generator.model.tokenizer

        async def respond() -> None:
            if stream:
                await self._stream(generator.stream(request, deadline), TgiEvents(tokenizer, parameters, body["inputs"]),
                                   send)
            else:
                generation = await self._in_thread(generator.generate, request, deadline)
                answer = reply(generation, tokenizer, parameters, body["inputs"])
                await JSONResponse([answer] if listed else answer)({"type": "http"}, receive, self._bounded(send))

        try:
            await self._watching(receive, respond)
        except PardecError as error:
            if self.started:  # counted and answered as an event already
                raise
            raise renamed(error) from None
