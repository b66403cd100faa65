"""gRPC servicer of the verifier: converts messages and maps errors, nothing more."""

from __future__ import annotations

import dataclasses

import grpc

from pardec.runtime.parsing import add_servicer
from pardec.runtime.serving import maps_errors
from pardec.runtime.tracing import NO_SPAN, Tracer, trace_of
from pardec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from pardec.verifier.api import Sampling
from pardec.verifier.engine.interface import ServingEngine
from pardec.verifier.generation_config import GenerationDefaults


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, engine: ServingEngine, generation_defaults: GenerationDefaults = (),
                 tracer: Tracer | None = None):
        """``generation_defaults``: the sampling defaults GetModelInfo names (generation_config.py);
        ``tracer``: where each Prefill's span goes (runtime/tracing.py), None: nowhere."""
        self.engine = engine
        self.tracer = tracer
        tokenizer = engine.tokenizer
        args = engine.model.args
        self._model_info = verifier_pb2.ModelInfo(
            model_name=engine.model_name,
            architecture=args.architecture,
            quantization=engine.config.quantization,
            tokenizer_json=tokenizer.tokenizer_json,
            chat_template=tokenizer.chat_template,
            bos_token=tokenizer.bos_token,
            eos_token=tokenizer.eos_token,
            stop_token_ids=tokenizer.stop_token_ids,
            max_seq_len=engine.config.max_seq_len,
            vocab_size=args.vocab_size,
            device=",".join(engine.config.worker_devices),
            max_tree_nodes=engine.config.max_tree_nodes,
            kernel=engine.model.kernel,
            attention=engine.model.attention,
            kv_cache_dtype=str(engine.model.kv_dtype).removeprefix("torch."),
            embedding_dtype=str(engine.model.tok_embeddings.dtype).removeprefix("torch."),
            embedding_rounded=engine.model.embedding_rounded,
            prefix_block_tokens=engine.config.kv_block_tokens if engine.config.prefix_caching else 0,
            cost_curve=[
                verifier_pb2.CostPoint(tokens=tokens, batch=batch, step_ms=step_ms)
                for tokens, batch, step_ms in engine.cost_curve
            ],
            generation_defaults=common_pb2.GenerationDefaults(**dict(generation_defaults)),
        )
        self._brief_info = verifier_pb2.ModelInfo()
        self._brief_info.CopyFrom(self._model_info)
        self._brief_info.ClearField("tokenizer_json")
        self._brief_info.ClearField("chat_template")

    def add_to(self, server: grpc.Server) -> None:
        add_servicer(server, self, verifier_pb2.DESCRIPTOR.services_by_name["Verifier"])

    def GetModelInfo(self, request, context):
        return self._brief_info if request.brief else self._model_info

    @maps_errors
    def Prefill(self, request, context):
        sampling = Sampling.from_proto(request.sampling)
        for name in ("logprobs", "prompt_logprobs"):
            if request.HasField(name):
                sampling = dataclasses.replace(sampling, **{name: getattr(request, name)})
        if request.stop_token_ids:
            sampling = dataclasses.replace(sampling, stop_token_ids=tuple(request.stop_token_ids))
        span = self.tracer.request(trace_of(context.invocation_metadata() or ()), name="prefill") if self.tracer \
            else NO_SPAN
        failure, prefilled = None, None
        try:
            prefilled = self.engine.prefill(
                request.session_id, list(request.token_ids), sampling, sampling.seed, resume=request.resume,
                max_new_tokens=request.max_new_tokens, cache_scope=request.cache_scope,
                generated=request.generated_tokens, priority=request.priority,
            )
        except BaseException as error:
            failure = error
            raise
        finally:  # its duration less compute_ms: the wait for admission and a batch
            span.end({"pardec.prompt_tokens": len(request.token_ids), "pardec.resume": request.resume,
                      "pardec.cached_prompt_tokens": prefilled and prefilled.cached_tokens,
                      "pardec.compute_ms": prefilled and prefilled.compute_ms}, failure)
        reply = verifier_pb2.PrefillResponse(
            next_token_id=prefilled.token, compute_ms=prefilled.compute_ms, cached_tokens=prefilled.cached_tokens
        )
        if prefilled.logprob is not None:
            reply.logprob.CopyFrom(prefilled.logprob.to_proto())
        reply.prompt_logprobs.extend(logprob.to_proto() for logprob in prefilled.prompt_logprobs)
        return reply

    @maps_errors
    def Verify(self, request, context):
        result = self.engine.verify(
            request.session_id, list(request.tree.token_ids), list(request.tree.parents)
        )
        return verifier_pb2.VerifyResponse(
            accepted_token_ids=result.accepted_tokens,
            accepted_node_indices=result.accepted_nodes,
            bonus_token_id=result.bonus_token,
            node_argmax=result.node_argmax,
            compute_ms=result.compute_ms,
            logprobs=[logprob.to_proto() for logprob in result.logprobs],
        )

    @maps_errors
    def Release(self, request, context):
        self.engine.release(request.session_id)
        return verifier_pb2.ReleaseResponse()
