"""The declared interfaces: every part that stands behind one has each of its members, with a
signature its callers can use; the types both sides of a call share stay out of torch's reach
for the gateway; Sampling refuses bad values wherever it is built."""

from __future__ import annotations

import inspect
import subprocess
import sys
from types import SimpleNamespace

import pytest

from pardec.gateway.backends import DrafterBackend, VerifierBackend
from pardec.gateway.clients import DrafterClient, VerifierClient
from pardec.gateway.embedded_drafter import EmbeddedDrafter
from pardec.gateway.replicas import VerifierReplicas
from pardec.runtime.errors import InvalidArgument
from pardec.v1 import common_pb2
from pardec.verifier.api import Sampling
from pardec.verifier.config import VerifierConfig
from pardec.verifier.engine.devices import Workers
from pardec.verifier.engine.engine import Engine
from pardec.verifier.engine.interface import ServingEngine

IMPLEMENTATIONS = [
    (DrafterBackend, DrafterClient), (DrafterBackend, EmbeddedDrafter),
    (VerifierBackend, VerifierClient), (VerifierBackend, VerifierReplicas),
    (ServingEngine, Engine), (ServingEngine, Workers),
]


def methods(protocol) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(protocol).items()
            if not name.startswith("_") and callable(member)}


def data_members(protocol) -> set[str]:
    return set(vars(protocol).get("__annotations__", {}))


def signature_problems(wanted: inspect.Signature, found: inspect.Signature) -> list[str]:
    """Why a call written against ``wanted`` could fail on ``found`` (empty: none): each
    parameter at its place under its name, a default wherever the protocol has one, no extra
    parameter without a default, and the same annotations where the implementation gives any."""
    problems = []
    given = list(found.parameters.values())
    by_name = found.parameters
    for place, parameter in enumerate(wanted.parameters.values()):
        match = by_name.get(parameter.name)
        if match is None:
            problems.append(f"no parameter {parameter.name!r}")
            continue
        if place >= len(given) or given[place].name != parameter.name:
            problems.append(f"{parameter.name!r} is not parameter {place}")
        if parameter.default is not inspect.Parameter.empty and match.default != parameter.default:
            problems.append(f"{parameter.name!r} defaults to {match.default!r}, not {parameter.default!r}")
        if match.annotation is not inspect.Parameter.empty and match.annotation != parameter.annotation:
            problems.append(f"{parameter.name!r} is {match.annotation}, not {parameter.annotation}")
    for parameter in given:
        if parameter.name not in wanted.parameters and parameter.default is inspect.Parameter.empty and \
                parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            problems.append(f"extra parameter {parameter.name!r} has no default")
    if found.return_annotation is not inspect.Signature.empty and found.return_annotation != wanted.return_annotation:
        problems.append(f"returns {found.return_annotation}, not {wanted.return_annotation}")
    return problems


@pytest.mark.parametrize("protocol, implementation", IMPLEMENTATIONS,
                         ids=[f"{i.__name__}-is-{p.__name__}" for p, i in IMPLEMENTATIONS])
def test_each_implementation_has_every_method_of_its_protocol(protocol, implementation):
    assert methods(protocol), protocol
    for name, wanted in methods(protocol).items():
        member = inspect.getattr_static(implementation, name, None)
        assert callable(member), f"{implementation.__name__} has no method {name}"
        problems = signature_problems(wanted, inspect.signature(getattr(implementation, name)))
        assert not problems, f"{implementation.__name__}.{name}: " + "; ".join(problems)


def test_the_signature_check_catches_what_breaks_a_call():
    class Wanted:
        def call(self, a: int, b: str = "") -> int: ...

    def problems_of(fn):
        return signature_problems(inspect.signature(Wanted.call), inspect.signature(fn))

    def good(self, a: int, b: str = "", c: int = 0) -> int: ...
    def renamed(self, x: int, b: str = "") -> int: ...
    def no_default(self, a: int, b: str) -> int: ...
    def extra(self, a: int, b: str = "", c: int = ...) -> int: ...
    def required_extra(self, a: int, b: str, c: int) -> int: ...
    def returns_other(self, a: int, b: str = "") -> str: ...
    assert problems_of(good) == [] and problems_of(extra) == []
    for bad in (renamed, no_default, required_extra, returns_other):
        assert problems_of(bad), bad.__name__


class _StubModel:
    """Enough of a model for an Engine to start and stop without loading one."""

    args = SimpleNamespace(vocab_size=8, architecture="stub")
    device_forward = None

    def new_pool(self, tokens: int, block_tokens: int, device) -> None:
        return None


def test_engine_and_workers_hold_the_data_the_servicer_reads():
    engine = Engine(_StubModel(), tokenizer=None, model_name="stub", config=VerifierConfig(measure_cost_curve=False),
                    device="cpu")
    try:
        for serving in (engine, Workers([engine])):
            missing = {name for name in data_members(ServingEngine) if not hasattr(serving, name)}
            assert not missing, f"{type(serving).__name__} lacks {missing}"
    finally:
        engine.close()
    assert data_members(ServingEngine) >= {"model", "tokenizer", "model_name", "config", "cost_curve"}


def test_the_gateway_imports_no_torch():
    code = "import sys, pardec.gateway.server; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("fields, field_name", [
    ({"temperature": -1.0}, "sampling.temperature"), ({"temperature": float("nan")}, "sampling.temperature"),
    ({"top_k": -1}, "sampling.top_k"), ({"top_p": 1.5}, "sampling.top_p"),
    ({"repetition_penalty": 0.0}, "sampling.repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "sampling.repetition_penalty"),
])
def test_sampling_refuses_bad_values_naming_the_field(fields, field_name):
    with pytest.raises(InvalidArgument, match=field_name):
        Sampling(**fields)


def test_sampling_crosses_the_wire_unchanged():
    for sampling in (Sampling(), Sampling(temperature=0.5, top_k=4, top_p=0.25, repetition_penalty=1.5, seed=7)):
        assert Sampling.from_proto(sampling.to_proto()) == sampling
    # The message's unset fields disable their filter, as 1.0 does.
    assert Sampling.from_proto(common_pb2.SamplingParams()) == Sampling()
