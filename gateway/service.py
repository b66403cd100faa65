"""gRPC servicer of the public API: converts messages and maps errors over the core."""

from __future__ import annotations


import grpc

from pardec.gateway.answers import AnswerReader
from pardec.gateway.chat import ASSISTANT, SYSTEM, TOOL, USER, Message, template_variables
from pardec.gateway.choices import generate_sequences, stream_sequences
from pardec.gateway.deadlines import Deadline
from pardec.gateway.deadlines import close_when_idle
from pardec.gateway.generation import Generator, Request
from pardec.gateway.outputs import Chunk, Generation, Stats
from pardec.gateway.served import ServedModel
from pardec.gateway.tools import Tool, ToolCall, ToolUse
from pardec.runtime.draft_params import OVERRIDABLE, DraftOverrides
from pardec.runtime.errors import InvalidArgument
from pardec.runtime.parsing import add_servicer
from pardec.runtime.security import Authenticator, cache_scope, memory_scope
from pardec.runtime.serving import maps_errors
from pardec.runtime.tracing import trace_of
from pardec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from pardec.verifier.api import Sampling


def request_from_proto(message: gateway_pb2.GenerateRequest, tenant: str = "", model: str = "") -> Request:
    """``tenant`` and ``model`` scope the client's session id (checked: runtime/security.py
    memory_scope): another tenant's, or another model's, same id is another memory."""
    params = message.sampling
    if message.decoding not in gateway_pb2.DecodingMode.values():  # proto3 enums accept any number
        raise InvalidArgument(f"decoding: {message.decoding} is not a DecodingMode (0 default, 1 plain)")
    tools = tools_from_proto(message)
    return Request(
        prompt=message.prompt,
        max_new_tokens=message.max_new_tokens,
        plain=message.decoding == gateway_pb2.DECODING_MODE_PLAIN,
        sampling=Sampling.from_proto(params),
        tools=tools,
        chat_template_kwargs=template_variables(message.chat_template_kwargs),
        continue_final_message=message.continue_final_message,
        n=message.n,
        best_of=message.best_of,
        use_beam_search=message.use_beam_search,
        length_penalty=message.length_penalty if message.HasField("length_penalty") else 1.0,
        logprobs=message.logprobs,
        top_logprobs=message.top_logprobs,
        prompt_logprobs=message.prompt_logprobs if message.HasField("prompt_logprobs") else None,
        prompt_token_ids=tuple(message.prompt_token_ids),
        stop=tuple(message.stop),
        session_id=memory_scope(tenant, model, message.session_id),
        tenant=tenant,
        cache_scope=cache_scope(tenant, message.cache_salt),
        draft=DraftOverrides(**{
            param.name: getattr(message.draft, param.name) if message.draft.HasField(param.name) else None
            for param in OVERRIDABLE
        }),
        messages=tuple(messages_from_proto(message.messages)),
        raw=message.raw,
        ignore_eos=message.ignore_eos,
        stop_token_ids=tuple(message.stop_token_ids),
        include_stop_str_in_output=message.include_stop_str_in_output,
        keep_special_tokens=message.keep_special_tokens,
        bad_words=tuple(message.bad_words),
        truncate_prompt_tokens=message.truncate_prompt_tokens if message.HasField("truncate_prompt_tokens") else None,
        priority=message.priority,
        prediction=message.prediction,
    )


_ROLES = {gateway_pb2.ROLE_SYSTEM: SYSTEM, gateway_pb2.ROLE_USER: USER, gateway_pb2.ROLE_ASSISTANT: ASSISTANT,
          gateway_pb2.ROLE_TOOL: TOOL}


def tools_from_proto(message) -> ToolUse | None:
    """A GenerateRequest's (or TokenizeRequest's) tools and choice; None when it offers none."""
    generating = isinstance(message, gateway_pb2.GenerateRequest)
    mode, function = (message.tool_choice.mode, message.tool_choice.function) if generating else ("", "")
    if not message.tools:
        if function or mode not in ("", "auto", "none"):
            raise InvalidArgument(f"tool_choice: {function or mode!r:.80} asks for a call, but the request offers "
                                  "no tools")
        return None
    tools = tuple(Tool(tool.function.name, tool.function.description, tool.function.parameters or '{"type": "object"}',
                       tool.function.strict) for tool in message.tools)
    parallel = message.parallel_tool_calls if generating and message.HasField("parallel_tool_calls") else True
    return ToolUse(tools, mode or ("required" if function else "auto"), parallel, function)


def messages_from_proto(messages) -> list[Message]:
    converted = []
    for index, message in enumerate(messages):
        if message.role not in _ROLES:  # ROLE_UNSPECIFIED, or a number no enum value has
            name = gateway_pb2.Role.Name(message.role) if message.role in gateway_pb2.Role.values() else message.role
            raise InvalidArgument(
                f"messages[{index}].role: {name} is not a role (ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT or ROLE_TOOL)"
            )
        calls = tuple(ToolCall(call.function.name, call.function.arguments, call.id) for call in message.tool_calls)
        converted.append(Message(_ROLES[message.role], message.content, calls, message.tool_call_id))
    return converted


def response_to_proto(generation: Generation | Chunk, model: str, answer: AnswerReader | None = None,
                      index: int = 0) -> gateway_pb2.GenerateResponse:
    """With ``answer`` (the request's, read across its stream), this message's thinking apart and
    the calls it completes (over gRPC a call is sent once, when it is whole)."""
    text, made, finish, reasoning = generation.text, [], generation.finish_reason, ""
    if answer is not None:
        piece = answer.step(text, finish)
        text, made, finish, reasoning = piece.content, piece.calls, piece.finish_reason, piece.reasoning
    response = gateway_pb2.GenerateResponse(
        text=text, token_ids=generation.token_ids, finish_reason=finish, model=model,
        tool_calls=[gateway_pb2.ToolCall(id=call.id, function=gateway_pb2.FunctionCall(name=call.name,
                                                                                       arguments=call.arguments))
                    for call in made],
        logprobs=[logprob.to_proto() for logprob in generation.logprobs],
        prompt_token_ids=generation.prompt_token_ids,
        prompt_logprobs=[logprob.to_proto() for logprob in generation.prompt_logprobs],
        reasoning_content=reasoning,
        index=index,
    )
    if generation.stats is not None:
        response.stats.CopyFrom(stats_to_proto(generation.stats))
    return response


def stats_to_proto(stats: Stats) -> gateway_pb2.DecodingStats:
    return gateway_pb2.DecodingStats(
        prompt_tokens=stats.prompt_tokens,
        steps=stats.steps,
        draft_tokens=stats.draft_tokens,
        accepted_draft_tokens=stats.accepted_draft_tokens,
        mean_accepted_length=stats.mean_accepted_length,
        decoding_method=stats.decoding_method,
        ttft_ms=stats.ttft_ms,
        total_ms=stats.total_ms,
        gateway_ms=stats.gateway_ms,
        drafter_ms=stats.drafter_ms,
        verifier_ms=stats.verifier_ms,
        verifier_compute_ms=stats.verifier_compute_ms,
        cached_prompt_tokens=stats.cached_prompt_tokens,
        accepted_prediction_tokens=stats.accepted_prediction_tokens,
        rejected_prediction_tokens=stats.rejected_prediction_tokens,
    )


def served_model_to_proto(served: ServedModel) -> gateway_pb2.ServedModel:
    decoding = served.decoding
    return gateway_pb2.ServedModel(
        model=served.model,
        architecture=served.architecture,
        quantization=served.quantization,
        max_seq_len=served.max_seq_len,
        max_input_tokens=served.max_input_tokens,
        truncation=served.truncation,
        vocab_size=served.vocab_size,
        device=served.device,
        default_max_new_tokens=served.default_max_new_tokens,
        max_new_tokens_limit=served.max_new_tokens_limit,
        chat_template=served.chat_template,
        decoding=gateway_pb2.ParallelDecoding(
            method=decoding.method,
            decoding_length=decoding.decoding_length,
            dynamic_algo=decoding.dynamic_algo,
            level=decoding.level,
            window=decoding.window,
            guess_set_size=decoding.guess_set_size,
            speculation_gamma=decoding.speculation_gamma,
            shared_memory=decoding.shared_memory,
        ),
        verifier_replicas=served.verifier_replicas,
        prefix_block_tokens=served.prefix_block_tokens,
        tool_call_layout=served.tool_call_layout,
        generation_defaults=common_pb2.GenerationDefaults(**dict(served.generation_defaults)),
        attention=served.attention,
        kv_cache_dtype=served.kv_cache_dtype,
        embedding_dtype=served.embedding_dtype,
        embedding_rounded=served.embedding_rounded,
    )


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, generator: Generator, authenticator: Authenticator | None = None):
        self.generator = generator
        self.authenticator = authenticator or Authenticator()
        self._requests = generator.metrics.requests

    def add_to(self, server: grpc.Server) -> None:
        add_servicer(server, self, gateway_pb2.DESCRIPTOR.services_by_name["Gateway"])

    @maps_errors
    def Generate(self, request, context):
        # The client's deadline and cancel bound every internal call (gateway/deadlines.py):
        # gRPC ends the RPC at either, and the termination callback stops the call in flight.
        deadline = _request_deadline(context)
        with self._requests.track("Generate"), self.generator.reports.refusals(deadline) as refusals:
            tenant = refusals.tenant = self.authenticator.tenant(context)
            request = request_from_proto(request, tenant, self.generator.model.model_name)
            if request.n > 1:
                raise InvalidArgument("n: Generate returns one sequence; GenerateStream returns n, each message "
                                      "with its sequence's index")
            context.add_callback(deadline.cancel)
            generation = (generate_sequences(self.generator, request, deadline)[0] if request.use_beam_search
                          else self.generator.generate(request, deadline))
            return response_to_proto(generation, self.generator.model.model_name, self.generator.answers.reader(request))

    @maps_errors
    def GenerateStream(self, request, context):
        # A client cancel (or deadline) ends the RPC while this generator may be parked at a
        # yield that gRPC will never resume: the termination callback closes the stream there,
        # which releases the verifier and drafter sessions at once. If the stream is running a
        # step instead, the cancel stops the step's internal call and the stream ends
        # (`deadline`); the callback's close is retried until it goes through.
        deadline = _request_deadline(context)
        with self._requests.track("GenerateStream"), self.generator.reports.refusals(deadline) as refusals:
            tenant = refusals.tenant = self.authenticator.tenant(context)
            request = request_from_proto(request, tenant, self.generator.model.model_name)
            chunks, readers = stream_sequences(self.generator, request, deadline), {}

            def on_termination():
                deadline.cancel()
                close_when_idle(chunks)

            context.add_callback(on_termination)
            for index, chunk in chunks:
                if index not in readers:  # each sequence's answer is read on its own
                    readers[index] = self.generator.answers.reader(request)
                yield response_to_proto(chunk, self.generator.model.model_name, readers[index], index)

    @maps_errors
    def Tokenize(self, request, context):
        with self._requests.track("Tokenize"):
            self.authenticator.tenant(context)
            core = Request(prompt=request.prompt, messages=tuple(messages_from_proto(request.messages)), raw=request.raw,
                           tools=tools_from_proto(request),
                           chat_template_kwargs=template_variables(request.chat_template_kwargs),
                           continue_final_message=request.continue_final_message)
            served = self.generator.served_model()
            return gateway_pb2.TokenizeResponse(token_ids=self.generator.tokenize(core),
                                                max_input_tokens=served.max_input_tokens,
                                                max_seq_len=served.max_seq_len)

    @maps_errors
    def Detokenize(self, request, context):
        with self._requests.track("Detokenize"):
            self.authenticator.tenant(context)
            return gateway_pb2.DetokenizeResponse(text=self.generator.detokenize(list(request.token_ids)))

    @maps_errors
    def GetServedModel(self, request, context):
        with self._requests.track("GetServedModel"):
            self.authenticator.tenant(context)  # the same caller checks as Generate's
            return served_model_to_proto(self.generator.served_model())


def _request_deadline(context) -> Deadline:
    """The client's deadline as a monotonic time (a call without one has a far one), and its trace."""
    return Deadline.after(context.time_remaining(), trace_of(context.invocation_metadata() or ()))
