"""JSON text read as it streams, without reading it again: where an object closes, where a tag
starts outside its strings (`JsonScan`), and whether text that does not decode yet never will
(`broken`). The tool-call readers (gateway/call_readers.py) and the reasoning reader
(gateway/answers.py) scan each character once, so no answer costs more than its length.

    >>> scan = JsonScan()
    >>> scan.advance('{"a": "}</t'), scan.advance('ag>", "b": {}}</tag>')
    ((11, ''), (14, 'closed'))
    >>> JsonScan(depth=1).advance(' "x": 1 </tag> }', "</tag>")
    (8, 'tag')
"""

from __future__ import annotations

import json

WHITESPACE = " \t\n\r"  # JSON's: the layouts' whitespace (not Unicode's)
# The most characters a cut-short JSON token ("fals", "1.5e+", a "\\u00" escape) runs past where
# the decoder reports it: an error before them is the text's, not the cut's.
JSON_LOOKAHEAD = 8
CLOSED, TAG, PARTIAL = "closed", "tag", "partial"


class JsonScan:
    """JSON text read a character at a time, for where an object closes and, with a ``tag``,
    where the tag starts: braces and the tag count only outside strings (escapes kept apart);
    brackets cannot unbalance braces in JSON, so only braces are counted."""

    def __init__(self, depth: int = 0):
        self.depth = depth
        self.in_string = False
        self.escaped = False

    def advance(self, text: str, tag: str = "") -> tuple[int, str]:
        """How much of ``text`` was read, and why it stopped: CLOSED (after the brace that took
        the depth to 0), TAG (where the tag starts), PARTIAL (where a piece of it ends the text:
        more may complete it), or "" (all of it read)."""
        for at, character in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif character == "\\":
                    self.escaped = True
                elif character == '"':
                    self.in_string = False
            elif character == '"':
                self.in_string = True
            elif character == "{":
                self.depth += 1
            elif character == "}":
                self.depth -= 1
                if self.depth == 0:
                    return at + 1, CLOSED
            elif tag and character == tag[0]:
                ahead = text[at:at + len(tag)]
                if ahead == tag:
                    return at, TAG
                if tag.startswith(ahead) and at + len(ahead) == len(text):
                    return at, PARTIAL
        return len(text), ""


def broken(error: json.JSONDecodeError, text: str) -> bool:
    """Whether no text that ``text`` starts can be JSON: the decoder failed before its last few
    characters (where a literal, number or escape may be cut short), not inside an open string."""
    return error.pos < len(text) - JSON_LOOKAHEAD and not error.msg.startswith("Unterminated string")


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that a ``tag`` starts with."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
