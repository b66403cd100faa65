"""Amazon SageMaker's POST /invocations on the gateway's HTTP API (its health probe, /ping, is
http_health.py's), where SageMaker sends every request whatever its API. As vLLM serves it, the
body says which: one with `messages` is a chat completion, else one with `prompt` a completion, each
then exactly as on its own path (bounds, authentication, admission, counting, deadlines, errors;
http_front.py), streamed when the body asks."""

from __future__ import annotations

from typing import Any

from pardec.gateway.http_front import OpenAIFront, _Generation
from pardec.runtime.errors import InvalidArgument


def add_routes(front: OpenAIFront) -> None:
    """Serves the paths on ``front``'s app."""

    async def invocations(request):
        return Invocation(front)

    front.app.add_route("/invocations", invocations, methods=["POST"])


class Invocation(_Generation):
    def __init__(self, front: OpenAIFront):
        super().__init__(front, "Invocations", chat=True)

    async def _run(self, body: dict[str, Any], tenant: str, receive, send) -> None:
        if "messages" not in body and "prompt" not in body:
            raise InvalidArgument("body: /invocations takes a chat completion's body (with messages) or a "
                                  "completion's (with prompt)")
        self.chat = "messages" in body  # a body with both is a chat's, as vLLM reads it
        await super()._run(body, tenant, receive, send)
