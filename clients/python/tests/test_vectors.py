"""Every case of clients/vectors.json, byte for byte."""

from __future__ import annotations

import decimal
import json
from typing import Any, Dict, List

import pytest

from conftest import VECTORS
from oncegate import TradeKey, canonical_json, canonical_json_text, fingerprint_json, fingerprint_json_text
from oncegate.asgi import _omitted
from oncegate.fingerprint import loads_strict

DATA = json.loads(VECTORS.read_text(encoding="utf-8"))
FINGERPRINTS: List[Dict[str, Any]] = DATA["fingerprints"]
TRADE_KEYS: List[Dict[str, Any]] = DATA["trade_keys"]
NOT_WHOLE: List[Dict[str, Any]] = DATA["answers_not_stored_whole"]


def test_the_vectors_file_has_cases() -> None:
    assert len(FINGERPRINTS) >= 20 and len(TRADE_KEYS) >= 3


@pytest.mark.parametrize("case", FINGERPRINTS, ids=[c["name"] for c in FINGERPRINTS])
def test_fingerprint_vector(case: Dict[str, Any]) -> None:
    assert canonical_json_text(case["json"]) == case["canonical"]
    assert fingerprint_json_text(case["json"]).hex() == case["fingerprint_hex"]
    assert fingerprint_json_text(case["json"].encode("utf-8")).hex() == case["fingerprint_hex"]
    # The native value the text parses to has the same fingerprint.
    assert fingerprint_json(loads_strict(case["json"])).hex() == case["fingerprint_hex"]


@pytest.mark.parametrize("case", TRADE_KEYS, ids=[c["name"] for c in TRADE_KEYS])
def test_trade_key_vector(case: Dict[str, Any]) -> None:
    key = TradeKey(
        exchange=case["exchange"],
        symbol=case["symbol"],
        action=case["action"],
        qty=case["qty"],
        live=case["live"],
        bucket_ms=case["bucket_ms"],
        bucket_grace_ms=case["bucket_grace_ms"],
    )
    assert key.key_parts == case["key_parts"]
    assert key.base == case["base"]
    assert key.bucket_key(case["now_ms"]) == case["bucket_key"]


def test_native_values_map_as_documented() -> None:
    assert canonical_json({"b": 1.0, "a": [True, None, -0.0, (1, 2)]}) == '{"a":[true,null,0,[1,2]],"b":1}'
    assert canonical_json(2**64 - 1) == "18446744073709551615"
    assert canonical_json(2**64) == "1.8446744073709552e+19"
    assert canonical_json(decimal.Decimal("1.50")) == "1.5"
    assert canonical_json("\x7f\x01") == '"\x7f\\u0001"'
    with pytest.raises(ValueError):
        canonical_json(float("nan"))
    with pytest.raises(TypeError):
        canonical_json({1: 2})
    with pytest.raises(TypeError):
        canonical_json({1, 2})


def test_text_that_is_not_strict_json_is_refused() -> None:
    for text in ["NaN", "[Infinity]", "1e400", '"\\ud800"', "{"]:
        with pytest.raises(ValueError):
            fingerprint_json_text(text)


def test_a_fingerprint_is_the_format_byte_and_a_sha256() -> None:
    fingerprint = fingerprint_json({"qty": 1})
    assert len(fingerprint) == 33 and fingerprint[0] == 1


@pytest.mark.parametrize("case", NOT_WHOLE, ids=[c["reason"] for c in NOT_WHOLE])
def test_what_is_stored_for_an_answer_not_stored_whole(case: Dict[str, Any]) -> None:
    """The proxy and both middlewares store the same bytes, so each replays the others'."""
    headers = [(n.encode(), v.encode()) for n, v in case["headers"]]
    stored = _omitted(case["status"], headers, case["reason"], case["stored_bytes_max"])
    assert stored.hex() == case["stored_hex"]
