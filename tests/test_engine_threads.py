"""The engine's team of threads follows the machine (verifier/engine/threads.py): the choice on
literal timings, and the logits' independence of the team size that makes it lossless."""

from __future__ import annotations

import threading

import pytest
import torch

from pardec.verifier.engine import threads
from pardec.verifier.engine.threads import EXPLORE_EVERY, MIN_SAMPLES, ThreadChooser
from pardec.verifier.model.step import StepInput
from tests.steps import chain_step


def play(chooser: ThreadChooser, forwards: int, ms: dict[int, float], rows: int = 1) -> list[int]:
    """The teams of `forwards` forwards whose time is `ms` by team."""
    teams = []
    for _ in range(forwards):
        team = chooser.team(rows)
        chooser.record(team, rows, ms[team])
        teams.append(team)
    return teams


def test_each_team_is_timed_then_the_fastest_runs_and_others_are_tried_now_and_then():
    chooser = ThreadChooser(4)
    assert chooser.teams == (4, 2, 1)
    teams = play(chooser, 3 * MIN_SAMPLES + 3 * EXPLORE_EVERY, {4: 10.0, 2: 14.0, 1: 25.0})
    assert teams[: 3 * MIN_SAMPLES] == [4] * MIN_SAMPLES + [2] * MIN_SAMPLES + [1] * MIN_SAMPLES
    rest = teams[3 * MIN_SAMPLES:]
    assert rest.count(4) == len(rest) - 3 and sorted(set(rest) - {4}) == [1, 2]  # one try in EXPLORE_EVERY


def test_a_neighbour_arriving_and_leaving_moves_the_choice_both_ways():
    chooser = ThreadChooser(2)
    alone, beside = {2: 10.0, 1: 17.0}, {2: 60.0, 1: 20.0}
    play(chooser, 2 * MIN_SAMPLES, alone)
    assert chooser.team(1) == 2
    tail = play(chooser, 10 * EXPLORE_EVERY, beside)[-5 * EXPLORE_EVERY:]  # all but the tries of the other
    assert tail.count(1) == 5 * (EXPLORE_EVERY - 1)
    tail = play(chooser, 10 * EXPLORE_EVERY, alone)[-5 * EXPLORE_EVERY:]
    assert tail.count(2) == 5 * (EXPLORE_EVERY - 1)


def test_forward_sizes_are_timed_apart():
    chooser = ThreadChooser(2)
    play(chooser, 2 * MIN_SAMPLES, {2: 10.0, 1: 17.0}, rows=1)  # one row: two threads pay
    play(chooser, 2 * MIN_SAMPLES, {2: 30.0, 1: 20.0}, rows=64)  # (made up) 64 rows: one pays
    assert (chooser.team(1), chooser.team(64), chooser.team(100)) == (2, 1, 1)  # 64..127: one size


def test_without_adapting_run_leaves_torch_alone(monkeypatch):
    monkeypatch.setattr(threads.torch, "set_num_threads", lambda n: pytest.fail("set_num_threads called"))
    chooser = ThreadChooser(8, adapt=False)
    assert chooser.run(5, lambda: "done") == "done"


def test_the_logits_do_not_depend_on_the_team_size(engine):
    # A prompt, then steps of a chain and of a small tree, with one and with two threads: the
    # same bits, so the engine may change its team between any two forwards.
    model = engine.model
    if model.norm.weight.device.type != "cpu":
        pytest.skip("the team size is the CPU engine's")
    prompt = torch.arange(100, 160).tolist()
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)

    def forwards(team: int) -> list[torch.Tensor]:
        torch.set_num_threads(team)
        pool = model.new_pool(512, 16)
        cache = pool.session()
        cache.reserve(len(prompt) + 8)
        with torch.inference_mode():
            out = [model.forward_batch([chain_step(prompt, cache)])[0]]
            cache.commit(torch.arange(len(prompt)), trim=False)
            out.append(model.forward_batch([StepInput(torch.tensor([7, 8, 9, 10]), torch.tensor([0, 1, 1, 2]), tree,
                                                      cache)])[0])
        cache.free()
        return out

    before = torch.get_num_threads()
    results = {}
    try:
        for team in (2, 1):
            thread = threading.Thread(target=lambda t=team: results.__setitem__(t, forwards(t)))
            thread.start()
            thread.join()
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(results[2], results[1]))
