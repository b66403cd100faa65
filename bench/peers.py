"""Peers measured on the same model, prompts and machine: Hugging Face transformers' `generate`,
plain and with prompt lookup decoding (`prompt_lookup_num_tokens`), fp32 on CPU; and llama.cpp's
prompt lookup through `llama-cpp-python` when that optional package is installed.

    python -m pardec.bench.peers --workloads code_edit,humaneval --prompts 4 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

from pardec.bench import workloads as workload_data
from pardec.verifier.model.weights import default_model_path, load_checkpoint


def load_transformers_model(gguf_path: str | None = None):
    """transformers' own conversion of a GGUF (config, tensor names, q/k un-permutation).

    AutoModelForCausalLM.from_pretrained(gguf_file=...) insists on `accelerate`, which pardec
    does not depend on; these are the steps it takes, minus that requirement.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = gguf_path or default_model_path()
    directory, name = os.path.split(path)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory, gguf_file=name), dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model.eval()


class _ForwardCounter:
    """Counts the model's forward passes during generate (prefill included)."""

    def __init__(self, model):
        self.calls = 0
        self._forward = model.forward

        def counted(*args, **kwargs):
            self.calls += 1
            return self._forward(*args, **kwargs)

        model.forward = counted


def measure_transformers(
    model, prompt_ids: list[list[int]], max_new_tokens: int, lookup: int | None, device: str = "cpu"
) -> dict:
    """Greedy generation of every prompt, one at a time; ``model`` from load_transformers_model,
    on ``device``."""
    counter = _ForwardCounter(model)
    tokens = forwards = 0
    seconds = 0.0
    for ids in prompt_ids:
        kwargs = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        inputs = torch.tensor([ids], device=device)
        counter.calls = 0
        start = time.perf_counter()
        with torch.inference_mode():
            output = model.generate(
                inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=0, eos_token_id=[2], **kwargs,
            )
            output = output.cpu()  # waits for the device
        seconds += time.perf_counter() - start
        generated = output.shape[1] - len(ids)
        tokens += generated
        forwards += max(counter.calls - 1, 1)  # the first forward is the prefill
    return {
        "peer": f"transformers {'prompt lookup k=' + str(lookup) if lookup else 'plain'}",
        "tokens_per_s": round(tokens / seconds, 2),
        # tokens after the prefill's, per decoding forward: the peer's "mean accepted length"
        "tokens_per_step": round((tokens - len(prompt_ids)) / forwards, 3),
    }


def measure_llama_cpp(prompt_ids: list[list[int]], max_new_tokens: int) -> dict | None:
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return None
    results = {}
    for label, draft in (("plain", None), ("prompt lookup", LlamaPromptLookupDecoding(num_pred_tokens=10))):
        # n_batch = n_ctx: with a draft model llama-cpp-python keeps one row of logits per
        # token of the batch buffer, and a draft that carries the context past n_batch (512 by
        # default) overflows it ("could not broadcast input array" on 500-token contexts).
        llm = Llama(default_model_path(), n_ctx=4096, n_batch=4096, verbose=False, draft_model=draft)
        tokens, seconds = 0, 0.0
        for ids in prompt_ids:
            start = time.perf_counter()
            out = []
            for token in itertools.islice(llm.generate(ids, temp=0.0), max_new_tokens):
                out.append(token)
                if token == llm.token_eos() or token == 2:  # 2: <|im_end|>, the end of a turn
                    break
            seconds += time.perf_counter() - start
            tokens += len(out)
            llm.reset()
        results[label] = round(tokens / seconds, 2)
    return {"peer": "llama.cpp (llama-cpp-python)", "plain_tokens_per_s": results["plain"],
            "prompt_lookup_tokens_per_s": results["prompt lookup"]}


def prompt_lookup_steps(prompt_ids: list[int], output_ids: list[int], num_tokens: int = 10, max_ngram: int = 2) -> int:
    """Decoding forwards that prompt lookup would take to produce ``output_ids`` (greedy, so
    the text is fixed) after ``prompt_ids``, drafting as transformers' prompt lookup does: the
    last max_ngram tokens, else fewer, matched at their earliest earlier occurrence in prompt and
    output so far, proposing up to num_tokens that followed it. The first output token comes from
    the prefill. Replayed on pardec's own output, it compares drafters on the same text (the
    fp32 peer writes a different one).

    Prompt [5, 6, 7, 8], output [9, 5, 6, 7, 1] (9 from the prefill): after 9 nothing matches,
    the forward makes 5; after [.., 9, 5] the 1-gram 5 matches, proposing [6, 7, 8], and the
    forward accepts 6, 7 and makes 1 itself:

    >>> prompt_lookup_steps([5, 6, 7, 8], [9, 5, 6, 7, 1], num_tokens=3)
    2
    """
    text, made, forwards = list(prompt_ids) + list(output_ids[:1]), 1, 0
    while made < len(output_ids):
        proposal: list[int] = []
        for size in range(min(max_ngram, len(text) - 1), 0, -1):
            tail = text[-size:]
            start = next((i for i in range(len(text) - size) if text[i : i + size] == tail), None)
            if start is not None:
                proposal = text[start + size : start + size + num_tokens]
                break
        right = 0
        while right < len(proposal) and made + right < len(output_ids) and proposal[right] == output_ids[made + right]:
            right += 1
        taken = min(right + 1, len(output_ids) - made)
        text += output_ids[made : made + taken]
        made, forwards = made + taken, forwards + 1
    return forwards


def measure_peers(prompt_ids_by_workload: dict[str, list[list[int]]], max_new_tokens: int) -> list[dict]:
    """Every installed peer on every workload: rows of workload, peer, tokens_per_s and
    tokens_per_step (None where the peer does not report forwards)."""
    rows = []
    try:
        model = load_transformers_model()
    except ImportError:
        model = None
    for workload, ids in prompt_ids_by_workload.items():
        if model is not None:
            for lookup in (None, 10):
                name = f"transformers {'prompt lookup k=' + str(lookup) if lookup else 'plain'}"
                rows.append(_guarded(workload, name,
                                     lambda ids=ids, lookup=lookup: measure_transformers(model, ids, max_new_tokens, lookup)))
        llama = _guarded(workload, "llama.cpp", lambda ids=ids: measure_llama_cpp(ids, max_new_tokens))
        if llama is not None and "error" in llama:
            rows.append(llama)
        elif llama is not None:
            rows.append({"workload": workload, "peer": "llama.cpp plain",
                         "tokens_per_s": llama["plain_tokens_per_s"], "tokens_per_step": None})
            rows.append({"workload": workload, "peer": "llama.cpp prompt lookup k=10",
                         "tokens_per_s": llama["prompt_lookup_tokens_per_s"], "tokens_per_step": None})
    return rows


def _guarded(workload: str, peer: str, measure) -> dict | None:
    """A peer's measurement, or a row that says why it failed: a peer's own bug must not cost
    the run pardec's figures (llama-cpp-python once crashed after half an hour of them)."""
    try:
        result = measure()
    except Exception as error:  # noqa: BLE001 - any failure of a third-party engine
        print(f"peer {peer} failed on {workload}: {error!r}", file=sys.stderr)
        return {"workload": workload, "peer": peer, "tokens_per_s": None, "tokens_per_step": None,
                "error": f"{type(error).__name__}: {error}"}
    return None if result is None else {"workload": workload, **result}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="code_edit,humaneval,mtbench")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    tokenizer = load_checkpoint(None).tokenizer
    print("| workload | peer | tok/s | tokens/step |\n|---|---|---:|---:|")
    for workload in args.workloads.split(","):
        ids = [tokenizer.encode_chat(p) for p in workload_data.load(workload, args.prompts)]
        for row in measure_peers({workload: ids}, args.max_new_tokens):
            print(f"| {workload} | {row['peer']} | {row['tokens_per_s']} | {row['tokens_per_step'] or ''} |", flush=True)


if __name__ == "__main__":
    main()
