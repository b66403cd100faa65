"""Devices the model runs on, checked at startup, and one worker per device.

torch-npu is imported only when an npu device is asked for: it is a heavy, Ascend-only package
that most hosts do not have; its checks (the package, its ops, the card) are model/ascend.py's. Every failure here is a ConfigError raised before serving starts,
naming the device and what is missing, rather than an obscure error on the first request.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from pardec.runtime.errors import ConfigError, InvalidArgument, NotFound
from pardec.verifier.api import Prefilled, Sampling, Verification
from pardec.verifier.config import parse_device
from pardec.verifier.model.ascend import check_device as check_npu


def resolve_device(spec: str) -> torch.device:
    """The torch.device for 'cpu', 'cuda[:N]' or 'npu[:N]', after checking that it exists."""
    kind, index = parse_device(spec)
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "npu":
        check_npu(spec, index or 0)  # imports torch_npu, which registers the "npu" device type
        return torch.device("npu", index or 0)
    if not torch.cuda.is_available():
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA support"
        raise ConfigError(f"device {spec!r}: no CUDA device is available (torch {torch.__version__} has {built})")
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise ConfigError(f"device {spec!r}: only {count} {kind} device(s) here, numbered from 0")
    return torch.device(kind, index if index is not None else 0)


class Workers:
    """Several engines, one per device, behind the interface the servicer uses (ServingEngine).

    A session lives on the worker that prefilled it (its KV cache is in that device's memory);
    a new session goes to the worker holding the fewest."""

    def __init__(self, engines: Sequence):
        if not engines:
            raise ValueError("at least one worker")
        self.engines = list(engines)
        first = self.engines[0]
        self.model, self.tokenizer, self.model_name, self.config = first.model, first.tokenizer, first.model_name, first.config
        self.cost_curve = first.cost_curve
        self._lock = threading.Lock()
        self._home: dict[str, object] = {}

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    @property
    def sessions(self) -> int:
        return sum(engine.sessions for engine in self.engines)

    def prefill(
        self, session_id: str, tokens: Sequence[int], sampling: Sampling, seed: int | None, resume: bool = False,
        max_new_tokens: int = 0, cache_scope: str = "", generated: int = 0, priority: int = 0,
    ) -> Prefilled:
        with self._lock:
            if session_id in self._home:
                raise InvalidArgument(f"session_id: {session_id!r} already has a prefilled session")
            engine = min(self.engines, key=lambda e: e.sessions)
            self._home[session_id] = engine
        try:
            return engine.prefill(session_id, tokens, sampling, seed, resume=resume, max_new_tokens=max_new_tokens,
                                  cache_scope=cache_scope, generated=generated, priority=priority)
        except Exception:
            with self._lock:
                self._home.pop(session_id, None)
            raise

    def _engine_of(self, session_id: str):
        with self._lock:
            engine = self._home.get(session_id)
        if engine is None:
            raise NotFound(f"session_id: no verifier session {session_id!r} (never prefilled, released or expired)")
        return engine

    def verify(self, session_id: str, tokens: Sequence[int], parents: Sequence[int]) -> Verification:
        try:
            return self._engine_of(session_id).verify(session_id, tokens, parents)
        except NotFound:
            with self._lock:  # expired on its worker: forget where it lived
                self._home.pop(session_id, None)
            raise

    def release(self, session_id: str) -> bool:
        with self._lock:
            engine = self._home.pop(session_id, None)
        return engine is not None and engine.release(session_id)

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
