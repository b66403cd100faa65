"""Bad input gets the right gRPC status, a message naming the field, and loses nothing."""

from __future__ import annotations

import grpc
import pytest

from pardec.v1 import common_pb2, drafter_pb2, gateway_pb2, verifier_pb2
from tests.prompts import CODE_PROMPTS


def status_of(call, request):
    with pytest.raises(grpc.RpcError) as caught:
        call(request, timeout=60)
    return caught.value.code(), caught.value.details()


@pytest.mark.parametrize(
    "fields, field_name",
    [
        ({"n": 2}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 5}, "top_logprobs"),
        ({"sampling": common_pb2.SamplingParams(presence_penalty=0.5)}, "sampling.presence_penalty"),
        ({"sampling": common_pb2.SamplingParams(frequency_penalty=0.5)}, "sampling.frequency_penalty"),
        ({"sampling": common_pb2.SamplingParams(temperature=-1)}, "sampling.temperature"),
        ({"sampling": common_pb2.SamplingParams(temperature=1e-30)}, "sampling.temperature"),  # below 1e-6
        ({"sampling": common_pb2.SamplingParams(top_p=1.5)}, "sampling.top_p"),
        ({"sampling": common_pb2.SamplingParams(repetition_penalty=0)}, "sampling.repetition_penalty"),
        ({"max_new_tokens": 1_000_000}, "max_new_tokens"),
        ({"prompt": ""}, "prompt"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_gateway_refuses_with_invalid_argument_naming_the_field(stack, fields, field_name):
    request = gateway_pb2.GenerateRequest(prompt="Hello", max_new_tokens=8)
    for name, value in fields.items():
        if name in ("sampling",):
            request.sampling.CopyFrom(value)
        elif name == "stop":
            request.stop.extend(value)
        else:
            setattr(request, name, value)
    code, details = status_of(stack.gateway.Generate, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert field_name in details


def test_overlong_prompt_is_refused(stack):
    request = gateway_pb2.GenerateRequest(prompt="word " * 5000, max_new_tokens=8)
    code, details = status_of(stack.gateway.Generate, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "maxInputTokenLen" in details


def test_unknown_sessions_are_not_found(stack):
    code, details = status_of(stack.verifier.Verify, verifier_pb2.VerifyRequest(session_id="nope"))
    assert code == grpc.StatusCode.NOT_FOUND and "session_id" in details
    code, details = status_of(stack.drafter.Propose, drafter_pb2.ProposeRequest(session_id="nope", max_nodes=4, max_depth=4))
    assert code == grpc.StatusCode.NOT_FOUND and "session_id" in details


def test_malformed_trees_are_refused_and_the_session_continues_unharmed(stack, engine):
    tokens = engine.tokenizer.encode_chat(CODE_PROMPTS[2])
    reference = stack.gateway.Generate(
        gateway_pb2.GenerateRequest(prompt=CODE_PROMPTS[2], max_new_tokens=6, decoding=gateway_pb2.DECODING_MODE_PLAIN)
    )
    session = "malformed-tree-session"
    first = stack.verifier.Prefill(verifier_pb2.PrefillRequest(session_id=session, token_ids=tokens)).next_token_id
    bad_trees = [
        (common_pb2.TokenTree(token_ids=[1, 2], parents=[-1, 5]), "tree.parents[1]"),
        (common_pb2.TokenTree(token_ids=[1, 2], parents=[1, -1]), "tree.parents[0]"),
        (common_pb2.TokenTree(token_ids=[1], parents=[]), "tree.parents"),
        (common_pb2.TokenTree(token_ids=[10**6], parents=[-1]), "tree.token_ids[0]"),
        (common_pb2.TokenTree(token_ids=[1] * 513, parents=[-1] * 513), "max_tree_nodes"),
    ]
    try:
        for tree, field_name in bad_trees:
            code, details = status_of(stack.verifier.Verify, verifier_pb2.VerifyRequest(session_id=session, tree=tree))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert field_name in details
        code, _ = status_of(stack.verifier.Prefill, verifier_pb2.PrefillRequest(session_id=session, token_ids=tokens))
        assert code == grpc.StatusCode.INVALID_ARGUMENT  # a second prefill must not clobber the session
        generated = [first]
        while len(generated) < len(reference.token_ids):
            reply = stack.verifier.Verify(verifier_pb2.VerifyRequest(session_id=session))
            generated.append(reply.bonus_token_id)
        assert generated == list(reference.token_ids)
    finally:
        stack.verifier.Release(verifier_pb2.ReleaseRequest(session_id=session))


def test_bad_prompt_tokens_are_refused(stack):
    code, details = status_of(stack.verifier.Prefill, verifier_pb2.PrefillRequest(session_id="x", token_ids=[10**7]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in details
    code, details = status_of(stack.verifier.Prefill, verifier_pb2.PrefillRequest(session_id="x"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in details
