"""Log-probabilities over HTTP, in OpenAI's two shapes: chat's list of entries (a token, its
log-probability, its bytes and its likeliest alternatives) and completions' parallel arrays.

A token is shown as its text when its bytes are whole UTF-8, else as "bytes:\\xNN..." (a
byte-level piece that is part of a character), as vLLM does; `bytes` always holds the exact ones.
"""

from __future__ import annotations

from typing import Any, Sequence

from pardec.runtime.errors import InvalidArgument
from pardec.verifier.api import TokenLogprob


def requested(body: dict[str, Any]) -> tuple[bool, int]:
    """(logprobs, top_logprobs) of a request body: chat sends `logprobs` true and `top_logprobs`
    N, completions `logprobs` N (0: the chosen token's alone)."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs", 0)
    if top is None:
        top = 0
    if not isinstance(top, int) or isinstance(top, bool) or top < 0:
        raise InvalidArgument(f"top_logprobs: must be an integer >= 0, got {top!r}")
    if logprobs is None or isinstance(logprobs, bool):
        return bool(logprobs), top
    if isinstance(logprobs, int) and logprobs >= 0:
        return True, max(top, logprobs)
    raise InvalidArgument("logprobs: must be a boolean (chat) or an integer >= 0 (completions)")


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


def completion_logprobs(
    tokenizer, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob], offset: int = 0
) -> dict[str, Any]:
    """Completions' `choices[].logprobs`; `offset`: the characters of the completion before
    these tokens (a stream's earlier chunks), where `text_offset` starts counting."""
    texts = [token_text(tokenizer.token_bytes(token)) for token in token_ids]
    offsets = []
    for token in token_ids:
        offsets.append(offset)
        offset += len(tokenizer.decode([token]))
    return {
        "tokens": texts,
        "token_logprobs": [logprob.logprob for logprob in logprobs],
        "top_logprobs": [{token_text(tokenizer.token_bytes(t)): lp for t, lp in logprob.top} for logprob in logprobs],
        "text_offset": offsets,
    }
