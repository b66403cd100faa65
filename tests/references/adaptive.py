"""dynamic_algo: a memory_decoding session's candidate length follows its recent acceptance.

MindIE's `dynamic_algo` (after PIA): a moving average of the hit ratio moves the candidate
length up or down by 1 within bounds, starting at 3. Here the length caps the tree's node
count, so a session whose drafts keep missing shrinks to 1-node trees (a verify step costs
little more than plain decoding) and one whose drafts keep hitting grows to decoding_length.

A step's hit ratio is accepted / depth of the tree it verified: accepted = len(new tokens) - 1
(the committed tokens are the accepted drafts plus the bonus), and the depth is the most that
could have been accepted. Everything is integer arithmetic (per mille), so memory_decoding.lua
reproduces it exactly and every replica agrees. This is the reference, kept with the tests;
drafter/memory_decoding.lua is what runs.
"""

from __future__ import annotations

START_LENGTH = 3
START_AVERAGE = 500  # per mille: halfway between the thresholds, so the first step decides
# Grow while at least 60% of the depth is being accepted; shrink below 30%. In between the
# length holds: a tree that is half used is about as long as it should be.
GROW_AT, SHRINK_AT = 600, 300
MIN_LENGTH = 1


def start_length(max_length: int) -> int:
    """The length of a session's first tree.

    >>> start_length(16), start_length(2)
    (3, 2)
    """
    return min(START_LENGTH, max_length)


def adapt_length(length: int, average: int, committed: int, last_depth: int, max_length: int) -> tuple[int, int]:
    """The next (length, average) after a step that committed `committed` tokens from a tree
    of depth `last_depth`; the average is exponential with weight 1/2 on the newest step.

    >>> adapt_length(3, 500, committed=4, last_depth=3, max_length=16)  # all 3 accepted
    (4, 750)
    >>> adapt_length(4, 750, committed=1, last_depth=4, max_length=16)  # none: 375, holds
    (4, 375)
    >>> adapt_length(4, 375, committed=1, last_depth=4, max_length=16)  # none again: 187
    (3, 187)
    >>> adapt_length(16, 900, committed=9, last_depth=8, max_length=16)  # at the bound
    (16, 950)
    >>> adapt_length(3, 500, committed=1, last_depth=0, max_length=16)  # no tree: no news
    (3, 500)
    """
    if last_depth <= 0 or committed <= 0:
        return length, average
    accepted = min(committed - 1, last_depth)
    average = (average + 1000 * accepted // last_depth) // 2
    if average >= GROW_AT and length < max_length:
        length += 1
    elif average <= SHRINK_AT and length > MIN_LENGTH:
        length -= 1
    return length, average
