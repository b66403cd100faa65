"""`pardec chat`: an interactive conversation with a running gateway.

Each line typed is a user turn; the whole conversation so far goes with it (GenerateRequest's
``messages``), and the reply streams back as it is committed. One ``session_id`` for the whole
chat lets the drafter draft from the conversation's earlier answers. Lines starting with "/" are
commands: /reset starts over (a new session id too), /exit or end of input ends the chat. Ctrl-C
stops a reply (the turn is left out), or at the prompt ends the chat.
"""

from __future__ import annotations

import sys
import uuid
from typing import Callable, TextIO

import grpc

from pardec.v1 import gateway_pb2

_ROLES = {"system": gateway_pb2.ROLE_SYSTEM, "user": gateway_pb2.ROLE_USER, "assistant": gateway_pb2.ROLE_ASSISTANT}
HELP = "commands: /reset (start over), /exit (or Ctrl-D)"


def new_session_id() -> str:
    return f"chat-{uuid.uuid4().hex[:16]}"


class Chat:
    """A conversation: ``system`` first (None: the model's own default), then the turns."""

    def __init__(self, template: gateway_pb2.GenerateRequest, system: str | None = None, session_id: str = ""):
        self.template = template  # every setting of a turn's request but its messages
        self.system = system
        self.session_id = session_id or new_session_id()
        self.turns: list[tuple[str, str]] = []

    def request(self, user_text: str) -> gateway_pb2.GenerateRequest:
        request = gateway_pb2.GenerateRequest()
        request.CopyFrom(self.template)
        turns = ([("system", self.system)] if self.system is not None else []) + self.turns + [("user", user_text)]
        request.messages.extend(gateway_pb2.Message(role=_ROLES[role], content=text) for role, text in turns)
        request.session_id = self.session_id
        return request

    def answered(self, user_text: str, reply: str) -> None:
        self.turns += [("user", user_text), ("assistant", reply)]

    def reset(self) -> None:
        self.turns = []
        self.session_id = new_session_id()


def run(
    chat: Chat, stream: Callable[[gateway_pb2.GenerateRequest], object], lines: TextIO = sys.stdin,
    out: TextIO = sys.stdout, err: TextIO = sys.stderr, prompt: str = "> ",
) -> int:
    """Reads turns from ``lines`` until /exit or the end; ``stream(request)`` is the gateway's
    GenerateStream. A refused or failed turn is reported and left out of the conversation; the
    exit code is 1 once one failed (a script piping turns in sees it), else 0."""
    failed = False
    while True:
        if prompt:
            out.write(prompt)
            out.flush()
        try:
            line = lines.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt ends the chat, as Ctrl-D does
            line = ""
        if not line:
            out.write("\n" if prompt else "")
            return int(failed)
        text = line.rstrip("\n")
        command = text.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return int(failed)
        if command == "/reset":
            chat.reset()
            err.write("(a new conversation)\n")
            continue
        if command.startswith("/"):
            err.write(f"unknown command {command.split()[0]!r}; {HELP}\n")
            continue
        pieces, stats = [], None
        call = stream(chat.request(text))
        try:
            for chunk in call:
                if chunk.reasoning_content:  # a thinking model's thinking: shown beside the answer
                    err.write(chunk.reasoning_content)
                    err.flush()
                out.write(chunk.text)
                out.flush()
                pieces.append(chunk.text)
                if chunk.finish_reason:
                    stats = chunk.stats
        except grpc.RpcError as error:
            out.write("\n")
            err.write(f"error: {error.code().name}: {error.details()}\n")
            failed = True
            continue
        except KeyboardInterrupt:  # Ctrl-C during a reply stops it; the turn is left out
            call.cancel()
            out.write("\n")
            err.write("(interrupted)\n")
            continue
        out.write("\n")
        chat.answered(text, "".join(pieces))
        if stats is not None:
            err.write(f"[{stats.decoding_method}, {stats.steps} steps, mean accepted length "
                      f"{stats.mean_accepted_length:.2f}, {stats.total_ms:.0f} ms]\n")
