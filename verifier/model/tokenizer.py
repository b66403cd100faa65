"""The model's tokenizer and chat template, without torch (the gateway imports this module).

The whole tokenizer travels as a Hugging Face `tokenizers` JSON string, so the gateway can rebuild
exactly what the verifier uses from the model info it receives over gRPC.
"""

import json
import os
from dataclasses import dataclass, field

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# GGUF token types (llama.cpp's llama_token_type).
CONTROL_TOKEN = 3
USER_DEFINED_TOKEN = 4
# Tokens that end a turn in the chat formats we serve; stop on them whenever the vocabulary has them.
TURN_END_TOKENS = ("<|im_end|>", "<|endoftext|>")

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
    if pre in ("llama3", "llama-v3", "llama-bpe"):
        return _split_then_bytes(_LLAMA3_SPLIT)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return _split_then_bytes(_QWEN2_SPLIT)
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(value, indent=None):
    # Not jinja's built-in, which HTML-escapes; chat templates expect plain JSON, as transformers renders it.
    return json.dumps(value, ensure_ascii=False, indent=indent)


@dataclass(frozen=True)
class ChatTokenizer:
    tokenizer_json: str
    chat_template: str
    bos_token: str
    eos_token: str
    stop_token_ids: tuple[int, ...]
    _tokenizer: Tokenizer = field(init=False, repr=False, compare=False)
    _template: object = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        # The environment transformers renders chat templates in, sandboxed: templates are model data.
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))
        object.__setattr__(self, "_tokenizer", Tokenizer.from_str(self.tokenizer_json))
        object.__setattr__(self, "_template", environment.from_string(self.chat_template))

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
    ) -> "ChatTokenizer":
        """A byte-level BPE tokenizer from a GGUF file's `tokenizer.*` metadata."""
        if tokenizer_model != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {tokenizer_model!r}; only byte-level BPE ('gpt2')")
        vocab = {token: index for index, token in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(merge.split(" ", 1)) for merge in merges])
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
        stop_ids = tuple(dict.fromkeys([eos_token_id] + [vocab[t] for t in TURN_END_TOKENS if t in vocab]))
        bos_token = "" if bos_token_id is None else tokens[bos_token_id]
        return cls(tokenizer.to_str(), chat_template, bos_token, tokens[eos_token_id], stop_ids)

    @classmethod
    def from_hf_dir(cls, path: str) -> "ChatTokenizer":
        """From a Hugging Face checkpoint directory: tokenizer.json, tokenizer_config.json and friends."""
        with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
            tokenizer_json = f.read()
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        template = config.get("chat_template")
        template_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(template_file):
            with open(template_file, encoding="utf-8") as f:
                template = f.read()
        if isinstance(template, list):  # named templates; the chat one is "default"
            template = {entry["name"]: entry["template"] for entry in template}.get("default")
        if template is None:
            raise ValueError(f"{path} has no chat template")

        def token_text(key):
            value = config.get(key)
            return value.get("content", "") if isinstance(value, dict) else (value or "")

        bos_token, eos_token = token_text("bos_token"), token_text("eos_token")
        tokenizer = Tokenizer.from_str(tokenizer_json)
        generation_eos = _read_json(os.path.join(path, "generation_config.json")).get("eos_token_id", [])
        stop_ids = [tokenizer.token_to_id(t) for t in (eos_token, *TURN_END_TOKENS) if t]
        stop_ids += generation_eos if isinstance(generation_eos, list) else [generation_eos]
        stop_ids = tuple(dict.fromkeys(i for i in stop_ids if i is not None))
        if not stop_ids:
            raise ValueError(f"{path} names no end-of-sequence token")
        return cls(tokenizer_json, template, bos_token, eos_token, stop_ids)

    def encode(self, text: str) -> list[int]:
        """Plain text to ids: no BOS, special tokens written in the text become their ids."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict]) -> str:
        return self._template.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def encode_chat(self, user_message: str) -> list[int]:
        # No BOS is added: like transformers' apply_chat_template, the template writes every special
        # token it wants (ChatML starts with <|im_start|> itself; Llama 3 writes {{ bos_token }}).
        return self.encode(self.render_chat([{"role": "user", "content": user_message}]))


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
