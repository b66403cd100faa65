"""POST /tokenize and /detokenize (vLLM's paths and fields): the gateway's Tokenize and
Detokenize over HTTP, with the completions' body bounds, authentication, admission, counting and
errors (http_front.py).

    POST /tokenize    {"messages": [...]}  (the chat template, as /v1/chat/completions)
                      {"prompt": "..."}    (as text, as /v1/completions)
                      -> {"count": n, "max_model_len": max_seq_len, "tokens": [...]}
    POST /detokenize  {"tokens": [...]}    -> {"prompt": "..."}
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from pardec.gateway.http_front import OpenAIFront, _Generation
from pardec.gateway.openai_api import chat_request, completion_request, detokenize_request


def add_routes(front: OpenAIFront) -> None:
    """Serves the two paths on ``front``'s app."""

    async def tokenize(request):
        return Tokenization(front, detokenize=False)

    async def detokenize(request):
        return Tokenization(front, detokenize=True)

    front.app.add_route("/tokenize", tokenize, methods=["POST"])
    front.app.add_route("/detokenize", detokenize, methods=["POST"])


class Tokenization(_Generation):
    generates = False  # a refusal is answered, with no span or log line (nor has its answer)

    def __init__(self, front: OpenAIFront, detokenize: bool):
        super().__init__(front, "Detokenize" if detokenize else "Tokenize", chat=False)
        self.detokenize = detokenize

    async def _run(self, body: dict[str, Any], tenant: str, receive, send) -> None:
        generator = self.front.generator
        model = generator.model.model_name
        if self.detokenize:
            tokens = detokenize_request(body, model)
            reply = {"prompt": await self._in_thread(generator.detokenize, tokens)}
        else:
            request = (chat_request if "messages" in body else completion_request)(body, tenant, model)
            tokens = await self._in_thread(generator.tokenize, request)
            reply = {"count": len(tokens), "max_model_len": generator.model.max_seq_len, "tokens": tokens}
        await JSONResponse(reply)({"type": "http"}, receive, self._bounded(send))
