"""memory_decoding: draft token trees from n-grams of the session's own text, stored in Redis.

After alipay's PainlessInferenceAcceleration (lookahead) and Huawei MindIE's memory decoding.
Each session owns a trie of the n-grams of its tokens (the prompt, then every committed token).

Insertion. For every position i of the sequence t, the path t[i], t[i+1], ..., t[i+branch_length]
(shorter at the end of the sequence) goes into the trie, and every node on it gets +1. Counting
happens when a node's *last* token arrives: node (i, depth) is counted once, by the token at
i + depth - 1, which is why appending tokens later gives exactly the trie of the whole sequence.
That token also decides the kind of the count: `prompt` if it is a prompt token, `output` if it
was generated. So a path that starts in the prompt and runs into the output counts as output from
its first generated token on: its prompt-only prefix was already counted as prompt evidence.

Retrieval. The query is the last two committed tokens (a, b): start at the node for [a, b], or at
the node for [b] when [a, b] has never been continued. Candidates are that node's descendants;
each has a score that estimates the probability that the text goes on with it: the product
along its path of escape(parent) * weight / (total weight of it and its siblings), with weight =
prompt_count * PROMPT_WEIGHT + output_count and escape = total / (total + number of siblings),
Witten-Bell's estimate that a context continues the way it was seen to rather than in a new way.
The tree grows best-first: take the highest scoring candidate (ties: siblings by higher weight
then lower token, otherwise the candidate whose parent was taken first) until max_nodes are
taken, never deeper than max_depth (the query node's children have depth 1). The result lists
a parent before its children, scores non-increasing, so every prefix of it is a tree of the
best nodes: `tokens`, and `parents` as indexes into it (-1: a child of the query node).

Copy. Counts hedge between continuations and stop at branch_length, but a text that copies
(a code edit returns the function it was given, an answer quotes its passage) goes on after the
*latest* occurrence of what it just wrote, for as long as the copy lasts. So a session also
keeps a copy pointer: the index in its tokens of the token the text would write next if it
goes on copying. Each committed token is checked against it, one trial each until the first
miss, which drops the pointer; then, unless the pointer still follows a match at least as long,
it moves behind the latest earlier occurrence of the longest suffix (at most branch_length
tokens) that went on before. Each trie entry keeps where its path last ended, so that is
O(branch_length) work, never a scan of the tokens. The chain copied from the pointer, up to
max_nodes and max_depth (not bound by branch_length), joins the tree with scores r, r^2, ...,
r = (hits + 2) / (trials + 3): how often the pointer's next token was right in this session
(the record halves at COPY_WINDOW trials, to follow a change of regime). Past the last token the
chain starts over from the pointer: a text that goes on copying what it wrote p tokens back
writes those p tokens again and again (a loop, which greedy decoding of a small model falls
into), so a loop of 2 tokens is drafted 16 deep, not cut where the text ends. Tree and chain are
merged as runtime/trees.py's merge_trees does (a node's score is the higher of the two), cut
to max_nodes, best first.

Worked example, branch_length 3, one prompt [1, 2, 3, 1, 2, 4, 1, 2]: the paths are
[1,2,3,1] [2,3,1,2] [3,1,2,4] [1,2,4,1] [2,4,1,2] [4,1,2] [1,2] [2]. Query (1, 2): the node [1, 2]
has children 3 and 4 (weight 4 each, escape 8/10, score 0.4 each; 3 first, lower token).
[1,2,3] has the one child 1 (score 0.4 * 4/5 * 4/4 = 0.32), and so does [1,2,4]; paths hold 4
tokens, so the trie's tree is [3, 4, 1, 1], parents [-1, -1, 0, 1]. The longest suffix that
went on before is [1, 2] ([4, 1, 2] never did), latest at index 3, so the pointer is at index
5; at max_depth 4 the chain is [4, 1, 2] and then 4 again, scores 2/3, 4/9, 8/27, 16/81 (no
trials yet: r = 2/3). Merged: [4] 2/3, [4, 1] 4/9, [3] 0.4, [3, 1] 0.32, [4, 1, 2] 8/27,
[4, 1, 2, 4] 16/81:

    >>> store.start_session("s", [1, 2, 3, 1, 2, 4, 1, 2])   # tests/references/stores.py, branch_length=3
    >>> store.propose("s", [], max_nodes=16, max_depth=4)
    ([4, 1, 3, 1, 2, 4], [-1, 0, -1, 2, 1, 4])

Each step is one Redis round trip: a Lua script (memory_decoding.lua, which details the encoding)
appends the tokens, inserts the new paths and grows the tree server-side. A start is different:
its prompt (and a conversation's earlier output) is many tokens at once, and Redis runs one
script at a time for every session, so the drafter builds that trie in its own process
(TrieImage, the script's encoding byte for byte) and only writes it, START_CHUNK_FIELDS fields a
call, so that other sessions' steps are served in between; until its last piece is in, the
session is not there for propose. Drafter replicas scale out; Redis does not. A session has
three keys, with its id as a hash tag so that they share a Redis Cluster slot, all expiring
`ttl_s` after the session's last call:

    pardec:{<session>}:trie    hash, a field per node that can have children: (parent id,
                               token) -> node id, then (token, prompt, output, seen_at) per child
    pardec:{<session>}:tokens  the committed tokens
    pardec:{<session>}:state   branch_length (fixed at start), next node id, the active nodes,
                               the copy pointer and its record, and with dynamic_algo the
                               candidate length and its statistics
"""

from __future__ import annotations

import struct
import uuid
from array import array
from collections.abc import Iterator, Sequence

from pardec.drafter.encoding import checked_int, hash_tag, pack_tokens
from pardec.runtime.draft_params import BY_NAME, MAX_TREE_NODES


# A continuation seen in the prompt counts as much as one seen 4 times in the generated text.
# Prompt n-grams are what the answer is most likely to copy (code edits, summaries, RAG quotes),
# while the output's own n-grams are few early on and noisy; 4 still lets a pattern the model
# keeps repeating overtake a single prompt occurrence.
PROMPT_WEIGHT = 4
# The copy's record starts at 2 hits in 3 trials and halves at COPY_WINDOW trials. The script
# holds its own copies of these (COPY_PRIOR_HITS, ...); the tests' reference reads these.
COPY_PRIOR = (2, 3)
COPY_WINDOW = 64

MAX_BRANCH_LENGTH = 64
# The trie's tree stops at branch_length, the copy chain at the session's length, so a large
# max_depth (e.g. "the tokens still to generate") is harmless; the bound keeps it a sane integer.
MAX_TREE_DEPTH = 2**31 - 1

# dynamic_algo's length grows up to decoding_length, so at most decoding_length's own bound.
MAX_DYNAMIC_LENGTH = BY_NAME["decoding_length"].high
# Redis runs one script at a time: a start's fields go in pieces, so that a long prompt does not
# hold other sessions' proposes past their deadline. Writing a field is cheap (no Lua per token),
# so pieces are large; 2 values a field stay under Lua's limit on unpack()'s values (~8000).
# Figures: docs/benchmarks.md, "Figures behind design choices".
START_CHUNK_FIELDS = 2048

_FIELD = struct.Struct(">II")  # (parent id, token): a node's field in the trie hash
# A child entry, struct(">I4I4I4I4") token, prompt count, output count, seen_at, as one int.
_PROMPT, _OUTPUT, _SEEN_AT, _ENTRY = 1 << 64, 1 << 32, (1 << 32) - 1, (1 << 128) - 1


def memory_decoding_keys(key_prefix: str, session_id: str) -> list[str]:
    # Order matters: memory_decoding.lua reads them as KEYS[1..3].
    tag = hash_tag(key_prefix, session_id)
    return [f"{tag}:trie", f"{tag}:tokens", f"{tag}:state"]


class TrieImage:
    """The trie hash and state of a session as memory_decoding.lua builds them token by token, built
    here instead: the same node ids, the same child entries in the same order, the same bytes.

    >>> image = TrieImage(branch_length=2)
    >>> image.add([7, 8, 7], prompt=True, record=True)
    >>> image.next_id, [TrieImage.node_of(field) for field in image.fields()[0::2]]
    (5, [(0, 7), (0, 8), (1, 8), (2, 7)])

    Node 1 is the path [7], node 2 [8], node 3 [7, 8], node 4 [8, 7]; the active paths, which the
    next token continues, are [7] and [8, 7] (nodes 1 and 4). A path of branch_length + 1 tokens
    ([7, 8, 7]) is only counted, in its parent's entries, never a node of its own.
    """

    def __init__(self, branch_length: int):
        self.branch_length = checked_int("branch_length", branch_length, 1, MAX_BRANCH_LENGTH)
        # Every path the trie knows, keyed parent id << 32 | token (`token` after node `parent`,
        # which is also the path's field in the trie hash): its node id << 128 (0: too long to be
        # a node) | its child entry, the 128 bits of the script's packed entry (0: not counted;
        # the root's children never are). Plain ints, no container per node: a long prompt makes
        # hundreds of thousands of paths, in a process that serves other sessions meanwhile.
        self._paths: dict[int, int] = {}
        self._keys = array("Q", [0])  # node id -> its path's key; 0 is the root, which has none
        self._active: list[int] = []
        self.recorded = 0  # tokens in the session's tokens key

    @property
    def next_id(self) -> int:
        return len(self._keys)

    def add(self, tokens: Sequence[int], *, prompt: bool, record: bool) -> None:
        """Counts each token's paths as the script's add_token does: as prompt or output evidence;
        a recorded token is one of the session's own (its seen_at is 1 + its index), the others
        a memory's (seen_at 0)."""
        paths, keys, active = self._paths, self._keys, self._active
        count, growing = (_PROMPT if prompt else _OUTPUT), self.branch_length - 1
        for n, token in enumerate(tokens):
            seen_at = self.recorded + n + 1 if record else 0
            for parent in active:
                key = parent << 32 | token
                value = paths.get(key, 0)
                if not value & _ENTRY:
                    paths[key] = value | token << 96 | count | seen_at
                elif seen_at:
                    paths[key] = (value + count) & ~_SEEN_AT | seen_at
                else:
                    paths[key] = value + count
            grown = []
            for parent in (0, *active[:growing]):
                key = parent << 32 | token
                value = paths.get(key, 0)
                node = value >> 128
                if not node:
                    node = len(keys)
                    keys.append(key)
                    paths[key] = value | node << 128
                grown.append(node)
            active[:] = grown
        if record:
            self.recorded += len(tokens)

    def end_sequence(self) -> None:
        """What follows does not continue the tokens so far (a memory does not run on into the prompt)."""
        self._active.clear()

    def pieces(self, nodes: int) -> Iterator[list[bytes]]:
        """The trie hash as [field, value, field, value, ...] lists of `nodes` nodes each, in node
        order, each made when asked for."""
        # A node's entries in the order its children were first counted: the order of the keys.
        children: list[bytearray | None] = [None] * len(self._keys)
        for key, value in self._paths.items():
            if value & _ENTRY:
                parent, packed = key >> 32, (value & _ENTRY).to_bytes(16, "big")
                if children[parent] is None:
                    children[parent] = bytearray(packed)
                else:
                    children[parent] += packed
        keys = self._keys
        for first in range(1, len(keys), nodes):
            piece: list[bytes] = []
            for node in range(first, min(first + nodes, len(keys))):
                piece += (keys[node].to_bytes(8, "big"), node.to_bytes(4, "big") + (children[node] or b""))
            yield piece

    def fields(self) -> list[bytes]:
        """The whole trie hash as one [field, value, ...] list."""
        return [item for piece in self.pieces(len(self._keys)) for item in piece]

    def packed_active(self) -> bytes:
        return b"".join(self._keys[node].to_bytes(8, "big") for node in self._active)

    @staticmethod
    def node_of(field: bytes) -> tuple[int, int]:
        return _FIELD.unpack(field)


def start_calls(
    prompt_tokens: Sequence[int], branch_length: int, dynamic_max_length: int = 0, memory_tokens: Sequence[int] = ()
) -> Iterator[list]:
    """ARGV[2:] of each call of a start, made as they are sent: "start" with the session's state
    and the first START_CHUNK_FIELDS fields of its trie, then "continue"s with the rest. The
    memory (earlier output) is counted first, as a sequence of its own, then the prompt."""
    packed_prompt = pack_tokens("prompt_tokens", prompt_tokens)
    pack_tokens("memory_tokens", memory_tokens)  # checks them
    dynamic_max_length = checked_int("dynamic_max_length", dynamic_max_length, 0, MAX_DYNAMIC_LENGTH)
    image = TrieImage(branch_length)
    image.add(memory_tokens, prompt=False, record=False)
    image.end_sequence()
    image.add(prompt_tokens, prompt=True, record=True)
    return _calls(image, branch_length, dynamic_max_length, packed_prompt)


def _calls(image: TrieImage, branch_length: int, dynamic_max_length: int, packed_prompt: bytes) -> Iterator[list]:
    count = max(1, -(-(image.next_id - 1) // START_CHUNK_FIELDS))
    build_id = uuid.uuid4().hex
    pieces = image.pieces(START_CHUNK_FIELDS)
    state = [branch_length, dynamic_max_length, packed_prompt, image.next_id, image.packed_active()]
    yield ["start", build_id, int(count > 1), *state, *next(pieces, [])]
    for at, piece in enumerate(pieces, start=2):
        yield ["continue", build_id, int(at < count), *piece]


def propose_args(new_tokens: Sequence[int], max_nodes: int, max_depth: int, verified_depth: int = -1) -> list:
    """ARGV[3:] of the script's "propose"; verified_depth -1: the whole previous tree was verified."""
    return [
        pack_tokens("new_tokens", new_tokens),
        checked_int("max_nodes", max_nodes, 0, MAX_TREE_NODES),
        checked_int("max_depth", max_depth, 0, MAX_TREE_DEPTH),
        PROMPT_WEIGHT,
        checked_int("verified_depth", verified_depth, -1, MAX_TREE_DEPTH),
    ]
