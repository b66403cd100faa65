"""Typed clients of the internal services: the generation core never sees protobuf.

A failed call becomes the PardecError of the same status (message kept), so a verifier's
INVALID_ARGUMENT reaches the public client as INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pardec.gateway.deadlines import Deadline, TimedOut, timeout_for
from pardec.runtime.draft_params import DraftParams
from pardec.runtime import errors, security, tracing
from pardec.runtime.draft_params import split_new_tokens
from pardec.runtime.security import ClientTLS
from pardec.runtime.serving import CHANNEL_OPTIONS
from pardec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from pardec.verifier.api import Prefilled, Sampling, TokenLogprob, Verification
from pardec.verifier.model.tokenizer import ChatTokenizer

_ERRORS_BY_STATUS = {
    cls.status: cls
    for cls in (
        errors.InvalidArgument, errors.NotFound, errors.ResourceExhausted,
        errors.FailedPrecondition, errors.Unavailable,
    )
}


def _as_pardec_error(error: grpc.RpcError, service: str) -> errors.PardecError:
    code = error.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimedOut(f"{service}: no answer before the deadline")
    cls = _ERRORS_BY_STATUS.get(code, errors.Unavailable if code == grpc.StatusCode.UNAVAILABLE else errors.PardecError)
    return cls(f"{service}: {error.details()}")


RECONNECT_MAX_MS = 1000


def open_channel(target: str, tls: ClientTLS | None = None) -> grpc.Channel:
    """A channel that balances round-robin over every address the target resolves to; over TLS
    (mutual with a client certificate) when ``tls`` is given."""
    service_config = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
    # A dns: target is resolved again when a connection closes (a drafter's connection age, a
    # replica gone); gRPC's default floor between resolutions (30 s) would leave replicas added
    # meanwhile idle that long. A resolution is one DNS query, so a second's floor costs nothing.
    resolving = ("grpc.dns_min_time_between_resolutions_ms", 1000)
    # A backend restarted on its address (a drafter or verifier pod, one `pardec up` starts again)
    # is connected to again within RECONNECT_MAX_MS: gRPC's own backoff grows to 120 s, so a
    # request that saw it go would decode plain, or fail over, for the rest of its life. A try is
    # one TCP connect.
    reconnecting = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS))
    return security.open_channel(
        target, tls, (*CHANNEL_OPTIONS, ("grpc.service_config", service_config), resolving, *reconnecting)
    )


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    quantization: str
    tokenizer: ChatTokenizer | None  # None in a brief answer (VerifierClient.model_info's)
    max_seq_len: int
    stop_token_ids: frozenset[int]
    architecture: str = ""
    # The verifier's measured step cost: (tokens per session, batch, step_ms); may be empty.
    cost_curve: tuple[tuple[int, int, float], ...] = ()
    vocab_size: int = 0  # 0: unknown (drafted trees are then checked against nothing but shape)
    device: str = ""  # where the verifier runs the model ("cpu", "cuda:0", ...; "" unknown)
    verifier_replicas: int = 1  # replicas serving it behind the gateway (replicas.VerifierReplicas)
    prefix_block_tokens: int = 0  # positions per block of the verifier's prefix cache (0: none)
    # HTTP requests' sampling for the fields they leave out (the model's generation_config.json).
    generation_defaults: tuple[tuple[str, float], ...] = ()
    attention: str = ""  # the verifier's attention kernel ("" unknown)
    kv_cache_dtype: str = ""  # what its KV cache stores ("float32", "bfloat16"; "" unknown)
    embedding_dtype: str = ""  # what it keeps the embedding table in ("" unknown)
    embedding_rounded: bool = False  # an entry of that table rounded to fit it

    @property
    def embedding_rounding(self) -> str:
        """How the embedding table's numbers were kept, as replicas compare it: "none" (exact, whatever the dtype holding
        them), the dtype they were rounded to, or "" unknown (an older verifier)."""
        if not self.embedding_dtype:
            return ""
        return self.embedding_dtype if self.embedding_rounded else "none"


class VerifierClient:
    def __init__(self, target: str, timeout_s: float, tls: ClientTLS | None = None):
        self.target = target
        self._channel = open_channel(target, tls)
        self._stub = verifier_pb2_grpc.VerifierStub(self._channel)
        self._timeout = timeout_s
        self._releasing: set = set()  # release_later's calls in flight
        self._releasing_lock = threading.Lock()

    def model_info(self, wait_s: float, brief: bool = False) -> ModelInfo:
        """Waits up to ``wait_s`` for the verifier to come up (it loads a model first); ``brief``:
        asks once, and the answer has no tokenizer (a health probe's)."""
        try:
            info = self._stub.GetModelInfo(
                verifier_pb2.GetModelInfoRequest(brief=brief), timeout=wait_s, wait_for_ready=not brief
            )
        except grpc.RpcError as error:
            raise _as_pardec_error(error, "verifier") from error
        tokenizer = None if brief else ChatTokenizer.from_parts(
            info.tokenizer_json, info.chat_template, info.bos_token, info.eos_token, tuple(info.stop_token_ids)
        )
        return ModelInfo(
            info.model_name, info.quantization, tokenizer, info.max_seq_len, frozenset(info.stop_token_ids),
            info.architecture, tuple((point.tokens, point.batch, point.step_ms) for point in info.cost_curve),
            info.vocab_size, info.device, prefix_block_tokens=info.prefix_block_tokens,
            generation_defaults=tuple((field.name, value) for field, value in info.generation_defaults.ListFields()),
            attention=info.attention, kv_cache_dtype=info.kv_cache_dtype, embedding_dtype=info.embedding_dtype,
            embedding_rounded=info.embedding_rounded,
        )

    @property
    def timeout_s(self) -> float:
        return self._timeout

    def unavailable(self, timeout_s: float) -> str:
        """"" while the verifier's grpc.health.v1 answers SERVING; else what it answered, or why not."""
        try:
            answer = health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as error:
            return f"{self.target}: {error.code().name}"
        if answer.status != health_pb2.HealthCheckResponse.SERVING:
            return f"{self.target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)}"
        return ""

    def prefill(
        self, session_id: str, tokens: Sequence[int], sampling: Sampling, deadline: Deadline | None = None,
        max_new_tokens: int = 0, cache_scope: str = "", priority: int = 0, generated: int = 0, resume: bool = False,
    ) -> Prefilled:
        # max_new_tokens (0: not said): the verifier promises the session room for them up front.
        request = verifier_pb2.PrefillRequest(
            session_id=session_id, token_ids=tokens, sampling=sampling.to_proto(), resume=resume or bool(generated),
            max_new_tokens=max_new_tokens, cache_scope=cache_scope, logprobs=sampling.logprobs,
            prompt_logprobs=sampling.prompt_logprobs, stop_token_ids=sampling.stop_token_ids,
            generated_tokens=generated, priority=priority,
        )
        reply = self._call(self._stub.Prefill, request, deadline)
        logprob = TokenLogprob.from_proto(reply.logprob) if reply.HasField("logprob") else None
        return Prefilled(reply.next_token_id, reply.compute_ms, reply.cached_tokens, logprob,
                         tuple(TokenLogprob.from_proto(lp) for lp in reply.prompt_logprobs))

    def verify(
        self, session_id: str, tokens: Sequence[int], parents: Sequence[int], deadline: Deadline | None = None
    ) -> Verification:
        request = verifier_pb2.VerifyRequest(
            session_id=session_id, tree=common_pb2.TokenTree(token_ids=tokens, parents=parents)
        )
        reply = self._call(self._stub.Verify, request, deadline, blocking=True)
        return Verification(
            list(reply.accepted_token_ids), reply.bonus_token_id, list(reply.node_argmax), reply.compute_ms,
            list(reply.accepted_node_indices), [TokenLogprob.from_proto(lp) for lp in reply.logprobs],
        )

    def release(self, session_id: str) -> None:
        # Its own timeout, not the request's: a request past its deadline still frees its session.
        self._call(self._stub.Release, verifier_pb2.ReleaseRequest(session_id=session_id))

    def release_later(self, session_id: str) -> None:
        """Release without waiting for the answer: best effort, for a session given up on."""
        future = self._stub.Release.future(verifier_pb2.ReleaseRequest(session_id=session_id), timeout=self._timeout)
        # grpc cancels a call whose future is collected: hold it until the answer is in.
        with self._releasing_lock:
            self._releasing.add(future)
        future.add_done_callback(self._released)

    def _released(self, future) -> None:
        with self._releasing_lock:
            self._releasing.discard(future)

    def _call(self, method, request, deadline: Deadline | None = None, blocking: bool = False):
        """A unary call. With a deadline, a future that the client's cancel reaches in flight
        (Deadline.cancel) -- or, `blocking`, a plain call bounded by the deadline that a cancel
        waits for: what a verify step takes, since a future waited on starts one of grpc's threads
        per call on an idle channel, on every step (benchmarks.md, "Figures behind design
        choices"), and a step is one forward long."""
        metadata = tracing.outgoing() or None  # the calling request's span, where one is traced
        if deadline is None or blocking:
            try:
                return method(request, timeout=timeout_for(deadline, self._timeout), metadata=metadata)
            except grpc.RpcError as error:
                failure = _as_pardec_error(error, "verifier")
                raise (deadline.failed(failure) if deadline else failure) from error
        future = method.future(request, timeout=deadline.timeout(self._timeout), metadata=metadata)
        with deadline.cancelling(future):
            try:
                return future.result()
            except grpc.FutureCancelledError as error:
                raise deadline.failed(errors.Unavailable("verifier: call cancelled")) from error
            except grpc.RpcError as error:
                raise deadline.failed(_as_pardec_error(error, "verifier")) from error


class DrafterClient:
    """``timeout_s`` bounds StartSession and EndSession, ``propose_timeout_s`` each Propose: the
    generation loop treats a drafter that misses them as absent for that step."""

    def __init__(
        self, target: str, timeout_s: float, propose_timeout_s: float | None = None, tls: ClientTLS | None = None
    ):
        self._channel = open_channel(target, tls)
        self._stub = drafter_pb2_grpc.DrafterStub(self._channel)
        self._timeout = timeout_s
        self._propose_timeout = propose_timeout_s or timeout_s

    def start_session(
        self, session_id: str, prompt: Sequence[int], params: DraftParams,
        client_session_id: str = "", shared_memory: str = "",
    ) -> Future:
        """Starts building the session's trie; returns at once so that it overlaps prefill.
        ``client_session_id`` keeps multi-turn memory; ``shared_memory`` names a memory shared
        across requests and replicas (empty: none)."""
        config = drafter_pb2.DraftConfig(
            plugin_type=params.plugin_type, decoding_length=params.decoding_length,
            dynamic_algo=params.dynamic_algo, level=params.level, window=params.window,
            guess_set_size=params.guess_set_size,
        )
        request = drafter_pb2.StartSessionRequest(
            session_id=session_id, prompt_token_ids=prompt, config=config,
            client_session_id=client_session_id, shared_memory=shared_memory,
        )
        return self._stub.StartSession.future(request, timeout=self._timeout)

    def wait_started(self, started: Future, timeout_s: float | None = None) -> bool:
        """True once the session is started, False if it is still starting after ``timeout_s``."""
        try:
            started.result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            return False
        except grpc.RpcError as error:
            raise _as_pardec_error(error, "drafter") from error
        return True

    def propose(
        self, session_id: str, new_tokens: Sequence[int], max_nodes: int, max_depth: int,
        last_node_argmax: Sequence[int] = (), verified_depth: int | None = None, deadline: Deadline | None = None,
        committed_length: int = -1,
    ) -> tuple[list[int], list[int], list[float]]:
        """(tokens, parents, accept probabilities) of the next tree, best first. A blocking call:
        on the step's critical path it measured faster than a future waited on (docs/benchmarks.md,
        "Figures behind design choices"); a cancel waits for it, at most the propose timeout."""
        timeout = timeout_for(deadline, self._propose_timeout)
        request = self._propose_request(
            session_id, new_tokens, max_nodes, max_depth, last_node_argmax, verified_depth, timeout, committed_length,
            deadline,
        )
        try:
            return _scored_tree(self._stub.Propose(request, timeout=timeout))
        except grpc.RpcError as error:
            failure = _as_pardec_error(error, "drafter")
            raise (deadline.failed(failure) if deadline else failure) from error

    def propose_future(
        self, session_id: str, new_tokens: Sequence[int], max_nodes: int, max_depth: int,
        last_node_argmax: Sequence[int] = (), verified_depth: int | None = None, deadline: Deadline | None = None,
        committed_length: int = -1,
    ) -> Future:
        """Propose without waiting for the answer (`proposal` reads it)."""
        timeout = timeout_for(deadline, self._propose_timeout)
        request = self._propose_request(
            session_id, new_tokens, max_nodes, max_depth, last_node_argmax, verified_depth, timeout, committed_length,
            deadline,
        )
        return self._stub.Propose.future(request, timeout=timeout)

    def proposal(self, future: Future) -> tuple[list[int], list[int], list[float]]:
        """A `propose_future`'s tree, waiting for it up to the propose deadline."""
        try:
            return _scored_tree(future.result())
        except grpc.RpcError as error:
            raise _as_pardec_error(error, "drafter") from error

    def _propose_request(
        self, session_id: str, new_tokens: Sequence[int], max_nodes: int, max_depth: int,
        last_node_argmax: Sequence[int], verified_depth: int | None, timeout: float, committed_length: int = -1,
        deadline: Deadline | None = None,
    ) -> drafter_pb2.ProposeRequest:
        """The Propose to send. More new tokens than one call takes (a session that ran plain
        for long) go first, in calls of their own that record them without a tree, each with
        its own committed length."""
        heads, new_tokens = split_new_tokens(new_tokens)
        held = committed_length - len(new_tokens) - sum(map(len, heads))  # before the first call
        for head in heads:
            held += len(head)
            record = drafter_pb2.ProposeRequest(
                session_id=session_id, new_token_ids=head, max_nodes=0, max_depth=0, verified_depth=0,
                committed_length=held if committed_length >= 0 else None,
            )
            try:
                self._stub.Propose(record, timeout=timeout)
            except grpc.RpcError as error:
                failure = _as_pardec_error(error, "drafter")
                raise (deadline.failed(failure) if deadline else failure) from error
        return drafter_pb2.ProposeRequest(
            session_id=session_id, new_token_ids=new_tokens, max_nodes=max_nodes, max_depth=max_depth,
            last_node_argmax=last_node_argmax, verified_depth=verified_depth,
            committed_length=committed_length if committed_length >= 0 else None,
        )

    def end_session(self, session_id: str, new_tokens: Sequence[int] = ()) -> None:
        """``new_tokens``: committed since the last Propose, for the session's memories."""
        request = drafter_pb2.EndSessionRequest(session_id=session_id, new_token_ids=new_tokens)
        try:
            self._stub.EndSession(request, timeout=self._timeout)
        except grpc.RpcError as error:
            raise _as_pardec_error(error, "drafter") from error

    def close(self) -> None:
        self._channel.close()


def _scored_tree(reply: drafter_pb2.ProposeResponse) -> tuple[list[int], list[int], list[float]]:
    return list(reply.tree.token_ids), list(reply.tree.parents), list(reply.accept_probabilities)
