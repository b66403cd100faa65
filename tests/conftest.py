"""Shared fixtures: a real redis-server and the three real gRPC services on loopback.

The services run inside the test process (so the model loads once per test session) but talk
to each other and to the tests over real sockets, each bound to port 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import grpc
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

# Without a GPU the device engine's Triton kernels run under Triton's interpreter, which Triton
# chooses when it is first imported (verifier/kernels/triton_layers.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pardec.drafter.config import DrafterConfig  # noqa: E402
from pardec.drafter.redis_server import RedisServer  # noqa: E402
from pardec.drafter.service import DrafterServicer  # noqa: E402
from pardec.gateway.config import GatewayConfig  # noqa: E402
from pardec.gateway.server import serve as serve_gateway  # noqa: E402
from pardec.gateway.server import start_gateway  # noqa: E402
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server  # noqa: E402
from pardec.v1 import drafter_pb2_grpc, gateway_pb2_grpc, verifier_pb2_grpc  # noqa: E402
from pardec.verifier.config import VerifierConfig  # noqa: E402
from pardec.verifier.loading import load_model  # noqa: E402
from pardec.verifier.model.quant import choose_kernel  # noqa: E402
from pardec.verifier.model.weights import load_checkpoint  # noqa: E402
from pardec.verifier.prepare.cache import PreparedCache, default_directory  # noqa: E402
from pardec.verifier.server import build_engine  # noqa: E402
from pardec.verifier.service import VerifierServicer  # noqa: E402
from tests import openai_front  # noqa: E402
from tests.secure import Pki, make_pki  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--device", default="cpu",
        help="device of the stack's verifier (cpu, cuda[:N], npu[:N]); the end-to-end tests then run on it",
    )
    parser.addoption(
        "--attention-tuning", default="",
        help="the device engine's attention tuning for this run, as key=value,... (see "
             "verifier/kernels/triton_attention.py ATTENTION_TUNING); bench.device passes the one it chose",
    )


def pytest_configure(config):
    tuning = config.getoption("--attention-tuning")
    if tuning:
        from pardec.verifier.kernels import triton_attention

        triton_attention.ATTENTION_TUNING.update(triton_attention.parse_attention_tuning(tuning))


@pytest.fixture(scope="session")
def device(request) -> str:
    return request.config.getoption("--device")


@pytest.fixture(scope="session")
def on(device):
    """The device engine's tests' device: --device's (cpu by default: Triton's interpreter)."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device on this host")
    if device.type not in ("cpu", "cuda"):
        pytest.skip(f"the device engine runs on CPU (interpreted) and CUDA, not {device.type}")
    return device


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def drafter_on_loopback(tmp_path_factory):
    """A drafter gRPC server on its own Redis: (address, servicer), for the gateway's drafting tests."""
    with RedisServer(tmp_path_factory.mktemp("drafter-redis")) as server:
        servicer = DrafterServicer(DrafterConfig(redis_url=server.url))
        grpc_server, address = start_server([servicer.add_to], "127.0.0.1:0")
        yield address, servicer
        grpc_server.stop(None).wait()


@pytest.fixture(scope="session")
def checkpoint():
    """The bundled model's checkpoint (SmolLM2-135M-Instruct), read once."""
    return load_checkpoint(None)


@pytest.fixture(scope="session")
def prepared_weights() -> PreparedCache:
    """Where a verifier keeps a checkpoint's W8A8 preparation (prepare/cache.py), the directory
    the engines and `pardec up` of the tests use too: the bundled model is prepared once per
    machine (most of a minute on 2 cores), then read back in seconds, whatever the kernel."""
    return PreparedCache(default_directory())


@pytest.fixture(scope="session")
def model(checkpoint, prepared_weights):
    """The bundled model as a CPU verifier serves it: W8A8 on the GEMM kernel the engine picks
    here; the modules that build their own engines share it."""
    return load_model(checkpoint, "w8a8", kernel=choose_kernel("cpu"), prepared_cache=prepared_weights)


@pytest.fixture(scope="session")
def engine(device):
    # The cost curve (8-30 s of measuring) has its own test; the shared engine skips it.
    return build_engine(VerifierConfig(measure_cost_curve=False, device=device))


@dataclass
class Stack:
    gateway: gateway_pb2_grpc.GatewayStub
    verifier: verifier_pb2_grpc.VerifierStub
    drafter: drafter_pb2_grpc.DrafterStub
    addresses: dict


@pytest.fixture(scope="session")
def stack(redis_server, engine):
    verifier_server, verifier_addr = start_server([VerifierServicer(engine).add_to], "127.0.0.1:0")
    drafter_server, drafter_addr = start_server(
        [DrafterServicer(DrafterConfig(redis_url=redis_server.url)).add_to], "127.0.0.1:0"
    )
    gateway_server, gateway_addr = serve_gateway(
        GatewayConfig(verifier_target=verifier_addr, drafter_target=drafter_addr), "127.0.0.1:0"
    )
    channels = [grpc.insecure_channel(a, options=CHANNEL_OPTIONS) for a in (gateway_addr, verifier_addr, drafter_addr)]
    yield Stack(
        gateway_pb2_grpc.GatewayStub(channels[0]),
        verifier_pb2_grpc.VerifierStub(channels[1]),
        drafter_pb2_grpc.DrafterStub(channels[2]),
        {"gateway": gateway_addr, "verifier": verifier_addr, "drafter": drafter_addr},
    )
    for channel in channels:
        channel.close()
    for server in (gateway_server, drafter_server, verifier_server):
        server.stop(None)


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    """A throwaway CA and certificates (tests/secure.py)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


# ---------------------------------------------------------------- the OpenAI-compatible HTTP API
@pytest.fixture(scope="module")
def front(stack):
    """A gateway with its HTTP API over the shared verifier and drafter (one per test module)."""
    running = start_gateway(openai_front.gateway_config(stack), "127.0.0.1:0", metrics_address="127.0.0.1:0",
                            http_address="127.0.0.1:0")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(front):
    import openai  # here, not at the top: the device machine's test runs need no HTTP client

    with openai.OpenAI(base_url=f"http://{front.http_address}/v1", api_key="unused", max_retries=0,
                       timeout=300) as client:
        yield client
