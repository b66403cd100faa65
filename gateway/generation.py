"""The gateway's protobuf-free core: one request, driven draft → verify → commit.

``Generator.stream`` yields what each step commits; ``Generator.generate`` is the same stream
joined, so the unary answer and the concatenated stream are equal by construction. Both take the
request's `Deadline` (gateway/deadlines.py): every internal call ends by it, a cancel stops the
call in flight, and either way the request's sessions are released before it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterator

from pardec.gateway.backends import DrafterBackend, VerifierBackend
from pardec.gateway.answers import AnswerFormat
from pardec.gateway.chat import Message, input_tokens
from pardec.gateway.clients import ModelInfo
from pardec.gateway.config import GatewayConfig
from pardec.gateway.deadlines import Deadline
from pardec.gateway.decoding import StreamDecoder, text_tokenizer
from pardec.gateway.drafter_health import Background, DrafterBreaker
from pardec.gateway.draft_ahead import overlap_applies
from pardec.gateway.drafting import DraftSession
from pardec.gateway.governor import Governor
from pardec.gateway.outputs import Chunk, Generation, Stats, joined
from pardec.gateway.prediction import Prediction
from pardec.gateway.request_log import RequestReports
from pardec.gateway.metrics import GatewayMetrics
from pardec.gateway.rules import MODEL, REQUEST, Facts, check
from pardec.gateway.served import ServedModel, default_max_new_tokens, served_model
from pardec.gateway.tools import ToolUse
from pardec.gateway.tree_sizing import CostCurve
from pardec.runtime.draft_params import OVERRIDABLE, DraftOverrides, DraftParams
from pardec.runtime.errors import InvalidArgument, PardecError
from pardec.runtime.security import model_scope, scoped_session_id
from pardec.verifier.api import Prefilled, Sampling

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    prompt: str = ""  # one user message; exactly one of prompt, messages and prompt_token_ids (gateway/chat.py)
    max_new_tokens: int = 0  # 0 = the server's default
    plain: bool = False
    sampling: Sampling = field(default_factory=Sampling)
    n: int = 0
    best_of: int = 0
    use_beam_search: bool = False  # n beams, best first (gateway/beam_search.py); plain decoding's
    length_penalty: float = 1.0  # beam search ranks a beam by logprob / length ** length_penalty (vLLM's)
    logprobs: bool = False  # each token's log-probability, with top_logprobs of the likeliest beside it
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # the prompt tokens' log-probabilities, with this many likeliest
    prompt_token_ids: tuple[int, ...] = ()  # the prompt as ids, as they are: no template, no BOS
    stop: tuple[str, ...] = ()
    session_id: str = ""
    tenant: str = ""  # the caller's tenant ("" anonymous): scopes its shared draft memory
    cache_scope: str = ""  # who may share its cached prompt blocks (runtime/security.py cache_scope)
    draft: DraftOverrides = field(default_factory=DraftOverrides)
    messages: tuple[Message, ...] = ()  # a conversation, rendered with the chat template
    raw: bool = False  # prompt is sent as text, without the chat template
    ignore_eos: bool = False  # generate past the model's end-of-sequence tokens
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    keep_special_tokens: bool = False  # control tokens' spellings stay in the text (vLLM's skip_special_tokens false)
    tools: ToolUse | None = None  # functions the model may call (a required call: held to, in the model's layout)
    chat_template_kwargs: str = ""  # the chat template's own variables, a JSON object's text (chat.template_variables)
    continue_final_message: bool = False  # the answer goes on from the last (assistant) message's text
    bad_words: tuple[str, ...] = ()  # words the output never holds (answers.AnswerFormat.constrained)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens; -1: maxInputTokenLen; None: all
    priority: int = 0  # lower goes first where the verifier must choose between sessions (vLLM's)
    prediction: str = ""  # text the answer will mostly be, drafted from (OpenAI's; gateway/prediction.py)
    sequence: int | None = None  # which of its request's sequences (n, a batch of prompts), where it has several


class Generator:
    def __init__(
        self, config: GatewayConfig, verifier: VerifierBackend, drafter: DrafterBackend, model: ModelInfo,
        metrics: GatewayMetrics | None = None,
    ):
        # MindIE's model rules (W8A8, Llama3/Qwen2/Qwen2.5/Qwen3) against what the verifier serves.
        check(MODEL, config.facts(architecture=model.architecture, quantization=model.quantization))
        self.config = config
        self.verifier = verifier
        self.drafter = drafter
        self.model = model
        self.answers = AnswerFormat(model.tokenizer)  # its thinking and tool calls (gateway/answers.py)
        self.metrics = metrics or GatewayMetrics()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._drafting_in_flight = 0  # of them, requests that may draft
        # Prompts being prefilled now, and prefills begun or ended so far: a step that overlaps
        # one shares its forwards with prompt rows, so the load governor does not count it.
        self._prefills_running = self._prefill_events = 0
        self._cost = CostCurve.from_points(model.cost_curve)  # sizes every step's tree
        self._drafter_breaker = DrafterBreaker()  # new requests leave a hanging drafter alone
        self._drafter_ends = Background()  # EndSessions, which no reply waits for
        policy = config.load_policy
        self._governor = Governor(  # whether drafting pays at all under the current load
            policy.govern_from if config.draft else 0, policy.epoch_rounds, policy.explore_every, policy.min_gain,
            min_epoch_s=policy.epoch_min_s, on_epoch=self.metrics.governor_epoch,
        )
        # A span per sequence to an OTLP collector where one is configured, a log line where asked for.
        self.reports = RequestReports.serving(config.otlp_traces_endpoint, config.log_requests)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def enter(self, drafting: bool = False) -> int:
        """One more request in flight (``drafting``: one that may draft); how many are now, it included."""
        with self._lock:
            self._in_flight += 1
            self._drafting_in_flight += drafting
            in_flight = self._in_flight
        self.metrics.running.inc()
        return in_flight

    def leave(self, drafting: bool = False) -> None:
        """The request `enter` counted has ended."""
        with self._lock:
            self._in_flight -= 1
            self._drafting_in_flight -= drafting
        self.metrics.running.dec()

    def served_model(self) -> ServedModel:
        """What this gateway serves: the model, its limits, the configured parallel decoding."""
        return served_model(self.config, self.model)

    def tokenize(self, request: Request) -> list[int]:
        """The tokens ``generate`` prefills for ``request``'s input (before any truncation),
        refused as ``generate`` refuses that input."""
        check(REQUEST, Facts(plugin_params=None, request=request))
        return self._input_ids(request)

    def _input_ids(self, request: Request) -> list[int]:
        """The request's input as the model's tokens, before any truncation."""
        if not request.prompt_token_ids:
            return input_tokens(self.model.tokenizer, request.prompt, request.messages, request.raw, request.tools,
                                request.chat_template_kwargs, request.continue_final_message)
        if request.prompt or request.messages or request.tools or request.chat_template_kwargs:
            raise InvalidArgument("prompt_token_ids: send one of prompt, messages and prompt_token_ids (tools "
                                  "go with prompt or messages)")
        self._check_tokens("prompt_token_ids", request.prompt_token_ids)
        return list(request.prompt_token_ids)

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, decoded as generated tokens are."""
        if len(token_ids) > self.model.max_seq_len:
            raise InvalidArgument(f"token_ids: {len(token_ids)} tokens; at most max_seq_len {self.model.max_seq_len}")
        self._check_tokens("token_ids", token_ids)
        return self.model.tokenizer.decode(token_ids)

    def _check_tokens(self, name: str, token_ids) -> None:
        for index, token in enumerate(token_ids):
            if self.model.vocab_size and token >= self.model.vocab_size:
                raise InvalidArgument(f"{name}[{index}]: {token} is not a token of the model "
                                      f"(its vocabulary has {self.model.vocab_size})")

    def generate(self, request: Request, deadline: Deadline | None = None) -> Generation:
        return joined(list(self.stream(request, deadline)))

    def stream(self, request: Request, deadline: Deadline | None = None) -> Iterator[Chunk]:
        """Yields each step's committed tokens; stops early (releasing everything) with
        Cancelled or DeadlineExceeded once ``deadline`` is cancelled or passes, or when the
        consumer closes the iterator."""
        deadline = deadline or Deadline()
        started, started_ns = time.perf_counter(), time.time_ns()
        try:
            request = dataclasses.replace(request, sampling=self.answers.constrained(request))
            prompt_ids, max_new, draft = self.admit(request)
            prediction = self._prediction(request)
        except Exception as error:  # refused: its report (a span in its caller's trace, a log line) says why
            self.reports.begin(deadline, request.tenant, request.sequence).end({}, error)
            raise
        stats = Stats(prompt_tokens=len(prompt_ids), decoding_method=draft.plugin_type if draft else "plain")
        stats.prediction_tokens = len(prediction.tokens) if prediction else 0
        session_id = uuid.uuid4().hex
        eos = frozenset() if request.ignore_eos else self.model.stop_token_ids
        decoder = StreamDecoder(text_tokenizer(self.model.tokenizer, request.keep_special_tokens), eos, request.stop,
                                max_new, frozenset(request.stop_token_ids), request.include_stop_str_in_output,
                                request.sampling.min_tokens)
        drafts = draft and DraftSession(
            self.drafter, session_id, draft, self.config, self.metrics.drafter_fallback, self._cost,
            breaker=self._drafter_breaker, background=self._drafter_ends, vocab_size=self.model.vocab_size,
            overlap=overlap_applies(self.config.overlap_drafting, self.model.device, draft.plugin_type, draft.dynamic_algo),
        )
        span, failure = self.reports.begin(deadline, request.tenant, request.sequence), None
        in_flight_at_admission = self.enter(drafting=bool(drafts))
        last_tokens: list[int] = []  # the last step's output, which no Propose carried: EndSession does
        try:
            if drafts:
                # One memory per tenant and model: a tenant's outputs never draft for another.
                shared = scoped_session_id(request.tenant, model_scope(self.model.model_name)) if self.config.shared_memory else ""
                feeds_memory = bool(request.session_id or shared)
                start_now = self.config.load_policy.starts_at_admission(in_flight_at_admission, feeds_memory)
                drafts.start(prompt_ids, client_session_id=request.session_id, shared_memory=shared,
                             defer=not start_now)
            clock = time.perf_counter()
            with span.current():  # the verifier's prefill span is this one's child
                prefilled = self._prefill(session_id, prompt_ids, request, deadline, max_new)
            first, stats.cached_prompt_tokens = prefilled.token, prefilled.cached_tokens
            stats.verifier_ms += _ms_since(clock)
            stats.ttft_ms = _ms_since(started)
            self.metrics.ttft.observe(stats.ttft_ms / 1e3)
            new_tokens, node_argmax = [first], []
            logprobs = [prefilled.logprob] if prefilled.logprob is not None else []  # as decoder.tokens
            # The first chunk carries the prompt's scores, where asked for.
            prompt = {"prompt_tokens": len(prompt_ids), "cached_tokens": prefilled.cached_tokens}
            if request.prompt_logprobs is not None:
                prompt |= {"prompt_token_ids": prompt_ids, "prompt_logprobs": list(prefilled.prompt_logprobs)}
            committed_at, prefills_before = time.perf_counter(), self._prefill_events
            while True:
                piece = decoder.add(new_tokens)
                sent = len(decoder.tokens)  # the piece's tokens are the last sent, cut at a stop
                if prediction:
                    prediction.commit(piece.token_ids)  # the step's tokens the answer keeps
                    stats.accepted_prediction_tokens = prediction.accepted
                piece_logprobs = logprobs[sent - len(piece.token_ids): sent]
                if piece.done:
                    # Only what the reply holds: a step may commit tokens past a stop string or EOS.
                    last_tokens = list(piece.token_ids)
                    stats.total_ms = _ms_since(started)
                    self.metrics.finished(stats, len(decoder.tokens), decoder.finish_reason)
                    yield Chunk(piece.text, piece.token_ids, decoder.finish_reason, stats, piece_logprobs, **prompt)
                    return
                if piece.text or piece.token_ids:
                    yield Chunk(piece.text, piece.token_ids, logprobs=piece_logprobs, **prompt)
                    prompt = {}
                deadline.check()
                tokens, parents = [], []
                remaining = max_new - len(decoder.tokens)
                in_flight = self._in_flight
                drafting = self._governor.drafting(in_flight)
                if drafts:
                    # The verifier's session holds the prompt and every committed token but the
                    # last (this step's root); root + tree must fit under maxSeqLen.
                    room = self.model.max_seq_len - len(prompt_ids) - len(decoder.tokens)
                    clock = time.perf_counter()
                    tokens, parents = drafts.propose(
                        new_tokens, in_flight, remaining - 1, prediction.drafter_rows(node_argmax) if prediction
                        else node_argmax, drafting, max_nodes=room, deadline=deadline,
                    )
                    if prediction:  # its chain joins the drafter's tree (a depth of 0: none this step)
                        policy = self.config.load_policy
                        depth = remaining - 1 if drafting and policy.drafts_at(in_flight) else 0
                        tokens, parents = prediction.tree((tokens, parents, drafts.estimates), depth, min(
                            room, draft.tokens_per_step), drafts.costs.step_ms(in_flight), policy.min_gain)
                    stats.drafter_ms += _ms_since(clock)
                clock = time.perf_counter()
                verified = self.verifier.verify(session_id, tokens, parents, deadline)
                stats.verifier_ms += _ms_since(clock)
                if drafts:
                    drafts.costs.observe(verified, len(tokens), _ms_since(clock), in_flight)
                # Every request's steps count, plain ones too (others' trees slow them as well),
                # unless none in flight may draft: both arms are then the same.
                step_s, committed_at = time.perf_counter() - committed_at, time.perf_counter()
                quiet = not self._prefills_running and self._prefill_events == prefills_before
                if quiet and self._drafting_in_flight:
                    self._governor.record(in_flight, drafting, len(verified.accepted_tokens) + 1, step_s)
                prefills_before = self._prefill_events
                self.metrics.step(len(tokens), len(verified.accepted_tokens), _ms_since(clock) / 1e3, step_s)
                stats.count_step(len(tokens), len(verified.accepted_tokens), verified.compute_ms)
                new_tokens = [*verified.accepted_tokens, verified.bonus_token]
                node_argmax = verified.node_argmax
                logprobs.extend(verified.logprobs)
        except BaseException as error:  # a consumer closing the stream after its last chunk is no failure
            failure = None if isinstance(error, GeneratorExit) and stats.total_ms else error
            raise
        finally:
            # The span ends with the last token (not with the release below, or a slow reader).
            ended_ns = started_ns + int(stats.total_ms * 1e6) if stats.total_ms else time.time_ns()
            try:
                self.leave(drafting=bool(drafts))
                self._release(session_id, drafts, last_tokens, ended_early=deadline.cancelled or deadline.expired)
            finally:
                span.end({"gen_ai.response.model": self.model.model_name, "gen_ai.request.max_tokens": max_new,
                          "gen_ai.request.temperature": request.sampling.temperature, "gen_ai.request.top_p":
                          request.sampling.top_p, "gen_ai.latency.e2e": (ended_ns - deadline.arrived_ns) / 1e9,
                          **stats.span_attributes(len(decoder.tokens))}, failure, ended_ns)

    def _prediction(self, request: Request) -> Prediction | None:
        """The request's prediction as the model's tokens, None without one."""
        if not request.prediction:
            return None
        tokens = self.model.tokenizer.encode_text(request.prediction)
        if len(tokens) > self.model.max_seq_len:
            raise InvalidArgument(f"prediction: {len(tokens)} tokens exceed maxSeqLen {self.model.max_seq_len}: "
                                  "no answer could be that long")
        return Prediction(tokens)

    @contextlib.contextmanager
    def prefilling(self) -> Iterator[None]:
        """A prompt is prefilled meanwhile (beam search's rounds too): the steps that overlap it
        share forwards with prompt rows, so the load governor does not count them."""
        with self._lock:
            self._prefills_running, self._prefill_events = self._prefills_running + 1, self._prefill_events + 1
        try:
            yield
        finally:
            with self._lock:
                self._prefills_running, self._prefill_events = self._prefills_running - 1, self._prefill_events + 1

    def _prefill(
        self, session_id: str, prompt_ids: list[int], request: Request, deadline: Deadline, max_new: int
    ) -> Prefilled:
        # A tenant's cached prompt blocks are its own: no tenant learns of another's prompts
        # from its own time to first token.
        ends = () if request.ignore_eos else tuple(sorted(self.model.stop_token_ids))  # held back by min_tokens
        sampling = dataclasses.replace(request.sampling, prompt_logprobs=request.prompt_logprobs,
                                       stop_token_ids=(*ends, *request.stop_token_ids))
        if request.logprobs:
            sampling = dataclasses.replace(sampling, logprobs=request.top_logprobs)
        with self.prefilling():
            return self.verifier.prefill(session_id, prompt_ids, sampling, deadline, max_new_tokens=max_new,
                                         cache_scope=request.cache_scope, priority=request.priority)

    def admit(self, request: Request) -> tuple[list[int], int, DraftParams | None]:
        """Checks the request; returns its prompt tokens, max_new_tokens and drafting parameters."""
        draft = None if request.plain else self._draft_for(request.draft)
        facts = Facts(plugin_params=dataclasses.asdict(draft) if draft else None, request=request,
                      speculation_gamma=self.config.speculation_gamma, max_iter_times=self.config.max_iter_times)
        max_new = request.max_new_tokens or default_max_new_tokens(self.config, facts, self.model)
        check(REQUEST, dataclasses.replace(facts, max_new_tokens=max_new))
        for name, ids in (("stop_token_ids", request.stop_token_ids),
                          ("sampling.allowed_token_ids", request.sampling.allowed_token_ids),
                          ("sampling.logit_bias", [token for token, _ in request.sampling.logit_bias])):
            self._check_tokens(name, ids)
        prompt_ids = self.prompt_tokens(request)
        if not request.max_new_tokens:  # vLLM's: no limit asked, what the context leaves at most
            max_new = max(1, min(max_new, self.model.max_seq_len - len(prompt_ids)))
            if request.sampling.min_tokens > max_new:  # the rules saw the default: say what it became
                raise InvalidArgument(f"min_tokens: {request.sampling.min_tokens} exceeds the {max_new} tokens the context leaves")
        if len(prompt_ids) + max_new > self.model.max_seq_len:
            raise InvalidArgument(f"max_new_tokens: prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new}) "
                                  f"exceeds maxSeqLen {self.model.max_seq_len}")
        return prompt_ids, max_new, draft

    def _draft_for(self, limits: DraftOverrides) -> DraftParams | None:
        """The server's plugin_params lowered by the request's limits (never raised)."""
        server = self.config.draft
        if server is None:
            return None
        lowered = {}
        # Each limit's lowest value is its row's (MindIE's range); its highest the server's own.
        for name, floor in ((param.name, param.low) for param in OVERRIDABLE):
            value = getattr(limits, name)
            if value is None:
                continue
            ceiling = getattr(server, name)
            if not floor <= value <= ceiling:
                raise InvalidArgument(
                    f"draft.{name}: {value} must be in [{floor}, {ceiling}] (at most the server's {name})"
                )
            lowered[name] = value
        return dataclasses.replace(server, **lowered)

    def prompt_tokens(self, request: Request) -> list[int]:
        """The tokens ``generate`` prefills for ``request``'s input (truncated as it truncates them:
        to its truncate_prompt_tokens, as vLLM's, then to maxInputTokenLen where truncation is on)."""
        ids = self._input_ids(request)
        limit, keep = self.config.max_input_tokens, request.truncate_prompt_tokens
        if keep is not None:
            if not (keep == -1 or 1 <= keep <= limit):
                raise InvalidArgument(f"truncate_prompt_tokens: must be -1 (maxInputTokenLen) or in [1, {limit}], "
                                      f"got {keep}")
            ids = ids[-(limit if keep == -1 else keep):]  # the end: the question and the assistant header
        if len(ids) > limit:
            if not self.config.truncation:
                raise InvalidArgument(
                    f"{'messages' if request.messages else 'prompt'}: {len(ids)} tokens exceed "
                    f"maxInputTokenLen {limit} (truncation is off)"
                )
            ids = ids[-limit:]  # keep the end: the question and the assistant header
        return ids

    def _release(
        self, session_id: str, drafts: DraftSession | None, last_tokens: list[int], ended_early: bool = False
    ) -> None:
        """Best effort: a failed release only leaves state that expires on its own. The drafter's
        session ends in the background (DraftSession.end); a request the client gave up on does
        not wait for it at all."""
        cleanups = [lambda: self.verifier.release(session_id)]
        if drafts:
            cleanups.append(lambda: drafts.end(last_tokens, wait=not ended_early))
        for cleanup in cleanups:
            try:
                cleanup()
            except PardecError as error:
                log.warning("release of session %s failed: %s", session_id, error)


def _ms_since(clock: float) -> float:
    return (time.perf_counter() - clock) * 1e3
