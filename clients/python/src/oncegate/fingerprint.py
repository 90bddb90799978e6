"""Canonical fingerprints of JSON payloads (format 1, ``oncegate_core::fingerprint``).

The same request, however its JSON was written (key order, whitespace, ``1.0`` or ``1``),
gets the same fingerprint, so a retry is recognised and a different payload under the
same key is a mismatch. A fingerprint is the byte ``0x01`` and the SHA-256 of the UTF-8
canonical text (33 bytes).

The canonical text: objects with their keys sorted by their UTF-8 bytes, no whitespace,
strings escaped as serde_json does (``\\"``, ``\\\\``, ``\\b \\f \\n \\r \\t``, other control
characters as ``\\u00XX``; everything else, DEL and non-ASCII included, as itself),
integers that fit a signed or unsigned 64-bit integer as written, every other number
(a fraction, an exponent, an integer outside 64 bits) read as the nearest 64-bit float: a
whole float below 2**53 in magnitude is written as that integer (``-0.0`` is ``0``), other
floats as their shortest round-trip digits, in decimal notation when
``1e-5 <= |x| < 1e16`` (``9007199254740992.0``) and in scientific notation otherwise
(``1e+21``, ``9.9e-6``). A repeated object key keeps its last value.

:func:`fingerprint_json_text` reads JSON text losslessly (Python's parser keeps every
integer exactly). :func:`fingerprint_json` takes a native value, mapped as follows:

========================  ==========================================================
Python                    JSON
========================  ==========================================================
``dict`` (``str`` keys)   object
``list``, ``tuple``       array
``str``                   string
``bool``                  ``true`` / ``false``
``None``                  ``null``
``int``                   integer within 64 bits (-2**63 .. 2**64-1), else the
                          nearest float, as the text would be read
``float``                 float (NaN and infinities are refused)
``decimal.Decimal``       read as the JSON number text ``str(value)`` would be
========================  ==========================================================

Anything else raises ``TypeError``.
"""

from __future__ import annotations

import decimal
import hashlib
import json
import math
import re
from typing import Any, Union

__all__ = ["FINGERPRINT_FORMAT", "canonical_json", "canonical_json_text", "fingerprint_json", "fingerprint_json_text"]

#: The format byte that starts every fingerprint made here.
FINGERPRINT_FORMAT = 1

_I64_MIN = -(1 << 63)
_U64_MAX = (1 << 64) - 1
_WHOLE_FLOAT_MAX = float(1 << 53)



def fingerprint_json(value: Any) -> bytes:
    """The canonical fingerprint (33 bytes) of a native value as JSON (see the module's
    table for how Python values map)."""
    return _fingerprint(canonical_json(value))


def fingerprint_json_text(text: Union[str, bytes]) -> bytes:
    """The canonical fingerprint (33 bytes) of a JSON document given as text."""
    return _fingerprint(canonical_json_text(text))


def canonical_json(value: Any) -> str:
    """The canonical text (format 1) of a native value."""
    out: list[str] = []
    _write(value, out)
    text = "".join(out)
    _check_encodable(text)
    return text


def canonical_json_text(text: Union[str, bytes]) -> str:
    """The canonical text (format 1) of a JSON document given as text."""
    return canonical_json(loads_strict(text))


def loads_strict(text: Union[str, bytes]) -> Any:
    """Parses JSON as the gate's parser does: integers within 64 bits stay integers, every
    other number becomes the nearest float; ``NaN``, ``Infinity`` and numbers out of a
    float's range are refused (``ValueError``); so are strings that are not valid
    Unicode (a lone surrogate escape), when the value is written out."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    return json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_refuse_constant)


def _fingerprint(text: str) -> bytes:
    return bytes([FINGERPRINT_FORMAT]) + hashlib.sha256(text.encode("utf-8")).digest()


def _parse_int(text: str) -> Union[int, float]:
    number = int(text)
    if _I64_MIN <= number <= _U64_MAX:
        return number
    return _parse_float(text)


def _parse_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"the number {text} is out of a 64-bit float's range")
    return number


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _check_encodable(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"a string is not valid Unicode (a lone surrogate?): {error}") from None


def _write(value: Any, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, str):
        out.append(_string(value))
    elif isinstance(value, int):
        out.append(str(value) if _I64_MIN <= value <= _U64_MAX else float_text(_int_to_float(value)))
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value} is not a JSON number")
        out.append(float_text(value))
    elif isinstance(value, decimal.Decimal):
        if not value.is_finite():
            raise ValueError(f"{value} is not a JSON number")
        _write(loads_strict(str(value)), out)
    elif isinstance(value, dict):
        items = []
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"an object key must be a str, not {type(key).__name__}")
            items.append((key.encode("utf-8", "surrogatepass"), key, item))
        items.sort(key=lambda entry: entry[0])
        out.append("{")
        for i, (_, key, item) in enumerate(items):
            if i:
                out.append(",")
            out.append(_string(key))
            out.append(":")
            _write(item, out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _write(item, out)
        out.append("]")
    else:
        raise TypeError(f"{type(value).__name__} has no canonical JSON form")


def _int_to_float(value: int) -> float:
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"the integer {value} is out of a 64-bit float's range") from None


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_NEEDS_ESCAPE = re.compile('["\\\\\x00-\x1f]')


def _escape(match: re.Match[str]) -> str:
    char = match.group(0)
    return _ESCAPES.get(char) or f"\\u{ord(char):04x}"


def _string(text: str) -> str:
    """A string as serde_json writes it."""
    return '"' + _NEEDS_ESCAPE.sub(_escape, text) + '"'


def float_text(x: float) -> str:
    """A float in the canonical form (see the module's documentation)."""
    if x == 0:
        return "0"
    if x.is_integer() and abs(x) < _WHOLE_FLOAT_MAX:
        return str(int(x))
    sign = "-" if x < 0 else ""
    # repr gives the shortest digits that read back exactly; only its notation changes.
    mantissa, _, exponent = repr(abs(x)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = whole + fraction
    point = len(whole) + (int(exponent) if exponent else 0)  # digits before the point
    stripped = digits.lstrip("0")
    point -= len(digits) - len(stripped)
    digits = stripped.rstrip("0") or "0"
    if 1e-5 <= abs(x) < 1e16:
        if point <= 0:
            text = "0." + "0" * -point + digits
        elif point >= len(digits):
            text = digits + "0" * (point - len(digits)) + ".0"
        else:
            text = digits[:point] + "." + digits[point:]
    else:
        power = point - 1
        text = digits[0] + ("." + digits[1:] if len(digits) > 1 else "") + ("e+" if power >= 0 else "e-") + str(abs(power))
    return sign + text
