"""OpenAI's response bodies, protobuf-free: a `Generation`, or each `Chunk` of a stream, becomes
OpenAI's JSON for chat or completions, log-probabilities included in each one's shape: chat's
list of entries (a token, its log-probability, its bytes and its likeliest alternatives) and
completions' parallel arrays, the prompt's first where the request echoes it.

A token is shown as its text when its bytes are whole UTF-8, else as "bytes:\\xNN..." (a
byte-level piece that is part of a character), as vLLM does; `bytes` always holds the exact ones.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Sequence

from pardec.gateway.outputs import Chunk, Generation, Stats
from pardec.gateway.answers import AnswerReader, thinking_tokens
from pardec.gateway.call_readers import CallDelta
from pardec.gateway.tools import ToolCall
from pardec.runtime.errors import InvalidArgument
from pardec.verifier.api import TokenLogprob

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
# Every sequence's, summed where a request's sequences are reported as one.
PREDICTION_COUNTS = ("prediction_tokens", "accepted_prediction_tokens")


def usage_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """stream_options' include_usage, and vLLM's continuous_usage_stats (usage in every chunk)."""
    options = body.get("stream_options") or {}
    flags = [False if options.get(name) is None else options[name] for name in ("include_usage", "continuous_usage_stats")]
    for name, flag in zip(("include_usage", "continuous_usage_stats"), flags):
        if not isinstance(flag, bool):
            raise InvalidArgument(f"stream_options.{name}: must be true or false")
    return flags[0], flags[0] and flags[1]


def completion_id(chat: bool, request_id: str = "") -> str:
    """The reply's id: the request's own where it has one (its X-Request-Id, or the id its log line
    and span say, as vLLM names a reply after its request), else a new one."""
    return ("chatcmpl-" if chat else "cmpl-") + (request_id or uuid.uuid4().hex)


def usage(stats: Stats, completion_tokens: int, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage, with how parallel decoding made the text under ``pardec``; a thinking
    model's answers say how many of their tokens wrote the thinking (``reasoning_tokens``), an
    answer to a prediction how many of its tokens did and did not appear (gateway/prediction.py)."""
    details = {} if reasoning_tokens is None else {"reasoning_tokens": reasoning_tokens}
    if stats.prediction_tokens:
        details.update(accepted_prediction_tokens=stats.accepted_prediction_tokens,
                       rejected_prediction_tokens=stats.rejected_prediction_tokens)
    details = {"completion_tokens_details": details} if details else {}
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": stats.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
        **details,
        "pardec": {
            "decoding_method": stats.decoding_method,
            "steps": stats.steps,
            "draft_tokens": stats.draft_tokens,
            "accepted_draft_tokens": stats.accepted_draft_tokens,
            "mean_accepted_length": round(stats.mean_accepted_length, 4),
        },
    }


def chat_response(
    generation: Generation, model: str, response_id: str, created: int, tokenizer=None,
    answer: AnswerReader | None = None, prompt_scores: bool = False,
) -> dict[str, Any]:
    """With ``answer`` (how the request's answer reads), the model's thinking is the message's
    reasoning_content and the calls the text makes its tool_calls; with ``prompt_scores``, the
    prompt's tokens scored as vLLM's prompt_logprobs."""
    logprobs = generation.logprobs and chat_logprobs(tokenizer, generation.token_ids, generation.logprobs)
    message, finish = {"role": "assistant", "content": generation.text}, FINISH_REASONS[generation.finish_reason]
    reasoning_tokens = None
    if answer is not None:
        piece = answer.step(generation.text, finish)
        finish, message["content"] = piece.finish_reason, piece.content
        if piece.calls:
            message = {"role": "assistant", "content": piece.content.strip() or None,
                       "tool_calls": [tool_call(call) for call in piece.calls]}
        if answer.thinks:
            message["reasoning_content"] = piece.reasoning or None
            if tokenizer is not None:
                reasoning_tokens = thinking_tokens(tokenizer, generation.token_ids, piece.reasoning)
    reply = {
        "id": response_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs or None, "finish_reason": finish}],
        "usage": usage(generation.stats, len(generation.token_ids), reasoning_tokens),
    }
    return {**reply, "prompt_logprobs": prompt_logprobs(tokenizer, generation)} if prompt_scores else reply


def prompt_logprobs(tokenizer, generation: Generation) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: for each prompt token (None for the first, which nothing
    precedes), {token id: {"logprob", "rank", "decoded_token"}} of it and the likeliest beside
    it; a rank (1: the likeliest) where the token is among those listed."""
    scores: list[dict[str, Any] | None] = [None] if generation.prompt_token_ids else []
    for token, scored in zip(generation.prompt_token_ids[1:], generation.prompt_logprobs):
        ranks = {listed: rank for rank, (listed, _) in enumerate(scored.top, 1)}
        entries = {token: scored.logprob, **dict(scored.top)}
        scores.append({str(t): {"logprob": lp, "rank": ranks.get(t), "decoded_token": tokenizer.decode([t])}
                       for t, lp in entries.items()})
    return scores


def tool_call(call: ToolCall) -> dict[str, Any]:
    """A call as OpenAI's JSON."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta(delta: CallDelta) -> dict[str, Any]:
    """A streamed call's entry as OpenAI's JSON: its id, type and name on its first, then its arguments' new text."""
    if not delta.id:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {"index": delta.index, "id": delta.id, "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments}}


def completion_response(
    generation: Generation, model: str, response_id: str, created: int, tokenizer=None, echo: str | None = None,
    prompt_only: bool = False, prompt_scores: bool = False,
) -> dict[str, Any]:
    """``echo``: the prompt's text, which the text then starts with (and its tokens the logprobs);
    ``prompt_only``: nothing generated is sent (echo with max_tokens 0: the prompt scored);
    ``prompt_scores``: the choice's prompt_logprobs (vLLM's)."""
    generation = _without_output(generation) if prompt_only else generation
    logprobs = None
    if generation.logprobs or (echo is not None and generation.prompt_token_ids):  # asked for (echoed: the prompt's)
        logprobs = completion_logprobs(tokenizer, _scored(generation, echo is not None))
    choice = {"index": 0, "text": (echo or "") + generation.text, "logprobs": logprobs,
              "finish_reason": FINISH_REASONS[generation.finish_reason]}
    if prompt_scores:
        choice["prompt_logprobs"] = prompt_logprobs(tokenizer, generation)
    return {"id": response_id, "object": "text_completion", "created": created, "model": model, "choices": [choice],
            "usage": usage(generation.stats, len(generation.token_ids))}


def with_token_ids(reply: dict[str, Any], token_ids: list[int], prompt_ids: list[int], chat: bool) -> dict[str, Any]:
    """vLLM's return_token_ids: the choice's token ids, and the prompt's (chat: beside the choices;
    completions: in the choice, each prompt of a batch its own)."""
    reply["choices"][0]["token_ids"] = list(token_ids)
    (reply if chat else reply["choices"][0])["prompt_token_ids"] = list(prompt_ids)
    return reply


def _without_output(generation):
    """A Generation or Chunk as if it had made no token: the reply to a prompt scored alone."""
    return dataclasses.replace(generation, text="", token_ids=[], logprobs=[],
                               finish_reason=generation.finish_reason and "length")


def _scored(generation: Generation | Chunk, echo: bool) -> list[tuple[int, TokenLogprob | None]]:
    """Each token with its log-probability: the prompt's first where echoed (its first token has
    none: nothing precedes it), then the generated ones."""
    prompt = zip(generation.prompt_token_ids, [None, *generation.prompt_logprobs]) if echo else ()
    return [*prompt, *zip(generation.token_ids, generation.logprobs)]


class ChunkWriter:
    """The SSE chunks of one streamed response: the first carries the assistant's role, the last
    the finish reason, and with ``include_usage`` one more with empty choices and the usage. With
    a ``tokenizer`` (the request asked for logprobs), each chunk carries its tokens'; with
    ``echo`` (completions), the first starts with the prompt's text (and tokens). With ``answer``
    (chat: how the request's answer reads), a thinking model's thinking comes as
    reasoning_content deltas, and a call's text is never content: a call's first delta comes
    once its name is read, then its arguments' text as it arrives. With ``prompt_ids`` (vLLM's
    return_token_ids), the first chunk carries the prompt's token ids (as with_token_ids places
    them) and each chunk its tokens', those of text held back going with the next one sent."""

    def __init__(
        self, chat: bool, model: str, include_usage: bool, tokenizer=None, echo: str | None = None,
        prompt_only: bool = False, answer: AnswerReader | None = None, index: int = 0, counter=None,
        prompt_ids: list[int] | None = None, continuous_usage: bool = False, reply_id: str = "",
    ):
        self._prompt_ids = prompt_ids
        self._continuous_usage = continuous_usage  # vLLM's continuous_usage_stats: each chunk, the usage so far
        self._prompt_tokens = 0
        self._unsent_ids: list[int] = []  # return_token_ids: tokens whose chunk is still to be sent
        self._answer = answer if chat else None
        # A thinking model's answer counts the tokens that wrote its thinking (``counter``: the tokenizer).
        self._counter = counter if self._answer is not None and self._answer.thinks else None
        self._token_ids: list[int] = []
        self._reasoning = ""
        self.reasoning_tokens: int | None = None  # once finished, for a thinking model's answer
        self.index = index  # the sequence's, among the request's n
        self.chat = chat
        self.prompt_only = prompt_only  # as completion_response's
        self.tokenizer = tokenizer
        self.echo = echo
        self._offset = 0  # characters of the completion before the chunk's tokens (text_offset)
        self.model = model
        self.include_usage = include_usage
        self.id = reply_id or completion_id(chat)
        self.created = int(time.time())
        self._tokens = 0
        self._started = False
        self._started_ids = False

    def chunks(self, chunk: Chunk) -> list[dict[str, Any]]:
        chunk = _without_output(chunk) if self.prompt_only else chunk
        self._tokens += len(chunk.token_ids)
        self._prompt_tokens = self._prompt_tokens or chunk.prompt_tokens
        if self._counter is not None:
            self._token_ids += chunk.token_ids
        finish = FINISH_REASONS[chunk.finish_reason] if chunk.finish_reason else None
        out = []
        role = self.chat and not self._started  # out[0]: the role's chunk, before any token
        if role:
            out.append(self._chunk({"role": "assistant", "content": ""}, None))
        echo, self.echo = (self.echo or "") if not self._started else "", None
        self._started = True
        logprobs = None
        if self.tokenizer is not None and (chunk.token_ids or chunk.prompt_token_ids):
            if self.chat:
                logprobs = chat_logprobs(self.tokenizer, chunk.token_ids, chunk.logprobs)
            else:
                scored = _scored(chunk, bool(chunk.prompt_token_ids))
                logprobs = completion_logprobs(self.tokenizer, scored, self._offset)
                self._offset += sum(len(self.tokenizer.decode([token])) for token, _ in scored)
        text = echo + chunk.text
        calls, reasoning = [], ""
        if self._answer is not None:
            piece = self._answer.step(text, finish or "")
            text, finish, reasoning = piece.content, piece.finish_reason or None, piece.reasoning
            calls = [tool_call_delta(delta) for delta in piece.deltas]
            self._reasoning += reasoning
            if finish and self._counter is not None:
                self.reasoning_tokens = thinking_tokens(self._counter, self._token_ids, self._reasoning)
        if reasoning:
            out.append(self._chunk({"reasoning_content": reasoning}, None))
        if text or (finish and not calls) or logprobs:
            out.append(self._chunk({"content": text} if self.chat else text, None if calls else finish, logprobs))
        if calls:
            out.append(self._chunk({"tool_calls": calls}, finish))
        if self._prompt_ids is not None:
            self._with_token_ids(out, chunk.token_ids)
        if self._continuous_usage:
            for position, item in enumerate(out):
                done = 0 if role and position == 0 else self._tokens
                item["usage"] = {"prompt_tokens": self._prompt_tokens, "completion_tokens": done,
                                 "total_tokens": self._prompt_tokens + done}
        if finish and self.include_usage and chunk.stats is not None:
            out.append({**self._chunk(None, None), "choices": [],
                        "usage": usage(chunk.stats, self._tokens, self.reasoning_tokens)})
        return out

    def _with_token_ids(self, out: list[dict[str, Any]], token_ids: list[int]) -> None:
        self._unsent_ids += token_ids
        if not out:
            return
        if not self._started_ids:
            self._started_ids = True
            with_token_ids(out[0], [], self._prompt_ids, self.chat)
        out[-1]["choices"][0]["token_ids"], self._unsent_ids = self._unsent_ids, []

    def _chunk(self, delta, finish: str | None, logprobs: dict | None = None) -> dict[str, Any]:
        head = {"id": self.id, "created": self.created, "model": self.model}
        if self.chat:
            choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return {**head, "object": "chat.completion.chunk", "choices": [choice]}
        choice = {"index": self.index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}
        return {**head, "object": "text_completion", "choices": [choice]}


class SequencesWriter:
    """The SSE chunks of a response of n sequences: each sequence's own (`ChunkWriter`, made
    without usage), under one id, and with ``include_usage`` one usage chunk once every sequence
    has finished (completion tokens summed; the prompt counted once)."""

    def __init__(self, writers: list[ChunkWriter], include_usage: bool, n: int = 1):
        self.writers = writers
        self.include_usage = include_usage
        self.n = n  # sequences a prompt (a batch's prompts are n sequences each)
        for writer in writers[1:]:
            writer.id, writer.created = writers[0].id, writers[0].created
        self._stats: dict[int, Stats] = {}  # each sequence's, by its index
        self._finished = 0

    def chunks(self, item: tuple[int, Chunk]) -> list[dict[str, Any]]:
        index, chunk = item
        out = self.writers[index].chunks(chunk)
        if chunk.finish_reason:
            self._finished += 1
            if chunk.stats is not None:
                self._stats[index] = chunk.stats
            if self._finished == len(self.writers) and self.include_usage and self._stats:
                tokens = sum(writer._tokens for writer in self.writers)
                stats = sequences_stats(self._stats, self.n)
                counted = [writer.reasoning_tokens for writer in self.writers if writer.reasoning_tokens is not None]
                out.append({**self.writers[0]._chunk(None, None), "choices": [],
                            "usage": usage(stats, tokens, sum(counted) if counted else None)})
        return out


def sequences_stats(each: dict[int, Stats], n: int) -> Stats:
    """A request's sequences' stats (by index; a batch's prompts are n sequences each) as one: the
    first's, with every prompt's tokens, cached tokens, steps and drafts counted from its first
    sequence, and every sequence's prediction counts."""
    firsts = [stats for index, stats in sorted(each.items()) if index % n == 0]
    counted = ("prompt_tokens", "cached_prompt_tokens", "steps", "draft_tokens", "accepted_draft_tokens")
    return dataclasses.replace(firsts[0], **{name: sum(getattr(stats, name) for stats in firsts) for name in counted},
                               **{name: sum(getattr(stats, name) for stats in each.values()) for name in PREDICTION_COUNTS})


def merged(replies: list[dict[str, Any]], generations: list[Generation], n: int = 1) -> dict[str, Any]:
    """The replies of a request's sequences as one: each one's choice at its index, the
    completion tokens summed, each prompt counted once (a batch's prompts are n sequences each)."""
    if len(replies) == 1:
        return replies[0]
    choices = [{**reply["choices"][0], "index": index} for index, reply in enumerate(replies)]
    stats = sequences_stats(dict(enumerate(generation.stats for generation in generations)), n)
    counted = [reply["usage"]["completion_tokens_details"]["reasoning_tokens"] for reply in replies
               if "reasoning_tokens" in reply["usage"].get("completion_tokens_details", {})]
    return {**replies[0], "choices": choices, "usage": usage(
        stats, sum(len(generation.token_ids) for generation in generations), sum(counted) if counted else None)}


def token_text(data: bytes) -> str:
    """A token's bytes as text, or spelled out when they are not whole UTF-8.

    >>> token_text(b" w\\xc3\\xa9"), token_text(b" \\xf0\\x9f")
    (' wé', 'bytes:\\\\x20\\\\xf0\\\\x9f')
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)


def chat_logprobs(tokenizer, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Chat's `choices[].logprobs` for these tokens (a message's, or a stream chunk's)."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        data = tokenizer.token_bytes(token)
        return {"token": token_text(data), "logprob": logprob, "bytes": list(data)}

    return {"content": [
        {**entry(token, logprob.logprob), "top_logprobs": [entry(t, lp) for t, lp in logprob.top]}
        for token, logprob in zip(token_ids, logprobs)
    ]}


def completion_logprobs(tokenizer, scored: Sequence[tuple[int, TokenLogprob | None]], offset: int = 0) -> dict[str, Any]:
    """Completions' `choices[].logprobs` of (token, its log-probability or None) pairs; `offset`:
    the characters of the text before these tokens (a stream's earlier chunks), where
    `text_offset` starts counting."""
    offsets = []
    for token, _ in scored:
        offsets.append(offset)
        offset += len(tokenizer.decode([token]))
    return {
        "tokens": [token_text(tokenizer.token_bytes(token)) for token, _ in scored],
        "token_logprobs": [None if logprob is None else logprob.logprob for _, logprob in scored],
        # The chosen token's with the likeliest ones, always (OpenAI's: up to logprobs + 1 entries).
        "top_logprobs": [None if logprob is None else {token_text(tokenizer.token_bytes(t)): lp for t, lp in (
                         *logprob.top, (token, logprob.logprob))} for token, logprob in scored],
        "text_offset": offsets,
    }
