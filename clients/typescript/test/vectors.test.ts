/** The shared test vectors (clients/vectors.json), byte for byte, and the offline helpers. */
import { test } from 'node:test';
import * as assert from 'node:assert/strict';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { canonicalJson, canonicalValue, fingerprintJson, fingerprintValue, TradeKey, derivedKey, JsonSyntaxError } from '../src/index';
import { canonicalAsWritten, decodeStored, encodeStored, omittedAnswer } from '../src/express';
import { PACKAGE_ROOT } from './helpers';

interface FingerprintVector {
  name: string;
  json: string;
  canonical: string;
  fingerprint_hex: string;
}

interface TradeKeyVector {
  name: string;
  exchange: string;
  symbol: string;
  action: string;
  qty: string;
  live: boolean;
  bucket_ms: number;
  bucket_grace_ms: number;
  now_ms: number;
  key_parts: string[];
  base: string;
  bucket_key: string;
}

interface NotWholeVector {
  status: number;
  headers: Array<[string, string]>;
  reason: string;
  stored_bytes_max: number;
  stored_hex: string;
}

const vectors = JSON.parse(fs.readFileSync(path.join(PACKAGE_ROOT, '..', 'vectors.json'), 'utf8')) as {
  fingerprints: FingerprintVector[];
  trade_keys: TradeKeyVector[];
  answers_not_stored_whole: NotWholeVector[];
};

for (const vector of vectors.answers_not_stored_whole) {
  test(`an answer not stored whole: ${vector.reason}`, () => {
    // The proxy and both middlewares store the same bytes, so each replays the others'.
    const answer = { status: vector.status, headers: vector.headers, body: Buffer.from('the body') };
    assert.equal(omittedAnswer(answer, vector.reason, vector.stored_bytes_max).toString('hex'), vector.stored_hex);
  });
}

test('the vectors file has cases', () => {
  assert.ok(vectors.fingerprints.length >= 20);
  assert.ok(vectors.trade_keys.length >= 3);
});

for (const vector of vectors.fingerprints) {
  test(`fingerprint vector: ${vector.name}`, () => {
    assert.equal(canonicalJson(vector.json), vector.canonical);
    const fingerprint = fingerprintJson(vector.json);
    assert.equal(fingerprint.length, 33);
    assert.equal(fingerprint.toString('hex'), vector.fingerprint_hex);
    assert.equal(fingerprintJson(Buffer.from(vector.json, 'utf8')).toString('hex'), vector.fingerprint_hex);
  });
}

for (const vector of vectors.trade_keys) {
  test(`trade key vector: ${vector.name}`, () => {
    const key = new TradeKey({
      exchange: vector.exchange,
      symbol: vector.symbol,
      action: vector.action,
      qty: vector.qty,
      live: vector.live,
      bucketMs: vector.bucket_ms,
      bucketGraceMs: vector.bucket_grace_ms,
    });
    assert.deepEqual(key.keyParts, vector.key_parts);
    assert.equal(key.base, vector.base);
    assert.equal(key.bucketKey(vector.now_ms), vector.bucket_key);
    assert.equal(derivedKey(vector.key_parts, vector.bucket_ms, BigInt(vector.now_ms)), vector.bucket_key);
    assert.equal(key.bucketGraceMs, vector.bucket_grace_ms);
  });
}

test('a native value fingerprints as its JSON text does', () => {
  const order = { symbol: 'BTCUSDT', qty: 1.0, side: 'buy', tags: ['a', { y: 2, x: 1 }], big: 18446744073709551615n, none: undefined };
  const text = '{"tags":["a",{"x":1,"y":2}],"side":"buy","qty":1,"symbol":"BTCUSDT","big":18446744073709551615}';
  assert.equal(canonicalValue(order), canonicalJson(text));
  assert.deepEqual(fingerprintValue(order), fingerprintJson(text));
  // JSON.parse would round the integer; the text keeps it.
  assert.equal(canonicalJson('[18446744073709551615]'), '[18446744073709551615]');
  assert.equal(canonicalValue([0.1, -0, 1e21, 2 ** 53]), '[0.1,0,1e+21,9007199254740992.0]');
  assert.throws(() => fingerprintValue(new Map()), TypeError);
  assert.throws(() => fingerprintValue([Number.NaN]), TypeError);
  assert.throws(() => fingerprintValue('\ud800'), TypeError);
});

test('text that is not JSON is refused', () => {
  for (const bad of ['', '{', '[1,]', '{"a" 1}', '01', '1.', '"\\ud800"', '"a\nb"', '[1] x', 'nul', '1e400']) {
    assert.throws(() => fingerprintJson(bad), JsonSyntaxError, bad);
  }
  assert.throws(() => fingerprintJson(Buffer.from([0x22, 0xff, 0x22])), TypeError);
});

test('the proxy payload form keeps scalars as written and sorts members', () => {
  assert.equal(canonicalAsWritten(' { "b" : -1.50e3 ,\n"a": [ "x\\"y" , true, null, {} , [] ] } '), '{"a":["x\\"y",true,null,{},[]],"b":-1.50e3}');
  assert.notEqual(canonicalAsWritten('{"q":1,"q":2}'), canonicalAsWritten('{"q":2,"q":1}'));
  assert.equal(canonicalAsWritten('{"b":1,"\\u0061":2}'), '{"\\u0061":2,"b":1}');
  assert.equal(canonicalAsWritten(`${'['.repeat(200)}${']'.repeat(200)}`), undefined);
});

test('a stored answer reads back byte for byte', () => {
  const stored = {
    status: 201,
    headers: [['content-type', 'application/json'], ['location', '/orders/77']] as Array<[string, string]>,
    body: Buffer.from('{"order":"A-77"}\u0000\u00ff', 'latin1'),
  };
  assert.deepEqual(decodeStored(encodeStored(stored)), stored);
  assert.equal(decodeStored(encodeStored(stored).subarray(0, 5)), undefined);
  assert.equal(decodeStored(Buffer.from('\u0002rest')), undefined);
});
