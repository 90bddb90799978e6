"""What the Idempotency-Key middleware shares with ``oncegate proxy``, byte for byte: the
canonical form of a JSON body for its fingerprint (``payload.rs``), the stored answer's
format (``stored.rs``), which statuses are stored (``StoredStatuses``) and problem
documents (RFC 9457)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

__all__ = ["Answer", "StoredStatuses", "canonical_as_written", "decode_stored", "encode_stored", "problem"]

#: Nesting deeper than this has no canonical form (serde_json's parser stops there too).
DEPTH_MAX = 128

Headers = List[Tuple[bytes, bytes]]


@dataclass
class Answer:
    """An HTTP answer: status, headers (lower-case names) and body."""

    status: int
    headers: Headers
    body: bytes


# The canonical form of a JSON body ----------------------------------------------------


def canonical_as_written(text: str) -> Optional[str]:
    """The canonical form of ``text``, a document already known to be valid JSON: the
    text as written, except that spacing and the order of an object's members do not
    count (members sorted by their decoded names, stably, so a repeated member keeps its
    place among its namesakes); every string and number stays exactly as written.
    ``None`` past :data:`DEPTH_MAX` levels."""
    walker = _Walker(text)
    out: List[str] = []
    walker.value(out)
    return None if walker.too_deep else "".join(out)


class _Walker:
    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0
        self.depth = 0
        self.too_deep = False

    def peek(self) -> str:
        return self.text[self.at] if self.at < len(self.text) else "\0"

    def at_end(self) -> bool:
        return self.at >= len(self.text)

    def skip_space(self) -> None:
        while self.peek() in " \t\n\r" and not self.at_end():
            self.at += 1

    def value(self, out: List[str]) -> None:
        self.skip_space()
        char = self.peek()
        if char in "{[" and not self.at_end() and self.depth == DEPTH_MAX:
            self.too_deep = True
            self.at = len(self.text)
        elif char == "{":
            self.nested(out, self.object)
        elif char == "[":
            self.nested(out, self.array)
        elif char == '"':
            out.append(self.string())
        else:
            # A number, true, false or null: up to the next delimiter.
            start = self.at
            while not self.at_end() and self.peek() not in ",]} \t\n\r":
                self.at += 1
            if self.at == start:
                self.at += 1
            out.append(self.text[start : self.at])

    def nested(self, out: List[str], walk: Any) -> None:
        self.depth += 1
        walk(out)
        self.depth -= 1

    def skip_separator(self) -> None:
        self.skip_space()
        if self.peek() == ",":
            self.at += 1
        self.skip_space()

    def string(self) -> str:
        start = self.at
        self.at += 1
        while not self.at_end() and self.peek() != '"':
            self.at += 2 if self.peek() == "\\" else 1
        self.at = min(self.at + 1, len(self.text))
        return self.text[start : self.at]

    def array(self, out: List[str]) -> None:
        self.at += 1
        out.append("[")
        self.skip_space()
        first = True
        while not self.at_end() and self.peek() != "]":
            if not first:
                out.append(",")
            first = False
            self.value(out)
            self.skip_separator()
        self.at = min(self.at + 1, len(self.text))
        out.append("]")

    def object(self, out: List[str]) -> None:
        self.at += 1
        members: List[Tuple[bytes, str]] = []
        self.skip_space()
        while not self.at_end() and self.peek() != "}":
            name = self.string()
            try:
                decoded = json.loads(name)
                if not isinstance(decoded, str):
                    decoded = name
            except ValueError:
                decoded = name
            member: List[str] = [name, ":"]
            self.skip_space()
            self.at = min(self.at + 1, len(self.text))  # the colon
            self.value(member)
            members.append((decoded.encode("utf-8", "surrogatepass"), "".join(member)))
            self.skip_separator()
        self.at = min(self.at + 1, len(self.text))
        members.sort(key=lambda m: m[0])
        out.append("{")
        out.append(",".join(member for _, member in members))
        out.append("}")


# Stored answers -------------------------------------------------------------------------

_FORMAT = 1


def encode_stored(status: int, headers: Sequence[Tuple[bytes, bytes]], body: bytes) -> bytes:
    """An answer as the gate stores it: format byte 1, the status (2 bytes), the header
    count (2 bytes), each header as a 2-byte name length, the name, a 4-byte value length
    and the value, then the body; big-endian."""
    out = bytearray(struct.pack(">BHH", _FORMAT, status, len(headers)))
    for name, value in headers:
        out += struct.pack(">H", len(name)) + name + struct.pack(">I", len(value)) + value
    out += body
    return bytes(out)


def decode_stored(data: bytes) -> Optional[Answer]:
    """Stored bytes back as an answer; ``None`` for bytes in another format."""
    try:
        fmt, status, count = struct.unpack_from(">BHH", data, 0)
        if fmt != _FORMAT or not 100 <= status <= 999:
            return None
        at = 5
        headers: Headers = []
        for _ in range(count):
            (name_len,) = struct.unpack_from(">H", data, at)
            name = data[at + 2 : at + 2 + name_len]
            at += 2 + name_len
            (value_len,) = struct.unpack_from(">I", data, at)
            value = data[at + 4 : at + 4 + value_len]
            if len(name) != name_len or len(value) != value_len:
                return None
            at += 4 + value_len
            headers.append((name.lower(), value))
        return Answer(status, headers, data[at:])
    except struct.error:
        return None


# Which statuses are stored --------------------------------------------------------------


class StoredStatuses:
    """Which statuses are stored: whole classes (``2xx``), single statuses (``503``), and
    exclusions (``!409``), which win. The default stores ``2xx`` and ``4xx`` other than
    ``408``, ``409`` and ``429`` (those say "try again", which a replay would contradict)."""

    def __init__(self, entries: Sequence[str] = ("2xx", "4xx", "!408", "!409", "!429")) -> None:
        if not entries:
            raise ValueError("stored_statuses is empty: no answer would be stored, and every retry would run again")
        self.classes: List[int] = []
        self.statuses: List[int] = []
        self.excluded: List[int] = []
        for entry in entries:
            if len(entry) == 3 and entry[0] in "12345" and entry[1:] == "xx":
                self.classes.append(int(entry[0]))
            elif entry.startswith("!"):
                self.excluded.append(self._status(entry[1:], entry))
            else:
                self.statuses.append(self._status(entry, entry))

    @staticmethod
    def _status(text: str, entry: str) -> int:
        if len(text) == 3 and text[0] in "12345" and text.isdigit():
            return int(text)
        raise ValueError(f"{entry!r} is not a status (`503`), a class (`5xx`) or an exclusion (`!409`)")

    def stores(self, status: int) -> bool:
        """Whether an answer with ``status`` is stored."""
        return status not in self.excluded and (status in self.statuses or status // 100 in self.classes)


# Problems -------------------------------------------------------------------------------


def problem(
    status: int,
    title: str,
    code: str,
    detail: str,
    *,
    retry_after_s: Optional[int] = None,
) -> Answer:
    """An ``application/problem+json`` answer with oncegate's stable ``code``, as the
    proxy writes it."""
    document = {
        "type": f"https://oncegate.dev/problems/{code}",
        "title": title,
        "status": status,
        "detail": detail,
        "code": code,
    }
    body = json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    headers: Headers = [(b"content-type", b"application/problem+json")]
    if retry_after_s is not None:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    return Answer(status, headers, body)


def retry_after_s(ms: int) -> int:
    """Whole seconds to wait before retrying after ``ms`` (at least 1)."""
    return max(1, -(-ms // 1000))
