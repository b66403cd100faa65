"""How every benchmark starts what it measures: one launcher, and the server modes it names.

`launch` starts the whole stack as `pardec up` does (Redis, verifier, drafters, gateway as
processes, gateway/stack.py's `Stack`), configured by the config.json a MindIE user would write,
or Redis alone for the benchmarks that run the verifier or the drafter in their own process. One
launcher keeps every benchmark's stack the same as the product's, however it is configured.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import grpc

from pardec.drafter.redis_server import RedisServer
from pardec.runtime.draft_params import DraftParams
from pardec.gateway.mindie import load_mindie_config
from pardec.gateway.stack import Stack
from pardec.runtime.serving import CHANNEL_OPTIONS
from pardec.v1 import gateway_pb2, gateway_pb2_grpc

# name -> MindIE plugin_params of the server's configuration.
MODES = {
    "md16": {"plugin_type": "memory_decoding", "decoding_length": 16},
    "md8": {"plugin_type": "memory_decoding", "decoding_length": 8},
    "md4": {"plugin_type": "memory_decoding", "decoding_length": 4},
    "md16-dynamic": {"plugin_type": "memory_decoding", "decoding_length": 16, "dynamic_algo": True},
    "la-4-5-5": {"plugin_type": "la", "level": 4, "window": 5, "guess_set_size": 5},
    "la-5-3-3": {"plugin_type": "la", "level": 5, "window": 3, "guess_set_size": 3},
}
# A mode name's suffixes, in any order: the same plugin_params, with the shared drafting memory,
# drafted in the gateway's own process instead of by a drafter replica (`pardec up --drafters 0`),
# and with drafting ahead on or off whatever the device (the gateway's --overlap-drafting).
SHARED, EMBEDDED, OVERLAP, SERIAL = "+shared", "+embedded", "+overlap", "+serial"
SUFFIXES = (SHARED, EMBEDDED, OVERLAP, SERIAL)


def split_mode(mode: str) -> tuple[str, frozenset[str]]:
    """A mode name's base mode and its suffixes; ValueError names what is unknown.

    >>> split_mode("md16+embedded+shared") == ("md16", {EMBEDDED, SHARED})
    True
    >>> split_mode("md16+fast")
    Traceback (most recent call last):
    ...
    ValueError: md16+fast: unknown suffix +fast (suffixes: +shared, +embedded, +overlap, +serial)
    """
    base, *rest = mode.split("+")
    suffixes = frozenset("+" + name for name in rest)
    if base not in MODES:
        raise ValueError(f"{mode}: unknown mode {base} (modes: {', '.join(MODES)})")
    unknown = sorted(suffixes - set(SUFFIXES))
    if unknown:
        raise ValueError(f"{mode}: unknown suffix {unknown[0]} (suffixes: {', '.join(SUFFIXES)})")
    if {OVERLAP, SERIAL} <= suffixes:
        raise ValueError(f"{mode}: {OVERLAP} and {SERIAL} exclude each other")
    return base, suffixes


def plugin_params(mode: str) -> dict:
    """The plugin_params of a mode name, with suffixes or not.

    >>> plugin_params("md16+shared") == MODES["md16"]
    True
    """
    return MODES[split_mode(mode)[0]]


def mindie_config(plugin_params: dict) -> dict:
    """The config.json a MindIE user would write for this mode (bundled model)."""
    params = DraftParams(**plugin_params)
    return {"BackendConfig": {"ModelDeployConfig": {
        "maxSeqLen": 4096, "maxInputTokenLen": 3072, "truncation": False,
        "speculationGamma": params.tokens_per_step,
        "ModelConfig": [{"modelName": "SmolLM2-135M-Instruct", "plugin_params": json.dumps(plugin_params)}],
    }}}


@dataclass(frozen=True)
class Local:
    """What `launch` started for a benchmark that runs the verifier in its own process: Redis, and
    a drafter server in this process when asked for ("" otherwise)."""

    redis_url: str
    drafter_address: str = ""


@contextmanager
def launch(workdir: Path, plugin_params: dict | None = None, *, shared_memory: bool = False, drafters: int = 1,
           device: str = "cpu", drafter_in_process: bool = False, verifier_flags: tuple[str, ...] = (),
           http: bool = False, gateway_flags: tuple[str, ...] = ()) -> Iterator[Stack | Local]:
    """With ``plugin_params``: the whole stack serving them, its config.json in ``workdir``, the
    verifier's model on ``device`` (``shared_memory`` and ``drafters`` as `Stack` takes them);
    yields the started `Stack`. Without: a private Redis alone, and with ``drafter_in_process``
    a drafter gRPC server on it in this process; yields a `Local`. ``http``: the gateway's
    OpenAI-compatible HTTP API too (`Stack.http_address`). Everything stops on exit."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if plugin_params is None:
        with RedisServer(workdir / "redis") as redis_server:
            if not drafter_in_process:
                yield Local(redis_server.url)
                return
            from pardec.drafter.config import DrafterConfig
            from pardec.drafter.service import DrafterServicer
            from pardec.runtime.serving import start_server

            servicer = DrafterServicer(DrafterConfig(redis_url=redis_server.url))
            server, address = start_server([servicer.add_to], "127.0.0.1:0")
            try:
                yield Local(redis_server.url, address)
            finally:
                server.stop(None)
        return
    config_path = workdir / "config.json"
    config_path.write_text(json.dumps(mindie_config(plugin_params)))
    stack = Stack(workdir, load_mindie_config(str(config_path)), gateway_addr="127.0.0.1:0",
                  config_path=str(config_path), log_level="WARNING", shared_memory=shared_memory,
                  drafters=drafters, device=device, verifier_flags=verifier_flags,
                  http_addr="127.0.0.1:0" if http else None, gateway_flags=gateway_flags).start()
    try:
        yield stack
    finally:
        stack.stop()


def launch_mode(workdir: Path, mode: str, device: str = "cpu"):
    """`launch` for a mode name of MODES with its suffixes (SUFFIXES)."""
    _, suffixes = split_mode(mode)
    overlap = ("--overlap-drafting", "on") if OVERLAP in suffixes else ()
    overlap = ("--overlap-drafting", "off") if SERIAL in suffixes else overlap
    return launch(workdir, plugin_params(mode), shared_memory=SHARED in suffixes,
                  drafters=0 if EMBEDDED in suffixes else 1, device=device, gateway_flags=overlap)


@contextmanager
def gateway_stub(stack: Stack) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    """A client of the stack's gateway, its channel closed on exit."""
    with grpc.insecure_channel(stack.gateway_address, options=CHANNEL_OPTIONS) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def request(prompt: str, plain: bool, max_new_tokens: int, draft=None) -> gateway_pb2.GenerateRequest:
    """A Generate request, plain or in the server's parallel mode (``draft``: the request's lower limits)."""
    mode = gateway_pb2.DECODING_MODE_PLAIN if plain else gateway_pb2.DECODING_MODE_DEFAULT
    return gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, decoding=mode, draft=draft)
