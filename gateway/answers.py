"""How the served model writes its answers (`AnswerFormat`), and an answer read back as it
streams (`AnswerReader`): the thinking a reasoning model writes first, apart from its answer
(vLLM's ``reasoning_content``), and the tool calls in the answer (gateway/call_readers.py).

A model thinks first where its chat template writes <think> blocks (Qwen3, the DeepSeek-R1
distills of Qwen and Llama). Its thinking is the text of the block: from an opening <think> at
the start of the answer, or from the start itself where the template's turn opening already
opened the block (DeepSeek-R1's; Qwen3's with thinking on), to the closing </think>; the
whitespace after it is the layout's. An answer cut short inside its thinking is all thinking.
Qwen3's ``chat_template_kwargs`` ``{"enable_thinking": false}`` closes the block in the turn
opening: the answer is then all answer.

    >>> reader = ReasoningReader(starts_inside=False)
    >>> reader.feed("<think>\\nThe user greets")
    ('\\nThe user greets', '')
    >>> reader.feed(".\\n</thi"), reader.feed("nk>\\n\\nHello!"), reader.finish()
    (('.\\n', ''), ('', 'Hello!'), ('', ''))
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from jinja2.exceptions import TemplateError

from pardec.gateway.call_layouts import constrained, layout_of, reader_for
from pardec.gateway.call_readers import CallDelta, CallReader
from pardec.gateway.json_scan import WHITESPACE, partial_tag
from pardec.gateway.tools import ToolCall
from pardec.verifier.api import Sampling
from pardec.verifier.engine.bad_words import word_sequences
from pardec.verifier.structured_output import THINK, UNTHINK

_START, _THINKING, _AFTER, _ANSWER = range(4)
_REMEMBERED = 256  # template variables whose turn opening is remembered


class ReasoningReader:
    """Splits a thinking model's text as it streams: `feed` returns (thinking, answer) pieces,
    never a piece of a tag in either; `finish` returns what is left (a tag cut short by the end
    of the answer is text of the part it is in)."""

    def __init__(self, starts_inside: bool):
        self._state = _THINKING if starts_inside else _START
        self._pending = ""
        self._blank = ""  # _START: the whitespace so far, the answer's if no <think> follows

    def feed(self, text: str) -> tuple[str, str]:
        if self._state == _ANSWER:
            return "", text
        self._pending += text
        thinking = ""
        if self._state == _START:
            rest = self._pending.lstrip(WHITESPACE)
            self._blank, self._pending = self._blank + self._pending[:len(self._pending) - len(rest)], rest
            if rest.startswith(THINK):
                self._state, self._pending, self._blank = _THINKING, rest[len(THINK):], ""
            elif THINK.startswith(rest):  # nothing but whitespace yet, or a piece of the tag
                return "", ""
            else:
                self._state, answer, self._pending, self._blank = _ANSWER, self._blank + rest, "", ""
                return "", answer
        if self._state == _THINKING:
            end = self._pending.find(UNTHINK)
            if end < 0:
                keep = len(self._pending) - partial_tag(self._pending, UNTHINK)
                thinking, self._pending = self._pending[:keep], self._pending[keep:]
                return thinking, ""
            thinking, self._pending, self._state = self._pending[:end], self._pending[end + len(UNTHINK):], _AFTER
        answer = self._pending.lstrip(WHITESPACE)  # _AFTER: the whitespace after the block is the layout's
        self._pending = ""
        if answer:
            self._state = _ANSWER
        return thinking, answer

    def finish(self) -> tuple[str, str]:
        """What is left: an answer cut short inside its thinking is all thinking."""
        pending, self._pending = self._pending, ""
        if self._state == _THINKING:
            return pending, ""
        blank, self._blank = self._blank, ""
        return "", blank + pending


def _inside_block(text: str) -> bool:
    """Whether ``text`` ends inside a <think> block (its last opening tag is after its last closing one).

    >>> _inside_block("Q: 2+2?\\n<think>\\nLet me"), _inside_block("<think>a</think>\\nQ:"), _inside_block("Q:")
    (True, False, False)
    """
    return text.rfind(THINK) > text.rfind(UNTHINK)


def thinking_tokens(tokenizer, token_ids: list[int], reasoning: str) -> int:
    """How many of an answer's ``token_ids`` wrote its thinking (``reasoning``, its text): the
    fewest whose text reaches past the first </think>; all of them when the answer was cut short
    inside its thinking. A prefix's decoded length grows with it, so a binary search finds them."""
    if not reasoning:
        return 0
    text = tokenizer.decode(token_ids)
    end = text.find(UNTHINK)
    if end < 0:
        return len(token_ids)
    end += len(UNTHINK)
    low, high = 0, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if len(tokenizer.decode(token_ids[:middle])) >= end:
            high = middle
        else:
            low = middle + 1
    return low


@dataclass(frozen=True)
class AnswerPiece:
    """One piece of an answer read: its thinking and its content, the calls it completes, the
    calls' streamed deltas, and the finish reason as it reads with the calls (on the last piece)."""

    reasoning: str
    content: str
    calls: list[ToolCall]
    deltas: list[CallDelta]
    finish_reason: str


class AnswerReader:
    """A chat answer read as it streams: its thinking set apart (where the model thinks), then
    its calls read from the rest (where the request offers tools)."""

    def __init__(self, thinking: ReasoningReader | None, calls: CallReader | None):
        self.thinking = thinking
        self.calls = calls

    @property
    def thinks(self) -> bool:
        return self.thinking is not None

    def step(self, text: str, finish_reason: str = "") -> AnswerPiece:
        """One piece of a stream; the last one has the finish reason; a whole answer is one piece."""
        reasoning = ""
        if self.thinking is not None:
            reasoning, text = self.thinking.feed(text)
            if finish_reason:
                rest = self.thinking.finish()
                reasoning, text = reasoning + rest[0], text + rest[1]
        if self.calls is None:
            return AnswerPiece(reasoning, text, [], [], finish_reason)
        piece = self.calls.step(text, finish_reason)
        return AnswerPiece(reasoning, piece.content, piece.calls, piece.deltas, piece.finish_reason)


class AnswerFormat:
    """How the served model writes a chat answer: its tool calls' layout (gateway/call_layouts.py)
    and whether it thinks first (its template writes <think> blocks)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.call_layout = layout_of(tokenizer)
        template = (tokenizer.chat_template or "") if tokenizer is not None else ""
        self.thinks = THINK in template and UNTHINK in template
        self._opens_thinking: dict[str, bool] = {}

    def reader(self, request) -> AnswerReader | None:
        """What reads ``request``'s chat answer (None: nothing to read, the text is the answer)."""
        thinking = ReasoningReader(self._opens(request.chat_template_kwargs)) if self._thinks(request) else None
        calls = reader_for(request.tools, self.call_layout)
        return AnswerReader(thinking, calls) if thinking or calls else None

    def constrained(self, request) -> Sampling:
        """``request``'s sampling holding the answer to the calls its tools' choice requires, in the
        model's layout, and away from its bad_words as the vocabulary spells them; where the model
        thinks first, its structured output (or those calls) held after the thinking, as vLLM's reasoning parsers let it (the language says so: the verifier
        builds the grammar), unless the language spells </think>: then it is the whole answer's."""
        sampling = constrained(request.tools, request.sampling, self.call_layout)
        if request.bad_words:  # their spellings beside the token ids the client sent
            words = word_sequences(self.tokenizer.encode_text, request.bad_words)
            sampling = dataclasses.replace(sampling, bad_words=tuple(dict.fromkeys((*sampling.bad_words, *words))))
        if sampling.thinking_budget is not None:
            budget = dataclasses.replace(sampling.thinking_budget, opened=self._budget_opened(request))
            sampling = dataclasses.replace(sampling, thinking_budget=budget)
        language = sampling.structured_output
        if language is None or language.reasoning != "none" or not self._thinks(request):
            return sampling
        if any(UNTHINK in spec for spec in ([language.spec] if isinstance(language.spec, str) else language.spec)):
            return sampling  # a language that writes </think> itself holds the thinking too
        reasoning = "open" if self._opens(request.chat_template_kwargs) else "block"
        return dataclasses.replace(sampling, structured_output=dataclasses.replace(language, reasoning=reasoning))

    def _budget_opened(self, request) -> bool:
        """Whether a thinking budget counts from the output's first token: a chat prompt whose
        template opened the block, a prompt (text, token ids, or a continued message) that leaves
        one open, or a client that says so (gRPC's ThinkingBudget.reasoning); else from a <think>
        opening the output."""
        if request.sampling.thinking_budget.opened:
            return True
        if request.prompt_token_ids:
            return _inside_block(self.tokenizer.decode(list(request.prompt_token_ids)))
        if request.raw:
            return _inside_block(request.prompt)
        if request.continue_final_message:
            return _inside_block(request.messages[-1].content if request.messages else "")
        return self._thinks(request) and self._opens(request.chat_template_kwargs)

    def _thinks(self, request) -> bool:
        """Whether ``request``'s answer may open with thinking: a chat-templated prompt of a thinking
        model that opens a turn (a continued message goes on as it was, not split)."""
        return self.thinks and not (request.raw or request.prompt_token_ids or request.continue_final_message)

    def _opens(self, variables: str) -> bool:
        """Whether the template's turn opening, with these variables, leaves a <think> block open."""
        if variables not in self._opens_thinking:
            if len(self._opens_thinking) >= _REMEMBERED:
                self._opens_thinking.clear()
            try:
                opening = self.tokenizer.render_chat([{"role": "user", "content": "?"}], None,
                                                     json.loads(variables) if variables else None)
            except (TemplateError, TypeError, ValueError):  # a template that fails on it opens nothing
                opening = ""
            self._opens_thinking[variables] = opening.rstrip().endswith(THINK)
        return self._opens_thinking[variables]
