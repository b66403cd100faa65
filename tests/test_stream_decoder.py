"""The stream decoder's text is the whole answer's decode after every step, though it decodes
only the tokens since its last stable point: on the bundled byte-level tokenizer, on a
SentencePiece-style decoder (leading-space strip, byte fallback) and on one that rewrites across
token boundaries (WordPiece's cleanup), over random step sizes."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models

from pardec.gateway.decoding import StreamDecoder
from pardec.verifier.model.weights import load_checkpoint


class _Raw:
    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer

    def decode(self, ids) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)


def _sentencepiece_like() -> tuple[_Raw, list[int]]:
    pieces = ["<unk>", "▁Hello", "▁world", ",", "▁", "!", "▁a", "b", "▁the", "re"]
    pieces += [f"<0x{byte:02X}>" for byte in range(256)]
    tokenizer = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                                     byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    emoji = [10 + b for b in "🙂".encode()]  # a four-byte character, one byte fallback token each
    return _Raw(tokenizer), list(range(1, 10)) * 3 + emoji * 3


def _wordpiece_with_cleanup() -> tuple[_Raw, list[int]]:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, ".": 3, ",": 4, "##s": 5, "do": 6, "n't": 7, "'s": 8, "?": 9}
    tokenizer = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return _Raw(tokenizer), list(range(1, 10)) * 4


def _bundled() -> tuple:
    tokenizer = load_checkpoint(None).tokenizer
    text = "Say 🙂 to 你好世界, then:\n    def f(x):\n        return x * 2  # ünïcödé\n" * 6
    return tokenizer, tokenizer.encode(text)


@pytest.mark.parametrize("make", [_bundled, _sentencepiece_like, _wordpiece_with_cleanup])
def test_the_text_is_the_whole_decode_after_every_step(make):
    tokenizer, vocabulary = make()
    rng = random.Random(7)
    for trial in range(30):
        # The bundled tokenizer's real text in random steps; the small ones' tokens in random order.
        ids = vocabulary if make is _bundled else [rng.choice(vocabulary) for _ in range(120)]
        decoder = StreamDecoder(tokenizer, frozenset(), (), max_new=len(ids))
        streamed, at = "", 0
        while not decoder.finish_reason:
            step = rng.randint(1, 5)
            piece = decoder.add(ids[at : at + step])
            at += step
            streamed += piece.text
            assert decoder.text == tokenizer.decode(decoder.tokens), (trial, at)
        assert streamed == tokenizer.decode(ids)


class _Words:
    """Token i is the word WORDS[i] and a space; 0 is the model's end of sequence (no text)."""

    WORDS = ["", "the", "cat", "sat", "on", "mat", "END", "."]

    def decode(self, ids) -> str:
        return "".join(self.WORDS[i] + " " for i in ids if i)


def _run(decoder: StreamDecoder, steps: list[list[int]]) -> tuple[str, list[int]]:
    """What a client receives, streamed step by step."""
    text, tokens = "", []
    for step in steps:
        piece = decoder.add(step)
        text, tokens = text + piece.text, tokens + piece.token_ids
        if piece.done:
            break
    return text, tokens


def test_the_models_end_of_sequence_ends_it_unless_ignored():
    steps = [[1, 2], [3, 0, 4], [5, 0], [1, 2, 3]]
    decoder = StreamDecoder(_Words(), frozenset({0}), (), max_new=10)
    assert _run(decoder, steps) == ("the cat sat ", [1, 2, 3, 0]) and decoder.finish_reason == "eos"
    decoder = StreamDecoder(_Words(), frozenset(), (), max_new=8)  # ignore_eos: until max_new
    assert _run(decoder, steps) == ("the cat sat on mat the ", [1, 2, 3, 0, 4, 5, 0, 1])
    assert decoder.finish_reason == "length"


def test_a_stop_token_ends_it_with_its_text_only_if_asked():
    steps = [[1, 2], [3, 6, 4]]
    for include, text in ((False, "the cat sat "), (True, "the cat sat END ")):
        decoder = StreamDecoder(_Words(), frozenset({0}), (), 10, stop_token_ids=frozenset({6}), include_stop=include)
        assert _run(decoder, steps) == (text, [1, 2, 3, 6]) and decoder.finish_reason == "stop"


def test_a_stop_string_is_cut_before_or_kept_at_the_end():
    steps = [[1], [2, 3], [4, 5], [7]]
    for include, text in ((False, "the cat "), (True, "the cat sat")):
        # The first step whose text holds a stop string ends it; "sa" and "sat" start at the
        # same place there, and the longer one is the stop string kept.
        decoder = StreamDecoder(_Words(), frozenset({0}), ("on", "sa", "sat"), 10, include_stop=include)
        assert _run(decoder, steps) == (text, [1, 2, 3]) and decoder.finish_reason == "stop"


def test_a_stop_string_with_a_replacement_character_matches_however_the_steps_split():
    """Mid-character the text ends in U+FFFD until the next token completes it: a stop string
    holding U+FFFD must not match that passing text, or one token a step (plain decoding) and a
    step of many (parallel decoding) would answer differently."""
    tokenizer = load_checkpoint(None).tokenizer
    ids = tokenizer.encode_text("to 你好世界 ok")
    assert any(tokenizer.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))  # a split character

    def run(steps: list[int]) -> tuple[str, list[int], str]:
        decoder = StreamDecoder(tokenizer, frozenset(), ("你\ufffd",), max_new=len(ids))
        text, tokens, at = "", [], 0
        for size in steps:
            piece = decoder.add(ids[at:at + size])
            at, text, tokens = at + size, text + piece.text, tokens + piece.token_ids
            if piece.done:
                break
        return text, tokens, decoder.finish_reason

    assert run([1] * len(ids)) == run([len(ids)]) == ("to 你好世界 ok", ids, "length")
