"""GET /health (and Amazon SageMaker's probe, GET or POST /ping) and GET /version on the
gateway's HTTP API, open without a token (probes). The probes are 200 while the gateway can
serve, and 503 while none of its verifier replicas does or it is shutting down
(gateway/backend_health.py), as its gRPC health reports NOT_SERVING then."""

from __future__ import annotations

import importlib.metadata

from starlette.responses import JSONResponse

from pardec.gateway.backend_health import BackendWatch
from pardec.gateway.http_front import OpenAIFront


def add_routes(front: OpenAIFront, watch: BackendWatch | None) -> None:
    """Serves the paths on ``front``'s app; without a ``watch``, /health is 200 while the process serves."""

    async def health(request):
        unavailable = watch is not None and watch.unavailable  # what it is goes to the log, not to anyone who asks
        return JSONResponse({"status": "unavailable"}, 503) if unavailable else JSONResponse({"status": "ok"})

    async def version(request):
        return JSONResponse({"version": importlib.metadata.version("pardec")})

    front.app.add_route("/health", health, methods=["GET"])
    front.app.add_route("/ping", health, methods=["GET", "POST"])
    front.app.add_route("/version", version, methods=["GET"])
