"""The GGUF-built tokenizer and chat template against transformers' tokenizer for the same file.

transformers builds this GGUF's tokenizer as plain GPT-2 byte-level BPE and drops the step SmolLM2's
own tokenizer.json runs first, Digits(individual_digits=True) (llama.cpp's "smollm" pre-tokenizer
does the same: `\\p{N}` before the GPT-2 regex). The vocabulary has no multi-digit tokens, so that
only shows where whitespace runs up to a digit: "a   1" is a, ĠĠĠ, 1 for SmolLM2 and a, ĠĠ, Ġ, 1
for transformers. We follow SmolLM2, and compare with transformers after giving it SmolLM2's
pre-tokenizer back.
"""

import json
import os
import subprocess
import sys

import jinja2
import pytest
from tokenizers import Tokenizer, pre_tokenizers

from pardec.verifier.model.tokenizer import ChatTokenizer
from pardec.verifier.model.weights import default_model_path, load_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "def add(a, b):\n    return a + b  # sum\n\n\nclass Foo:\n\tpass\n",
    'for (int i = 0; i < n; ++i) { s += x[i] * 2.5e-3; }  // C++ "quoted"',
    "Hello 👋🏽 world 🇫🇷! Emoji: 🤖🧠✨",
    "中文分词测试，日本語のテキスト。한국어 문장입니다.",
    "Numbers: 3.14159, 1e10, 12345678901234567890, 2024-01-01T12:00:00Z",
    "   leading, trailing and    inner   whitespace   ",
    "tabs\tand\r\nwindows\nnew\n\nlines\n",
    "ÀÉÎÕÜ ñ ß ø — “curly” ‘quotes’ … ¿qué? ¡sí! 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "don't won't I'm we've they'll she'd IT'S",
]
SPECIALS_TEXT = "<|im_start|>user\nspecial tokens inside text<|im_end|>\n<|endoftext|><file_sep>x"
# Whitespace before digits: where transformers' conversion differs from SmolLM2.
WHITESPACE_DIGITS_TEXT = "x  42, a   1, \n\n 7, ²³ ١٢٣"

MESSAGES = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.\n\n```python\ndef reverse(s):\n```",
    "Hello 👋 ¿qué tal? 中文 <|im_end|> sneaky",
]


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return load_checkpoint(None).tokenizer


@pytest.fixture(scope="module")
def transformers_tokenizer():
    from transformers import AutoTokenizer

    directory, name = os.path.split(default_model_path())
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.fixture(scope="module")
def smollm2_tokenizer(transformers_tokenizer) -> Tokenizer:
    """transformers' tokenizer with SmolLM2's original pre-tokenizer (see the module docstring)."""
    fixed = Tokenizer.from_str(transformers_tokenizer.backend_tokenizer.to_str())
    digits = pre_tokenizers.Digits(individual_digits=True)
    fixed.pre_tokenizer = pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return fixed


def test_encoding_matches_smollm2(tokenizer, smollm2_tokenizer):
    for text in TEXTS + [SPECIALS_TEXT, WHITESPACE_DIGITS_TEXT]:
        assert tokenizer.encode(text) == smollm2_tokenizer.encode(text, add_special_tokens=False).ids, text


def test_encoding_matches_transformers_where_digits_do_not_follow_whitespace(tokenizer, transformers_tokenizer):
    for text in TEXTS + [SPECIALS_TEXT]:
        assert tokenizer.encode(text) == transformers_tokenizer.encode(text, add_special_tokens=False), text


def test_whitespace_before_digits_follows_smollm2(tokenizer):
    pieces = [tokenizer.decode([token]) for token in tokenizer.encode("a   1 x  42")]
    assert pieces == ["a", "   ", "1", " x", "  ", "4", "2"]


def test_special_tokens_and_decoding(tokenizer):
    assert tokenizer.encode("<|im_start|>user<|im_end|><|endoftext|>")[::2] == [1, 2]
    assert tokenizer.encode("<|endoftext|>") == [0]
    for text in TEXTS + [WHITESPACE_DIGITS_TEXT]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode(tokenizer.encode("<|im_start|>assistant\nHi there<|im_end|>")) == "assistant\nHi there"


def test_model_info(tokenizer, transformers_tokenizer):
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (transformers_tokenizer.bos_token, transformers_tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.stop_token_ids == (2, 0)  # <|im_end|> ends the assistant turn; <|endoftext|> ends a document


def test_chat_template_matches_transformers(tokenizer, transformers_tokenizer):
    for message in MESSAGES:
        conversation = [{"role": "user", "content": message}]
        expected_text = transformers_tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False)
        expected_ids = transformers_tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert tokenizer.render_chat(conversation) == expected_text
        if "<|" not in message:
            assert tokenizer.encode_chat(message) == expected_ids
        # transformers tokenizes the rendered text, so a control token's spelling in the message
        # becomes the control token there; pardec keeps the message's text as text.
        start = expected_text.index(message)
        expected_ids = [
            *transformers_tokenizer.encode(expected_text[:start], add_special_tokens=False),
            *transformers_tokenizer.encode(message, add_special_tokens=False, split_special_tokens=True),
            *transformers_tokenizer.encode(expected_text[start + len(message):], add_special_tokens=False),
        ]
        assert tokenizer.encode_chat(message) == expected_ids
        # ChatML opens with <|im_start|> itself: no BOS in front, so no doubled <|im_start|>.
        assert tokenizer.encode_chat(message)[:2] == [1, tokenizer.encode("system")[0]]
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.render_chat(with_system) == transformers_tokenizer.apply_chat_template(
        with_system, add_generation_prompt=True, tokenize=False)


def test_from_parts_round_trip(tokenizer):
    rebuilt = ChatTokenizer.from_parts(tokenizer.tokenizer_json, tokenizer.chat_template, tokenizer.bos_token,
                                       tokenizer.eos_token, list(tokenizer.stop_token_ids))
    assert rebuilt == tokenizer
    assert all(rebuilt.encode(text) == tokenizer.encode(text) for text in TEXTS)
    assert rebuilt.encode_chat(MESSAGES[0]) == tokenizer.encode_chat(MESSAGES[0])


def test_from_hf_dir(tmp_path, tokenizer):
    (tmp_path / "tokenizer.json").write_text(tokenizer.tokenizer_json)
    config = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "chat_template": tokenizer.chat_template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    loaded = ChatTokenizer.from_hf_dir(str(tmp_path))
    assert loaded.stop_token_ids == (2, 0, 5)
    assert loaded.encode_chat(MESSAGES[1]) == tokenizer.encode_chat(MESSAGES[1])


def test_template_errors_and_sandbox(tokenizer):
    raising = ChatTokenizer.from_parts(tokenizer.tokenizer_json, "{{ raise_exception('no system role') }}", "", "", [2])
    with pytest.raises(Exception, match="no system role"):
        raising.render_chat([])
    unsafe = ChatTokenizer.from_parts(tokenizer.tokenizer_json, "{{ messages.__class__.__mro__ }}", "", "", [2])
    with pytest.raises(jinja2.exceptions.SecurityError):
        unsafe.render_chat([])


def test_tokenizer_module_does_not_import_torch():
    code = "import sys, pardec.verifier.model.tokenizer; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_gguf_llama3_tokenizer_looks_a_whole_word_up_before_merging_and_stops_at_its_turn_ends():
    """Llama 3's pre-tokenizers (llama.cpp's llama-bpe) take a word the vocabulary holds whole,
    as its tokenizer.json's ignore_merges does, even where no merges build it; its eot and eom
    tokens (named in the file, or spelled as Llama 3 spells them) end a generation."""
    tokens = ["a", "b", "c", "ab", "bc", "abc", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|x|>"]
    merges = ["a b", "b c"]  # build "ab" and "bc", never "abc"
    kinds = [1] * 6 + [3] * 4

    def built(pre: str, **fields) -> ChatTokenizer:
        return ChatTokenizer.from_gguf_fields("gpt2", pre, tokens, kinds, merges, None, 6, "{{ messages }}", **fields)

    assert built("llama-bpe").encode("abc") == [5]
    assert built("gpt2").encode("abc") == [3, 2]  # GPT-2's byte-level BPE merges only
    assert built("llama-bpe").stop_token_ids == (6, 7, 8)
    assert built("llama-bpe", end_token_ids=[9]).stop_token_ids == (6, 9, 7, 8)


@pytest.mark.parametrize("template", [
    # Llama 3.1-3.3's date preamble: today's date where the environment has strftime_now
    '{%- if strftime_now is defined %}{{ "Today Date: " + strftime_now("%d %b %Y") }}{%- else %}26 Jul 2024'
    '{%- endif %}',
    "{{ messages[0] | tojson(ensure_ascii=False, separators=(',', ':'), sort_keys=True) }}",
    "{{ messages | tojson(indent=2) }}",
    "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
])
def test_template_constructs_render_as_transformers_renders_them(transformers_tokenizer, template):
    from pardec.verifier.chat_template import template_environment

    messages = [{"role": "user", "content": "héllo"}]
    expected = transformers_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert template_environment().from_string(template).render(messages=messages) == expected
