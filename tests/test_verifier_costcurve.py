"""The verifier's step cost curve: measured at startup, published in ModelInfo.cost_curve."""

import grpc

from pardec.runtime.serving import start_server
from pardec.v1 import verifier_pb2, verifier_pb2_grpc
from pardec.verifier.config import VerifierConfig
from pardec.verifier.engine.costcurve import BATCHES, MAX_ROWS, TREE_TOKENS, measure_cost_curve, remembered_cost_curve
from pardec.verifier.engine.engine import Engine
from pardec.verifier.model.kvcache import KVPool
from pardec.verifier.service import VerifierServicer


def test_startup_measures_the_full_curve_unless_told_not_to(engine):
    # The shared engine comes from build_engine; whichever way its config says, it is honoured.
    points = {(t, b): ms for t, b, ms in engine.cost_curve}
    if engine.config.measure_cost_curve:
        assert set(points) == {(t, b) for t in TREE_TOKENS for b in BATCHES if t * b <= MAX_ROWS}
        assert all(ms > 0 for ms in points.values())
        assert points[64, 4] > points[1, 1]  # noise aside, 256 tokens cost more than 1
    else:
        assert points == {}


def test_model_info_carries_the_cost_curve(engine):
    own = Engine(engine.model, engine.tokenizer, engine.model_name, VerifierConfig(measure_cost_curve=False))
    own.cost_curve = own.call(
        lambda: measure_cost_curve(own.model, own.pool, tree_tokens=(1, 8), batches=(1, 2), context=32, repeats=1)
    )
    server, address = start_server([VerifierServicer(own).add_to], "127.0.0.1:0")
    try:
        with grpc.insecure_channel(address) as channel:
            info = verifier_pb2_grpc.VerifierStub(channel).GetModelInfo(verifier_pb2.GetModelInfoRequest())
        assert [(p.tokens, p.batch) for p in info.cost_curve] == [(1, 1), (8, 1), (1, 2), (8, 2)]
        assert all(p.step_ms > 0 for p in info.cost_curve)
    finally:
        server.stop(None)
        own.close()


def test_measuring_gives_its_pool_space_back(engine):
    pool = KVPool(engine.model.args, 1024, 32)
    measure_cost_curve(engine.model, pool, tree_tokens=(1, 8), batches=(1, 2), context=64, repeats=1)
    assert pool.free_tokens == pool.capacity_tokens


def test_a_kept_curve_is_reused_until_what_sets_step_cost_changes(tmp_path):
    measured = []

    def measure(curve):
        def run():
            measured.append(curve)
            return curve
        return run

    first = [(1, 1, 2.5), (8, 1, 3.0)]
    assert remembered_cost_curve(tmp_path, {"checkpoint": "a", "threads": 2}, measure(first)) == first
    assert remembered_cost_curve(tmp_path, {"threads": 2, "checkpoint": "a"}, measure([(1, 1, 9.0)])) == first
    assert measured == [first]
    other = [(1, 1, 4.0)]
    assert remembered_cost_curve(tmp_path, {"checkpoint": "a", "threads": 1}, measure(other)) == other
    # A damaged file is measured again and replaced.
    for kept in (tmp_path / "cost-curves").iterdir():
        kept.write_text("{not json")
    assert remembered_cost_curve(tmp_path, {"checkpoint": "a", "threads": 2}, measure(first)) == first
    assert len(measured) == 3
    assert remembered_cost_curve(tmp_path, {"checkpoint": "a", "threads": 2}, measure(other)) == first
