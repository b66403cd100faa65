"""GET /metrics on the gateway's HTTP API: its Prometheus metrics (gateway/metrics.py) where
vLLM's and TGI's scrapers look for them, on the API's own port, beside the --metrics-addr
endpoint that serves the same registry. With bearer tokens configured, a scrape needs one too
(Prometheus's `authorization` setting); without, it is open, as /health is."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from pardec.gateway.http_front import OpenAIFront


def add_routes(front: OpenAIFront) -> None:
    """Serves the path on ``front``'s app."""
    registry = front.generator.metrics.registry

    async def metrics(request):
        with front._counted("Metrics") as failed:
            front._tenant(request.scope)  # refuses a missing or unknown token where tokens are configured
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
        return failed.response

    front.app.add_route("/metrics", metrics, methods=["GET"])
