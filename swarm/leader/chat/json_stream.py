"""JSON text as a model writes it, rewritten piece by piece into the form ``json.dumps(json.loads(text),
ensure_ascii=False)`` gives -- the form of a tool call's arguments in a whole reply -- so that streamed pieces add up
to exactly those arguments.

The rewrite is what json.dumps does with its default separators: no whitespace between tokens but ``", "`` and
``": "``; strings with their escapes decoded and written again the way json.dumps writes them; numbers and literals
as Python reads and writes them (``1.50`` -> ``1.5``, ``1e2`` -> ``100.0``). A string streams character by character;
a number or literal goes out when the token after it shows where it ends. It reads one JSON value (an object or an
array) and stops at its end.
"""

from __future__ import annotations

import json

_SCALAR = set("0123456789+-.eEtrufalsn")


class JsonRewriter:
    def __init__(self):
        self.depth = 0
        self.started = False
        self.complete = False
        self._in_string = False
        # an escape sequence being read (from its backslash), or a high surrogate waiting for its pair
        self._escape = ""
        self._scalar = ""  # a number or literal being read

    def feed(self, text: str) -> tuple[str, int]:
        """(the rewritten piece, how many characters of ``text`` were read): all of them, or up to the value's end."""
        out: list[str] = []
        for used, char in enumerate(text):
            if self.complete:
                return "".join(out), used
            out.append(self._char(char))
        return "".join(out), len(text)

    def _char(self, char: str) -> str:
        if self._in_string:
            return self._string_char(char)
        if char in _SCALAR:
            self._scalar += char
            return ""
        out = self._end_scalar()
        if char in " \t\r\n":
            return out
        if char in "{[":
            self.depth += 1
            self.started = True
            return out + char
        if char in "}]":
            self.depth -= 1
            if self.depth <= 0:
                self.complete = True
            return out + char
        if char == ",":
            return out + ", "
        if char == ":":
            return out + ": "
        if char == '"':
            self._in_string = True
            return out + '"'
        return out + char  # not JSON: passed on as it is (the whole reply's parse decides)

    def _string_char(self, char: str) -> str:
        if self._escape:
            self._escape += char
            return self._decode_escape()
        if char == "\\":
            self._escape = char
            return ""
        if char == '"':
            self._in_string = False
            return '"'
        return json.dumps(char, ensure_ascii=False)[1:-1]

    def _decode_escape(self) -> str:
        escape = self._escape
        # a surrogate pair is two \\u escapes: a high half waits for its low half
        pending = escape.startswith("\\u") and len(escape) >= 6 and 0xD800 <= _hex(escape[2:6]) < 0xDC00
        complete = (escape[1] != "u" and len(escape) == 2) or \
            (escape[1] == "u" and len(escape) == 6 and not pending) or (pending and len(escape) == 12)
        if pending and len(escape) > 6 and not escape[6:].startswith("\\u"[: len(escape) - 6]):
            complete = True  # a lone high surrogate: json.dumps cannot write it either; passed on as written
            self._escape = ""
            return escape
        if not complete:
            return ""
        self._escape = ""
        try:
            decoded = json.loads(f'"{escape}"')
        except ValueError:
            return escape
        return json.dumps(decoded, ensure_ascii=False)[1:-1]

    def _end_scalar(self) -> str:
        token, self._scalar = self._scalar, ""
        if not token:
            return ""
        try:
            return json.dumps(json.loads(token))
        except ValueError:
            return token


def _hex(digits: str) -> int:
    try:
        return int(digits, 16)
    except ValueError:
        return -1
