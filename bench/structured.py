"""What parallel decoding buys under structured output: JSON extraction with a JSON Schema,
and the same record as a forced tool call.

Each prompt shows a function from Python's standard library and asks for a JSON record of it
(name, parameters, the first line of its docstring), held to a schema, or given as the
arguments of a call of `record_function` (a tool whose parameters are that schema, named in
tool_choice). A stack is started as `pardec bench` starts one (memory_decoding,
decoding_length 16); each prompt runs with plain decoding and with parallel decoding, in each
arm (schema, tool call, free text), for --rounds rounds in alternating order, so each speedup
is a ratio taken side by side. Every parallel answer must
equal its plain answer token for token (greedy); the run stops otherwise.

    python -m pardec.bench.structured --prompts 8 --rounds 2 --out bench/out/structured
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import tempfile
import time
from pathlib import Path

from pardec.bench.stack import gateway_stub, launch_mode
from pardec.bench.workloads import _stdlib_source
from pardec.v1 import gateway_pb2

MODULES = ("textwrap", "shlex", "fnmatch", "posixpath", "heapq", "bisect", "json", "base64", "calendar")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "parameters": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 8},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["name", "parameters", "summary"],
    "additionalProperties": False,
}


def prompts(count: int) -> list[str]:
    """Extraction prompts over documented stdlib functions of 5 to 40 lines, in module order."""
    found = []
    for module in MODULES:
        source, tree = _stdlib_source(module)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                code = ast.get_source_segment(source, node)
                if 5 <= code.count("\n") + 1 <= 40:
                    found.append("Describe this Python function as JSON with its name, its parameters' names and "
                                 f"the first line of its docstring as the summary.\n\n{code}\n")
    return found[:count]


ARMS = ("json_schema", "tool_call", "free")
TOOL = gateway_pb2.Tool(function=gateway_pb2.Function(
    name="record_function", description="Records a Python function's name, parameters and summary.",
    parameters=json.dumps(SCHEMA)))


def _request(prompt: str, plain: bool, arm: str, max_new: int) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(
        prompt=prompt, max_new_tokens=max_new,
        decoding=gateway_pb2.DECODING_MODE_PLAIN if plain else gateway_pb2.DECODING_MODE_DEFAULT)
    if arm == "json_schema":
        request.sampling.structured_output.json_schema = json.dumps(SCHEMA)
    elif arm == "tool_call":
        request.tools.append(TOOL)
        request.tool_choice.function = TOOL.function.name
    return request


def measure(stub, texts: list[str], rounds: int, max_new: int) -> dict:
    """Per arm: tok/s of plain and parallel decoding, the median of the rounds' speedups, mean
    accepted length and how many answers (a tool call's arguments) parse as JSON."""
    results = {}
    for arm in ARMS:
        reference = {p: stub.Generate(_request(p, True, arm, max_new), timeout=3600) for p in texts}  # warm-up
        ratios, tokens, seconds, lengths = [], {True: 0, False: 0}, {True: 0.0, False: 0.0}, []
        for round_index in range(rounds):
            spent = {}
            for plain in ((True, False) if round_index % 2 == 0 else (False, True)):
                start, made = time.perf_counter(), 0
                for prompt in texts:
                    reply = stub.Generate(_request(prompt, plain, arm, max_new), timeout=3600)
                    if list(reply.token_ids) != list(reference[prompt].token_ids):
                        raise SystemExit(f"{'plain' if plain else 'parallel'} output differs from the reference")
                    made += len(reply.token_ids)
                    if not plain:
                        lengths.append(reply.stats.mean_accepted_length)
                spent[plain] = time.perf_counter() - start
                tokens[plain] += made
                seconds[plain] += spent[plain]
            ratios.append(spent[True] / spent[False])  # the same tokens both ways
        plain_tps, parallel_tps = tokens[True] / seconds[True], tokens[False] / seconds[False]
        valid = sum(_is_json(reply.tool_calls[0].function.arguments if reply.tool_calls else reply.text)
                    for reply in reference.values())
        results[arm] = {
            "plain_tok_s": round(plain_tps, 2), "parallel_tok_s": round(parallel_tps, 2),
            "speedup": round(statistics.median(ratios), 3),
            "mean_accepted_length": round(statistics.mean(lengths), 3),
            "tokens_per_answer": round(tokens[True] / rounds / len(texts), 1),
            "valid_json": f"{valid}/{len(texts)}",
        }
    return results


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("bench/out/structured"))
    args = parser.parse_args(argv)
    texts = prompts(args.prompts)
    with tempfile.TemporaryDirectory() as workdir, launch_mode(Path(workdir), "md16") as stack, \
            gateway_stub(stack) as stub:
        results = measure(stub, texts, args.rounds, args.max_new_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"prompts": len(texts), "rounds": args.rounds, **results},
                                                      indent=2))
    lines = ["| output | plain tok/s | parallel tok/s | speedup | mean accepted length | tokens/answer | valid JSON |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {arm} | {r['plain_tok_s']} | {r['parallel_tok_s']} | {r['speedup']}x | {r['mean_accepted_length']} "
              f"| {r['tokens_per_answer']} | {r['valid_json']} |" for arm, r in results.items()]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
