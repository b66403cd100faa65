"""The benchmark's pure parts: workloads from real installed text, the report table; and the
sizing replay over the real stack."""

import doctest
import json

import pytest

import pardec.bench.peers
from pardec.bench import sizing_replay
from pardec.bench.peers import prompt_lookup_steps
from pardec.bench.report import CONTROL, markdown, peers_markdown
from pardec.bench.workloads import _complete_json_array_items, held_out, load
from pardec.gateway.tree_sizing import CostCurve


def test_workloads_are_real_deterministic_and_bounded():
    for name in ("code_edit", "retrieval", "humaneval"):
        prompts = load(name, 3)
        assert len(prompts) == 3 and prompts == load(name, 3)
        assert all(len(p) > 100 for p in prompts)
    assert "def " in load("code_edit", 1)[0] and "Return the whole function" in load("code_edit", 1)[0]


def test_truncated_json_array_yields_every_complete_item():
    text = '[ {"a": 1}, {"b": [2, 3]},\n {"c": "cut off he'
    assert list(_complete_json_array_items(text)) == [{"a": 1}, {"b": [2, 3]}]
    assert list(_complete_json_array_items('[{"a": 1}]')) == [{"a": 1}]


def test_markdown_table_marks_speedup_identity_and_errors():
    rows = [
        {"workload": "code_edit", "mode": "md16", "concurrency": 1, "plain_tokens_per_s": 20.0,
         "tokens_per_s": 40.0, "speedup_vs_plain": 2.0, "round_ratios": [1.9, 2.0, 2.2], "decode_speedup": 2.31,
         "plain_tpot_ms": 50.0, "tpot_ms": 21.6, "mean_accepted_length": 3.1, "steps": 40,
         "ttft_ms_p50": 100.0, "latency_ms_p50": 3000.0, "latency_ms_p99": 3100.0, "identical_to_plain": True},
        {"workload": "mtbench", "mode": "la-4-5-5", "concurrency": 4, "error": "UNAVAILABLE: down"},
    ]
    table = markdown(rows).splitlines()
    assert table[0].startswith("| workload | mode |") and "speedup" in table[0]
    assert "| 2.00x | 1.90–2.20 | 2.31x | 50.0 | 21.6 |" in table[2] and table[2].endswith("| yes |")
    assert "error: UNAVAILABLE: down" in table[3]


def test_peers_table_sets_each_peer_beside_pardec_plain_and_best_mode():
    rows = [
        {"workload": "code_edit", "mode": mode, "concurrency": 1, "plain_tokens_per_s": plain,
         "tokens_per_s": speed, "mean_accepted_length": per_step}
        for mode, plain, speed, per_step in (("md16", 20.0, 50.0, 4.5), ("la-4-5-5", 22.0, 30.0, 2.5))
    ]
    peers = [{"workload": "code_edit", "peer": "transformers plain", "tokens_per_s": 14.0, "tokens_per_step": 1.0},
             {"workload": "code_edit", "peer": "llama.cpp plain", "tokens_per_s": 55.0, "tokens_per_step": None}]
    table = peers_markdown(rows, peers).splitlines()
    assert table[2] == "| code_edit | pardec plain | 21.0 | 1.0 | 1.00x |"  # median of the two plain runs
    assert table[3] == "| code_edit | pardec md16 | 50.0 | 4.5 | 2.38x |"
    assert table[4] == "| code_edit | transformers plain | 14.0 | 1.0 | 0.67x |"
    assert table[5] == "| code_edit | llama.cpp plain | 55.0 |  | 2.62x |"
    assert peers_markdown(rows, []) == ""


def test_a_failing_peer_becomes_a_row_that_says_why():
    from pardec.bench.peers import _guarded

    def crash():
        raise ValueError("could not broadcast")

    row = _guarded("retrieval", "llama.cpp", crash)
    assert row["error"] == "ValueError: could not broadcast" and row["tokens_per_s"] is None
    assert _guarded("retrieval", "llama.cpp", lambda: None) is None
    ok = _guarded("retrieval", "transformers plain", lambda: {"peer": "transformers plain", "tokens_per_s": 9.0})
    assert ok == {"workload": "retrieval", "peer": "transformers plain", "tokens_per_s": 9.0}
    rows = [{"workload": "retrieval", "mode": "md16", "concurrency": 1, "plain_tokens_per_s": 20.0,
             "tokens_per_s": 30.0, "mean_accepted_length": 1.5}]
    assert "| retrieval | llama.cpp | error: ValueError: could not broadcast |  |  |" in peers_markdown(rows, [row])


def test_every_mode_is_a_config_json_that_loads_with_its_plugin_params():
    import json

    import pardec.bench.stack
    from pardec.bench.stack import MODES, mindie_config
    from pardec.gateway.mindie import parse_mindie_config

    assert doctest.testmod(pardec.bench.stack).failed == 0  # mode names and their suffixes

    for name, params in MODES.items():
        settings = parse_mindie_config(json.dumps(mindie_config(params)), environ={})
        assert settings.draft.plugin_type == params["plugin_type"], name
        for key, value in params.items():
            assert getattr(settings.draft, key) == value, (name, key)


def test_prompt_lookup_replay_counts_forwards_as_transformers_drafts():
    assert doctest.testmod(pardec.bench.peers).failed == 0
    # The answer copies the prompt's tail: one forward accepts the 10 proposed tokens and makes
    # the 12th itself.
    prompt = list(range(100, 120))
    output = [109, *range(110, 120), 7]
    assert prompt_lookup_steps(prompt, output, num_tokens=10) == 1
    # Nothing to copy: one token per forward.
    assert prompt_lookup_steps([1, 2, 3], [4, 5, 6, 7]) == 3
    # After [3, 8] the 1-gram 8 matches earliest at the start, proposing [9, 1].
    assert prompt_lookup_steps([8, 9, 1, 8, 9, 2], [3, 8, 9, 1, 5], num_tokens=2) == 2  # the latest: 3


def test_a_cells_speedup_is_the_median_of_its_rounds_and_its_totals_pool_them():
    from pardec.bench.report import Cell

    plain = Cell("code_edit", "plain", 1, tokens=200, wall_s=10.0, steps=200, decode_ms=9000.0, decode_tokens=198)
    parallel = Cell("code_edit", "md16", 1, tokens=200, wall_s=5.0, steps=80, accepted_drafts=120, draft_nodes=480,
                    round_ratios=[1.8, 2.1, 2.4], decode_ms=3960.0, decode_tokens=198, round_decode_ratios=[2.5, 2.2, 2.3])
    row = parallel.summary(plain)
    assert row["speedup_vs_plain"] == 2.1 and row["round_ratios"] == [1.8, 2.1, 2.4]
    # The decoding phase alone: time after each request's first token, per token after the first.
    assert row["plain_tpot_ms"] == 45.45 and row["tpot_ms"] == 20.0 and row["decode_speedup"] == 2.3
    assert row["plain_tokens_per_s"] == 20.0 and row["tokens_per_s"] == 40.0 and row["mean_accepted_length"] == 2.5
    assert row["draft_nodes_per_step"] == 6.0 and row["accepted_per_node"] == 0.25  # what the trees cost
    assert plain.summary(plain)["draft_nodes_per_step"] == 0.0 and plain.summary(plain)["accepted_per_node"] is None
    failed = Cell("code_edit", "plain", 1, error="UNAVAILABLE: down")
    assert Cell("code_edit", "md16", 1).summary(failed)["error"] == "UNAVAILABLE: down"
    assert Cell("code_edit", "md16", 1).summary(failed)["speedup_vs_plain"] is None


def test_the_control_runs_plain_around_the_parallel_arm_and_is_never_the_best_mode():
    import pardec.bench.run

    assert doctest.testmod(pardec.bench.run).failed == 0  # round_order's arms, with and without the control
    rows = [
        {"workload": "mtbench", "mode": mode, "concurrency": 1, "plain_tokens_per_s": 90.0,
         "tokens_per_s": speed, "mean_accepted_length": per_step}
        for mode, speed, per_step in (("md16", 92.0, 1.3), (CONTROL, 95.0, 1.0))
    ]
    table = peers_markdown(rows, [{"workload": "mtbench", "peer": "transformers plain", "tokens_per_s": 14.0,
                                   "tokens_per_step": 1.0}]).splitlines()
    assert table[3] == "| mtbench | pardec md16 | 92.0 | 1.3 | 1.02x |"


def test_the_sizing_replay_charges_each_step_its_modelled_time():
    costs = sizing_replay.StepCosts(overhead_ms=3.0, drafter_ms=2.0, probe_ms=1.5,
                                    forward=CostCurve.from_points([(1, 1, 10.0), (5, 1, 18.0)]))
    assert costs.step_ms(0, asked=False) == 13.0  # plain
    assert costs.step_ms(0, asked=False, probed=True) == 14.5
    assert costs.step_ms(4, asked=True) == 3.0 + 18.0 + 2.0
    # Drafted ahead: the step waits for no call, and the call beside it ends within it.
    assert costs.step_ms(4, asked=False, ahead=True) == 3.0 + 18.0
    slow_drafter = sizing_replay.StepCosts(overhead_ms=3.0, drafter_ms=30.0, probe_ms=1.5, ahead_ms=0.5,
                                           forward=CostCurve.from_points([(1, 1, 10.0), (5, 1, 18.0)]))
    assert slow_drafter.step_ms(4, asked=False, ahead=True) == 30.5


def test_the_sizing_replay_runs_the_gateways_sizing_over_the_real_stack(tmp_path):
    """Real drafter, verifier and Redis; every output identical to plain decoding."""
    out = tmp_path / "replay.json"
    assert sizing_replay.main(["--workloads", "code_edit", "--modes", "md16,la-4-5-5,md16+overlap", "--prompts", "1",
                               "--max-new-tokens", "24", "--set", "probe_every=4", "--shared-memory", "1",
                               "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["policy"]["probe_every"] == 4
    modes = ["md16", "la-4-5-5", "md16+overlap", "md16+shared(1)", "la-4-5-5+shared(1)", "md16+overlap+shared(1)"]
    assert [row["mode"] for row in report["rows"]] == modes
    assert all(row["identical"] and row["speedup"] > 0 for row in report["rows"])
    assert report["rows"][0]["drafted_ahead"] == 0


def test_the_replays_shared_memory_is_warmed_on_prompts_it_does_not_measure():
    measured = set(load("humaneval", 3))
    warm_up = held_out("humaneval", 3, 10)
    assert len(warm_up) == len(set(warm_up)) == 10 and not measured & set(warm_up)
    assert held_out("humaneval", 3, 10) == warm_up  # the same on every run


def test_each_parallel_arm_starts_from_the_shared_memory_as_saved(tmp_path):
    import redis

    from pardec.bench.shared_memory import SharedMemorySnapshot
    from pardec.drafter.encoding import pack_tokens
    from pardec.drafter.memory import SharedMemory
    from pardec.drafter.redis_server import RedisServer

    with RedisServer(tmp_path / "redis") as server:
        client = redis.Redis.from_url(server.url)
        memory = SharedMemory(client, branch_length=4, max_contexts=100, key_prefix="pardec")
        name = "tenant/SmolLM2-135M-Instruct"
        client.set("pardec:{session-1}:meta", b"not a memory")
        memory.learn(name, pack_tokens("tokens", [1, 2, 3, 4, 5]))  # the held-out prompts' answers
        snapshot = SharedMemorySnapshot(server.url)
        assert snapshot.save() == len(memory.keys(name)) and snapshot.contexts() == 3  # (1,2) (2,3) (3,4)
        saved = client.hgetall(memory.keys(name)[0])
        memory.learn(name, pack_tokens("tokens", [1, 2, 9, 9, 9]))  # a measured request's answer
        assert client.hgetall(memory.keys(name)[0]) != saved
        snapshot.restore()
        assert client.hgetall(memory.keys(name)[0]) == saved
        assert memory.propose(name, [1, 2], 8, 4)[0][:3] == [3, 4, 5]
        snapshot.clear()
        assert snapshot.keys() == [] and client.get("pardec:{session-1}:meta") == b"not a memory"
        snapshot.close()
        client.close()


def test_a_bad_device_is_refused_before_anything_starts(capsys):
    from pardec.bench.run import main as bench_main
    from pardec.bench.verifier_steps import main as steps_main
    from pardec.gateway.cli import main as cli_main

    assert cli_main(["up", "--device", "tpu"]) == 2
    assert "configuration error: device: 'tpu' must be cpu, cuda[:N] or npu[:N]" in capsys.readouterr().err
    for main, argv in ((bench_main, ["--device", "cuda:x"]), (steps_main, ["--device", "gpu"])):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and "must be cpu, cuda[:N] or npu[:N]" in capsys.readouterr().err


class _FakeVerifier:
    """Accepts the first `accept` nodes of every tree; the bonus counts on from there."""

    def __init__(self, accept: int):
        self.accept, self.next, self.calls = accept, 100, []

    def prefill(self, session_id, prompt_ids):
        self.calls.append("prefill")
        return 1, 2.0

    def verify(self, session_id, tokens, parents):
        from pardec.verifier.api import Verification

        accepted = list(tokens[: self.accept])
        self.next += len(accepted) + 1
        return Verification(accepted, self.next, [0] * (len(tokens) + 1), 1.0)

    def release(self, session_id):
        self.calls.append("release")


class _ChainDrafter:
    def __init__(self):
        self.seen, self.ended = [], None

    def start(self, prompt_ids):
        self.seen.append(("start", list(prompt_ids)))

    def propose(self, new_tokens, node_argmax, max_depth):
        self.seen.append(("propose", list(new_tokens), max_depth))
        return [7, 8, 9], [-1, 0, 1]

    def observe(self, verified, nodes):
        self.seen.append(("observe", nodes))

    def end(self, last_tokens):
        self.ended = list(last_tokens)


def test_the_shared_decode_loop_commits_up_to_max_new_and_counts_every_step():
    from pardec.bench.decode import decode

    verifier, drafter = _FakeVerifier(accept=2), _ChainDrafter()
    result = decode(verifier, "s", [5, 6], 6, stops=(), drafter=drafter)
    # The prefill's token, then 3 a step (2 drafts + the bonus), cut at 6 tokens.
    assert result.output == [1, 7, 8, 103, 7, 8] and result.steps == 2 and result.nodes == 6
    assert result.accepted == 4 and result.produced == 6 and result.compute_ms == 4.0
    assert drafter.seen[:3] == [("start", [5, 6]), ("propose", [1], 4), ("observe", 3)]
    assert drafter.seen[3] == ("propose", [7, 8, 103], 1) and drafter.ended == [7, 8, 106]
    assert verifier.calls == ["prefill", "release"]
    plain = decode(_FakeVerifier(accept=0), "s", [5], 10, stops={102})
    assert plain.output == [1, 101, 102] and plain.nodes == 0  # the stop token ends it, counted


def test_the_launcher_starts_redis_alone_and_a_drafter_in_this_process(tmp_path):
    import grpc
    import redis

    from pardec.bench.stack import Local, launch
    from pardec.runtime.serving import CHANNEL_OPTIONS
    from pardec.v1 import drafter_pb2, drafter_pb2_grpc

    with launch(tmp_path / "a") as local:
        assert isinstance(local, Local) and local.drafter_address == ""
        assert redis.Redis.from_url(local.redis_url).ping()
    with launch(tmp_path / "b", drafter_in_process=True) as local:
        with grpc.insecure_channel(local.drafter_address, options=CHANNEL_OPTIONS) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            stub.StartSession(drafter_pb2.StartSessionRequest(session_id="s", prompt_token_ids=[1, 2, 3, 1, 2],
                                                              config=drafter_pb2.DraftConfig(decoding_length=4)))
            reply = stub.Propose(drafter_pb2.ProposeRequest(session_id="s", new_token_ids=[3], max_nodes=4,
                                                            max_depth=4))
            assert len(reply.tree.token_ids) <= 4


def test_the_grpc_round_trip_times_a_unary_call_and_a_message_on_an_open_stream(capsys):
    from pardec.bench import grpc_round_trip

    assert grpc_round_trip.main(["--calls", "20", "--rounds", "2", "--nodes", "4"]) == 0
    out = capsys.readouterr().out
    assert "| unary |" in out and "| stream |" in out and "stream / unary:" in out


def test_the_device_serving_script_runs_on_cpu(tmp_path):
    """Its stack part end to end (the GPU runs it with --device cuda): both modes, outputs
    identical to plain, the report written."""
    from pardec.bench import device_serving

    assert device_serving.main(["--device", "cpu", "--quick", "--prompts", "1", "--max-new-tokens", "12",
                                "--shape", "none", "--skip-peers", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "device_serving.json").read_text())
    assert set(report["stack"]) == {"md16+serial", "md16+overlap"}
    assert all(result["identical_to_plain"] and result["plain"]["decode_tok_s"] > 0 for result in report["stack"].values())
    assert "| md16+overlap | parallel |" in (tmp_path / "device_serving.md").read_text()


def test_a_peer_step_is_timed_on_random_weights_of_an_architectures_config():
    from transformers import LlamaConfig

    from pardec.bench import device_serving
    from pardec.bench.random_models import SHAPES

    assert device_serving.transformers_config("Qwen2.5-7B").num_key_value_heads == SHAPES["Qwen2.5-7B"].n_kv_heads
    qwen3 = device_serving.transformers_config("Qwen3-8B")
    assert type(qwen3).__name__ == "Qwen3Config" and qwen3.head_dim == 128
    tiny = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
    assert 0 < device_serving.transformers_step_ms(tiny, "cpu", context=16, new_tokens=5) < 1000


def test_the_prefix_cache_bench_serves_two_turns_with_the_cache_on_and_off(capsys):
    """The bench's stacks and table on one literal conversation (its MT-Bench conversations come
    with the bench extra, which the tests do not install)."""
    from pardec.bench import prefix_cache

    assert prefix_cache.compare([("Name a prime number.", "And an even one?")], rounds=1, max_new_tokens=4)
    out = capsys.readouterr().out
    assert "answers identical with and without the cache: True" in out
    cached = next(line for line in out.splitlines() if line.startswith("| prefix cache on"))
    assert " 0 of " not in cached  # the second turn found the first one's blocks


def test_the_structured_output_bench_compares_plain_and_parallel_under_a_schema(tmp_path):
    from pardec.bench import structured

    assert len(structured.prompts(3)) == 3 and all("def " in prompt for prompt in structured.prompts(3))
    assert structured.main(["--prompts", "1", "--rounds", "1", "--max-new-tokens", "24", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert {"json_schema", "tool_call", "free"} <= set(results) and results["tool_call"]["parallel_tok_s"] > 0
    assert "| json_schema |" in (tmp_path / "results.md").read_text()


def test_the_priority_bench_measures_both_classes_beside_a_background_load(tmp_path):
    from pardec.bench import priority

    assert priority.main(["--background", "1", "--probes", "1", "--max-new-tokens", "2", "--background-new-tokens",
                          "2", "--settle-s", "0.2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert [len(samples) for samples in result["samples_ms"].values()] == [1, 1]
    assert result["summary"]["urgent"]["ttft_ms_p50"] > 0 and "default over urgent" in (tmp_path / "results.md").read_text()
