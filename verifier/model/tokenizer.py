"""The model's tokenizer and chat template, without torch (the gateway imports this module).

The whole tokenizer travels as a Hugging Face `tokenizers` JSON string, so the gateway can rebuild
exactly what the verifier uses from the model info it receives over gRPC.

What a client writes is always text: a control token's spelling inside a message ("<|im_start|>",
"<|im_end|>") is tokenized as the characters it is made of, never as the control token, so a
user cannot close their turn and forge a system one. Only the chat template's own structure
becomes control tokens (`encode_messages`); a raw completion (`encode_raw`) has none at all.
"""

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from jinja2.exceptions import TemplateError
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from pardec.runtime.json_files import read_json_object
from pardec.runtime.errors import ConfigError
from pardec.verifier.chat_template import template_environment

# GGUF token types (llama.cpp's llama_token_type).
CONTROL_TOKEN = 3
USER_DEFINED_TOKEN = 4
# Stands in for each character of a control token's spelling inside message content while the
# template is rendered to find its own control tokens (a private-use character: no template
# trims it, no tokenizer has it in a control token).
_MASK = "\ue000"
# Tokens that end a turn in the chat formats we serve; stop on them whenever the vocabulary has them
# (Llama 3's end of turn, and 3.1's end of a message that awaits a tool's answer, too).
TURN_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>")
# llama.cpp's pre-tokenizers whose tokenizer.json looks a whole word up before merging (BPE's
# ignore_merges): Llama 3's.
_WHOLE_WORDS_FIRST = ("llama3", "llama-v3", "llama-bpe")



def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, reversed: the printable bytes (! to ~, ¡ to ¬,
    ® to ÿ) stand for themselves, every other byte for U+0100 onwards, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{chr(b): b for b in printable}, **{chr(0x100 + i): b for i, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_alphabet()

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp's `tokenizer.ggml.pre` names, as the original tokenizer.json spells it."""
    if pre == "smollm":
        # SmolLM / SmolLM2 (StarCoder lineage): every digit on its own, then GPT-2's byte-level split.
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in ("gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _WHOLE_WORDS_FIRST:
        return _split_then_bytes(_LLAMA3_SPLIT)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return _split_then_bytes(_QWEN2_SPLIT)
    raise ConfigError(f"unsupported GGUF pre-tokenizer {pre!r}")


# Appended to a continued message's content while rendering, to find where it ends: private-use
# characters, which no template writes of its own.
_CONTENT_END = "\ue000pardec-content-end\ue001"


@dataclass(frozen=True)
class ChatTokenizer:
    tokenizer_json: str
    chat_template: str
    bos_token: str
    eos_token: str
    stop_token_ids: tuple[int, ...]
    _tokenizer: Tokenizer = field(init=False, repr=False, compare=False)
    _control_ids: frozenset[int] = field(init=False, repr=False, compare=False)
    _control_pattern: object = field(init=False, repr=False, compare=False)
    _template: object = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))
        object.__setattr__(self, "_tokenizer", Tokenizer.from_str(self.tokenizer_json))
        control = {i: t.content for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special}
        object.__setattr__(self, "_control_ids", frozenset(control))
        spellings = sorted(control.values(), key=len, reverse=True)
        pattern = re.compile("|".join(map(re.escape, spellings))) if spellings else None
        object.__setattr__(self, "_control_pattern", pattern)
        object.__setattr__(self, "_template", template_environment().from_string(self.chat_template))

    @cached_property
    def _text_tokenizer(self) -> Tokenizer:
        """The same tokenizer with control-token matching off: control tokens' spellings are text.
        A second instance (no shared flag flipped per call), built when first needed: the
        gateway needs it, the verifier never does."""
        tokenizer = Tokenizer.from_str(self.tokenizer_json)
        tokenizer.encode_special_tokens = True
        return tokenizer

    @classmethod
    def from_parts(cls, tokenizer_json, chat_template, bos_token, eos_token, stop_token_ids) -> "ChatTokenizer":
        return cls(tokenizer_json, chat_template, bos_token, eos_token, tuple(stop_token_ids))

    @classmethod
    def from_gguf_fields(
        cls,
        tokenizer_model: str,
        pre_tokenizer: str,
        tokens: list[str],
        token_types: list[int],
        merges: list[str],
        bos_token_id: int | None,
        eos_token_id: int,
        chat_template: str,
        end_token_ids: Sequence[int] = (),
    ) -> "ChatTokenizer":
        """A byte-level BPE tokenizer from a GGUF file's `tokenizer.*` metadata; ``end_token_ids``
        (its eot and eom tokens, where it names them) end a generation as its eos does."""
        if tokenizer_model != "gpt2":
            raise ConfigError(f"unsupported GGUF tokenizer model {tokenizer_model!r}; only byte-level BPE ('gpt2')")
        vocab = {token: index for index, token in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(merge.split(" ", 1)) for merge in merges],
                         ignore_merges=pre_tokenizer in _WHOLE_WORDS_FIRST)
        tokenizer = Tokenizer(bpe)
        tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(pre_tokenizer)
        tokenizer.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|>, ...) must match whole in text and be skipped when decoding;
        # user-defined ones match whole but are ordinary text.
        kinds = list(zip(tokens, token_types))
        control = [AddedToken(t, special=True, normalized=False) for t, k in kinds if k == CONTROL_TOKEN]
        user_defined = [AddedToken(t, special=False, normalized=False) for t, k in kinds if k == USER_DEFINED_TOKEN]
        tokenizer.add_special_tokens(control)
        tokenizer.add_tokens(user_defined)
        stop_ids = tuple(dict.fromkeys([eos_token_id, *end_token_ids] + [vocab[t] for t in TURN_END_TOKENS if t in vocab]))
        bos_token = "" if bos_token_id is None else tokens[bos_token_id]
        return cls(tokenizer.to_str(), chat_template, bos_token, tokens[eos_token_id], stop_ids)

    @classmethod
    def from_hf_dir(cls, path: str) -> "ChatTokenizer":
        """From a Hugging Face checkpoint directory: tokenizer.json, tokenizer_config.json and friends."""
        with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
            tokenizer_json = f.read()
        config = read_json_object(os.path.join(path, "tokenizer_config.json"), missing_ok=True)
        template = config.get("chat_template")
        template_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(template_file):
            with open(template_file, encoding="utf-8") as f:
                template = f.read()
        if isinstance(template, list):  # named templates; the chat one is "default"
            template = {entry["name"]: entry["template"] for entry in template}.get("default")
        if template is None:
            raise ConfigError(f"{path} has no chat template")

        def token_text(key):
            value = config.get(key)
            return value.get("content", "") if isinstance(value, dict) else (value or "")

        bos_token, eos_token = token_text("bos_token"), token_text("eos_token")
        tokenizer = Tokenizer.from_str(tokenizer_json)
        generation_eos = read_json_object(os.path.join(path, "generation_config.json"), missing_ok=True).get("eos_token_id", [])
        stop_ids = [tokenizer.token_to_id(t) for t in (eos_token, *TURN_END_TOKENS) if t]
        stop_ids += generation_eos if isinstance(generation_eos, list) else [generation_eos]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in stop_ids if i is not None):
            raise ConfigError(f"{path}/generation_config.json: eos_token_id must be a token id or a list of them, "
                              f"got {generation_eos!r}")
        stop_ids = tuple(dict.fromkeys(i for i in stop_ids if i is not None))
        if not stop_ids:
            raise ConfigError(f"{path} names no end-of-sequence token")
        return cls(tokenizer_json, template, bos_token, eos_token, stop_ids)

    def encode(self, text: str) -> list[int]:
        """Trusted text to ids: no BOS, special tokens written in the text become their ids. Never
        for what a client sent: that is `encode_text`, `encode_raw` or `encode_messages`."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Untrusted text to ids: no BOS, and a control token's spelling stays text."""
        return self._text_tokenizer.encode(text, add_special_tokens=False).ids

    @property
    def wants_bos(self) -> bool:
        """Whether a sequence starts with BOS: the chat template writes `bos_token` (Llama 3); a
        ChatML template opens with <|im_start|> of its own, which GGUF files call BOS but is not."""
        return bool(self.bos_token) and "bos_token" in self.chat_template

    def encode_raw(self, text: str) -> list[int]:
        """A raw completion's prompt, no chat template: BOS where the model wants one, then the
        text as text."""
        bos = self._tokenizer.token_to_id(self.bos_token) if self.wants_bos else None
        return ([bos] if bos is not None else []) + self.encode_text(text)

    def decode(self, ids, skip_special: bool = True) -> str:
        """The text of ``ids``; control tokens (the tokenizer's special ones) left out unless
        ``skip_special`` is false."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows, control tokens included."""
        return self._tokenizer.get_vocab_size()

    @property
    def control_ids(self) -> frozenset[int]:
        return self._control_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, which may be part of a character (a byte-level BPE
        piece, a `<0xNN>` byte token, a SentencePiece piece whose "▁" is a space); a control
        token's spelling. For log-probabilities and structured output's grammars."""
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None or token_id in self._control_ids:
            return (piece or "").encode()
        if self._byte_level:
            if all(char in _BYTE_OF_CHAR for char in piece):
                return bytes(_BYTE_OF_CHAR[char] for char in piece)
            return self.decode([token_id]).encode()
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode()

    @cached_property
    def _byte_level(self) -> bool:
        """Whether the tokenizer's pieces are spelled in the byte-level alphabet (GPT-2, Llama 3, Qwen)."""
        decoder = json.loads(self.tokenizer_json).get("decoder") or {}
        parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
        return any(part.get("type") == "ByteLevel" for part in parts)

    @property
    def takes_tools(self) -> bool:
        """Whether the chat template renders tools itself (transformers passes them as ``tools``)."""
        return "tools" in self.chat_template

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, variables: dict | None = None,
                    continue_final: bool = False) -> str:
        """The conversation as the template writes it, the assistant's turn opened; ``variables``
        are the template's own switches (vLLM's chat_template_kwargs: Qwen3's enable_thinking).
        ``continue_final`` (vLLM's continue_final_message): no turn is opened, and the text ends
        where the last message's content does (its turn left open, for the model to go on)."""
        if continue_final:  # the content's end marked, so the cut is there, whatever the text after it
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTENT_END}]
        rendered = self._template.render(
            **(variables or {}),
            messages=messages,
            tools=tools,
            add_generation_prompt=not continue_final,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        if not continue_final:
            return rendered
        end = rendered.rfind(_CONTENT_END)
        if end < 0:
            raise TemplateError("the template does not write the final message's content")
        return rendered[:end]

    def encode_chat(self, user_message: str) -> list[int]:
        """One user message with the chat template (`encode_messages`)."""
        return self.encode_messages([{"role": "user", "content": user_message}])

    def encode_messages(self, messages: list[dict], tools: list[dict] | None = None,
                        variables: dict | None = None, continue_final: bool = False) -> list[int]:
        """A conversation ({"role", "content"} dicts, and tool calls where the template takes
        them) rendered with the chat template, with ``tools`` (function definitions) and template
        ``variables`` where given, and tokenized: the template's control tokens are control tokens, every string the client
        wrote is text. Content without a control token's spelling gives exactly transformers'
        apply_chat_template(..., tokenize=True) ids.

        No BOS is added: like transformers' apply_chat_template, the template writes every special
        token it wants (ChatML starts with <|im_start|> itself; Llama 3 writes {{ bos_token }}).
        A template error (raise_exception) raises jinja2's TemplateError."""
        rendered = self.render_chat(messages, tools, variables, continue_final)
        if self._control_pattern is None or not any(map(self._spells_control, (messages, tools, variables))):
            return self.encode(rendered)
        # Render again with every control spelling the client wrote masked, character for
        # character: the control tokens left are the template's own, at the same places in
        # `rendered`. The text between them is encoded as text, so the client's spellings stay characters.
        masked = self.render_chat(self._masked(messages), self._masked(tools), self._masked(variables), continue_final)
        if len(masked) != len(rendered):
            raise TemplateError("the chat template changes message content that spells a control token")
        ids, start = [], 0
        encoding = self._tokenizer.encode(masked, add_special_tokens=False)
        for token_id, (begin, end) in zip(encoding.ids, encoding.offsets):
            if token_id in self._control_ids:
                ids += self.encode_text(rendered[start:begin])
                ids.append(token_id)
                start = end
        return ids + self.encode_text(rendered[start:])

    def _spells_control(self, value) -> bool:
        if isinstance(value, str):
            return bool(self._control_pattern.search(value))
        if isinstance(value, dict):
            return any(map(self._spells_control, (*value.keys(), *value.values())))
        return isinstance(value, (list, tuple)) and any(map(self._spells_control, value))

    def _masked(self, value):
        """``value`` with each control token's spelling in its strings (keys too) masked."""
        if isinstance(value, str):
            return self._control_pattern.sub(lambda m: _MASK * len(m.group()), value)
        if isinstance(value, dict):
            return {self._masked(key): self._masked(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._masked(item) for item in value]
        return value


