"""Device selection: clear startup errors for devices this host lacks, and several workers
behind one interface with sessions pinned to the worker that prefilled them."""

import os
import subprocess
import sys
import time

import pytest
import torch

from pardec.runtime.errors import ConfigError, NotFound
from pardec.verifier.loading import load_model
from pardec.verifier.api import Sampling
from pardec.verifier.config import VerifierConfig
from pardec.verifier.engine.devices import Workers, resolve_device
from pardec.verifier.engine.engine import Engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("device", ["tpu", "cpu:1", "cuda:x", "npu:-1", ""])
def test_malformed_devices_are_config_errors(device):
    with pytest.raises(ConfigError, match="cpu, cuda"):
        VerifierConfig(device=device)
    with pytest.raises(ConfigError):
        VerifierConfig(devices=("cpu", device))


def test_a_device_listed_twice_is_refused():
    with pytest.raises(ConfigError, match="twice"):
        VerifierConfig(devices=("npu:0", "npu:0"))
    assert VerifierConfig(devices=("npu:0", "npu:1")).worker_devices == ("npu:0", "npu:1")
    assert VerifierConfig(device="cuda:1").worker_devices == ("cuda:1",)


def test_cpu_resolves():
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_missing_cuda_is_a_clear_startup_error():
    with pytest.raises(ConfigError, match="no CUDA device"):
        resolve_device("cuda:0")


def test_missing_torch_npu_is_a_clear_startup_error():
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch-npu is installed here")
    with pytest.raises(ConfigError, match="torch-npu is not installed"):
        resolve_device("npu:1")
    assert "torch_npu" not in sys.modules


def test_the_verifier_process_exits_with_the_device_error_before_loading_a_model():
    start = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "-m", "pardec.verifier", "--addr", "127.0.0.1:0", "--devices", "npu:0,npu:1"],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 2
    assert "configuration error" in completed.stderr and "npu:0" in completed.stderr
    assert "Traceback" not in completed.stderr
    assert time.monotonic() - start < 60


def test_workers_pin_sessions_to_the_worker_that_prefilled_them(checkpoint, prepared_weights):
    model = load_model(checkpoint, "w8a8", kernel="fp32_exact", prepared_cache=prepared_weights)
    config = VerifierConfig(measure_cost_curve=False, kv_pool_tokens=4096)
    engines = [Engine(model, checkpoint.tokenizer, checkpoint.model_name, config) for _ in range(2)]
    workers = Workers(engines)
    try:
        tokens = checkpoint.tokenizer.encode_chat("Say hi.")
        firsts = [workers.prefill(f"s{i}", tokens, Sampling(), None).token for i in range(4)]
        assert [engine.sessions for engine in engines] == [2, 2]  # least loaded first
        assert len(set(firsts)) == 1
        steps = {f"s{i}": [workers.verify(f"s{i}", [], []).bonus_token for _ in range(3)] for i in range(4)}
        assert len({tuple(v) for v in steps.values()}) == 1  # same prompt, same tokens, on either worker
        assert workers.release("s0") and not workers.release("s0")
        with pytest.raises(NotFound):
            workers.verify("s0", [], [])
        assert workers.sessions == 3
    finally:
        workers.close()
