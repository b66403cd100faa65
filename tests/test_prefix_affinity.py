"""The gateway's choice of replica for a new session by where its prompt's start was served."""

import doctest

from pardec.gateway import prefix_affinity
from pardec.gateway.prefix_affinity import PrefixAffinity


def test_the_worked_example():
    assert doctest.testmod(prefix_affinity).failed == 0


def test_the_longest_start_wins_and_load_breaks_ties():
    affinity = PrefixAffinity(replicas=3, block_tokens=2)
    affinity.served(0, [1, 2, 3, 4])
    affinity.served(1, [1, 2, 3, 4, 5, 6])
    affinity.served(2, [1, 2, 3, 4, 5, 6])
    prompt = [1, 2, 3, 4, 5, 6, 7]
    assert affinity.choose([0, 1, 2], [0, 0, 0], prompt) == 1  # three blocks beat two; then the order
    assert affinity.choose([0, 1, 2], [0, 1, 0], prompt) == 2  # as long, and less busy
    assert affinity.choose([0, 1], [0, 3], prompt) == 0  # 1 is past the slack: the next best
    assert affinity.choose([0, 1, 2], [0, 0, 0], [9, 9, 9]) is None
    # The last token is computed anyway: a prompt that is exactly a cached block finds nothing.
    assert affinity.choose([0], [0], [1, 2]) is None


def test_each_replica_remembers_a_bounded_number_of_blocks():
    affinity = PrefixAffinity(replicas=1, block_tokens=1, capacity=3)
    affinity.served(0, [1, 2, 3, 4, 5])
    assert affinity.choose([0], [0], [1, 2, 3]) is None  # the oldest blocks went first
    assert len(affinity._seen[0]) == 3
