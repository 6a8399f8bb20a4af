"""Tool calls out of the generated text: `<tool_call>` blocks -> OpenAI `tool_calls`, as it streams.

The output format is the one the tool grammar enforces (services/gateway/tool_grammar.py):

    <tool_call>\\n{"name": "<function>", "arguments": {...}}\\n</tool_call>

`ToolCallStream.feed(text)` splits each piece of streamed text into content (outside the blocks)
and tool-call deltas: the first delta of a call carries its id and name, as soon as the name is
complete; the following ones carry pieces of the arguments' JSON text exactly as generated (their
concatenation is the arguments). Text that may be the start of a block is held back until it is
decided; whitespace between and after calls is not content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

TRIGGER, CLOSE = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:')
_TEXT, _HEADER_STATE, _ARGUMENTS, _TAIL = "text", "header", "arguments", "tail"


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # first delta of a call only
    name: str | None = None  # first delta of a call only
    arguments: str = ""

    def openai(self) -> dict:
        """The delta as OpenAI streams it (choices[0].delta.tool_calls[0])."""
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    complete: bool = False

    def openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": "".join(self.arguments)}}


class ToolCallStream:
    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._state = _TEXT
        self._depth = 0  # the arguments' JSON nesting
        self._in_string = self._escaped = self._started = False

    @property
    def open_call(self) -> bool:
        """A call started and did not end (the output was cut off)."""
        return self._state != _TEXT

    def complete_calls(self) -> list[ToolCall]:
        return [c for c in self.calls if c.complete]

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """(content, deltas) that `text` decides."""
        self._buffer += text
        content, deltas = [], []
        while True:
            progressed = getattr(self, "_" + self._state)(content, deltas)
            if not progressed:
                return "".join(content), deltas

    def finish(self) -> str:
        """The text still held back, at the end of the output: content when it is plain text,
        the raw rest when a call was cut off; whitespace after calls is dropped."""
        rest, self._buffer = self._buffer, ""
        if self._state == _TEXT and self.calls and not rest.strip():
            return ""
        return rest

    # ---- states: each consumes what it can decide; False when it needs more text -----------
    def _text(self, content: list[str], deltas: list) -> bool:
        at = self._buffer.find(TRIGGER)
        if at < 0:
            keep = _partial_suffix(self._buffer, TRIGGER)
            decided, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
            if self.calls and not decided.strip():  # whitespace after a call: wait, it may be a separator
                self._buffer = decided + self._buffer
                return False
            content.append(decided)
            return False
        before = self._buffer[:at]
        if not (self.calls and not before.strip()):
            content.append(before)
        self._buffer = self._buffer[at + len(TRIGGER):]
        self._state = _HEADER_STATE
        return True

    def _header(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        match = _HEADER.match(self._buffer)
        if match is None:
            return False
        name = json.loads('"' + match.group(1) + '"')
        call = ToolCall("call_" + uuid.uuid4().hex[:24], name)
        self.calls.append(call)
        deltas.append(ToolCallDelta(len(self.calls) - 1, call.id, name))
        self._buffer = self._buffer[match.end():]
        self._state, self._depth, self._in_string, self._escaped, self._started = _ARGUMENTS, 0, False, False, False
        return True

    def _arguments(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        end = None
        start = 0
        for i, char in enumerate(self._buffer):
            if not self._started:
                if char.isspace():
                    start = i + 1
                    continue
                self._started = True
            if self._in_string:
                self._escaped = not self._escaped and char == "\\"
                self._in_string = self._escaped or char != '"'
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                if self._depth == 0:  # a scalar's end: the closing brace of the call
                    end = i
                    break
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
            elif self._depth == 0 and (char.isspace() or char == ","):
                end = i
                break
        piece = self._buffer[start:len(self._buffer) if end is None else end]
        if piece:
            call = self.calls[-1]
            call.arguments.append(piece)
            deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=piece))
        if end is None:
            self._buffer = ""
            return False
        self._buffer = self._buffer[end:]
        self._state = _TAIL
        return True

    def _tail(self, content: list[str], deltas: list) -> bool:
        at = self._buffer.find(CLOSE)
        if at < 0:
            return False
        self._buffer = self._buffer[at + len(CLOSE):]
        self.calls[-1].complete = True
        self._state = _TEXT
        return True


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall], bool]:
    """The whole output at once: (content, complete calls, a call was cut off)."""
    stream = ToolCallStream()
    content, _ = stream.feed(text)
    open_call = stream.open_call
    return content + stream.finish(), stream.complete_calls(), open_call


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
