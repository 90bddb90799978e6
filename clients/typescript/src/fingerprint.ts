/**
 * Canonical JSON fingerprints (format 1), byte for byte the server's and the Rust
 * client's (`crates/oncegate-core/src/fingerprint.rs`): the same request, however its JSON
 * was written (key order, whitespace, `1.0` or `1`), gets the same fingerprint.
 *
 * The canonical text: object keys sorted by their UTF-8 bytes; no insignificant
 * whitespace; strings escaped as serde_json writes them (`"`, `\\` and the control
 * characters only); integers that fit 64 bits (signed or unsigned) as written; every other
 * number read as the nearest 64-bit float, a whole float below 2^53 written as an integer,
 * others in the shortest form that reads back exactly (decimal for 1e-5 <= |x| < 1e16,
 * else `d.ddde+XX`). A repeated key keeps its last value. The fingerprint is the byte
 * 0x01 followed by the SHA-256 of the UTF-8 canonical text (33 bytes).
 */
import { createHash } from 'node:crypto';

/** The format byte that starts every fingerprint made here. */
export const FINGERPRINT_FORMAT = 1;

/** A parsed JSON value that keeps what JavaScript numbers would lose. */
export type JsonNode =
  | { readonly kind: 'null' }
  | { readonly kind: 'bool'; readonly value: boolean }
  | { readonly kind: 'int'; readonly value: bigint }
  | { readonly kind: 'float'; readonly value: number }
  | { readonly kind: 'string'; readonly value: string }
  | { readonly kind: 'array'; readonly items: JsonNode[] }
  | { readonly kind: 'object'; readonly members: Map<string, JsonNode> };

/** Nesting deeper than this is refused, as serde_json's parser refuses it. */
export const JSON_DEPTH_MAX = 127;

const I64_MIN = -(2n ** 63n);
const U64_MAX = 2n ** 64n - 1n;
const WHOLE_FLOAT_MAX = 2 ** 53;

/** Why a JSON text could not be read. */
export class JsonSyntaxError extends SyntaxError {
  /** The offset (in UTF-16 units) where reading stopped. */
  readonly offset: number;

  constructor(message: string, offset: number) {
    super(`${message} at offset ${offset}`);
    this.name = 'JsonSyntaxError';
    this.offset = offset;
  }
}

/**
 * Parses a JSON text strictly (RFC 8259, as serde_json reads it), keeping every integer
 * that fits 64 bits exact and reading other numbers as the nearest double.
 */
export function parseJson(text: string): JsonNode {
  const parser = new Parser(text);
  parser.space();
  const value = parser.value(0);
  parser.space();
  if (parser.at < text.length) throw new JsonSyntaxError('trailing characters', parser.at);
  return value;
}

class Parser {
  at = 0;

  constructor(private readonly text: string) {}

  space(): void {
    const t = this.text;
    while (this.at < t.length) {
      const c = t.charCodeAt(this.at);
      if (c !== 0x20 && c !== 0x09 && c !== 0x0a && c !== 0x0d) break;
      this.at += 1;
    }
  }

  fail(message: string): never {
    throw new JsonSyntaxError(message, this.at);
  }

  value(depth: number): JsonNode {
    const c = this.text[this.at];
    switch (c) {
      case '{':
      case '[':
        if (depth >= JSON_DEPTH_MAX) this.fail('recursion limit exceeded');
        return c === '{' ? this.object(depth + 1) : this.array(depth + 1);
      case '"':
        return { kind: 'string', value: this.string() };
      case 't':
        return this.word('true', { kind: 'bool', value: true });
      case 'f':
        return this.word('false', { kind: 'bool', value: false });
      case 'n':
        return this.word('null', { kind: 'null' });
      default:
        if (c === '-' || (c !== undefined && c >= '0' && c <= '9')) return this.number();
        return this.fail(c === undefined ? 'EOF while parsing a value' : 'expected value');
    }
  }

  word(word: string, node: JsonNode): JsonNode {
    if (!this.text.startsWith(word, this.at)) this.fail('expected value');
    this.at += word.length;
    return node;
  }

  number(): JsonNode {
    const match = /-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/y;
    match.lastIndex = this.at;
    const found = match.exec(this.text);
    if (found === null) return this.fail('invalid number');
    this.at += found[0].length;
    const next = this.text[this.at];
    if (next !== undefined && /[0-9.eE+-]/.test(next)) this.fail('invalid number');
    if (found[1] === undefined && found[2] === undefined) {
      const integer = BigInt(found[0]);
      // serde_json reads -0 as the float -0.0, written as 0 all the same.
      if (integer >= I64_MIN && integer <= U64_MAX && found[0] !== '-0') return { kind: 'int', value: integer };
    }
    const value = Number(found[0]);
    if (!Number.isFinite(value)) this.fail('number out of range');
    return { kind: 'float', value };
  }

  string(): string {
    const t = this.text;
    this.at += 1; // the opening quote
    let out = '';
    let start = this.at;
    for (;;) {
      if (this.at >= t.length) this.fail('EOF while parsing a string');
      const c = t.charCodeAt(this.at);
      if (c === 0x22) {
        out += t.slice(start, this.at);
        this.at += 1;
        return out;
      }
      if (c < 0x20) this.fail('control character in a string');
      if (c >= 0xd800 && c <= 0xdfff) {
        // A JavaScript string may hold a lone surrogate; UTF-8 text cannot.
        const low = t.charCodeAt(this.at + 1);
        if (c > 0xdbff || !(low >= 0xdc00 && low <= 0xdfff)) this.fail('lone surrogate');
        this.at += 2;
        continue;
      }
      if (c !== 0x5c) {
        this.at += 1;
        continue;
      }
      out += t.slice(start, this.at);
      this.at += 1;
      out += this.escape();
      start = this.at;
    }
  }

  escape(): string {
    const c = this.text[this.at];
    this.at += 1;
    switch (c) {
      case '"':
        return '"';
      case '\\':
        return '\\';
      case '/':
        return '/';
      case 'b':
        return '\b';
      case 'f':
        return '\f';
      case 'n':
        return '\n';
      case 'r':
        return '\r';
      case 't':
        return '\t';
      case 'u': {
        const unit = this.hex4();
        if (unit >= 0xdc00 && unit <= 0xdfff) this.fail('lone trailing surrogate in a hex escape');
        if (unit < 0xd800 || unit > 0xdbff) return String.fromCharCode(unit);
        if (this.text.slice(this.at, this.at + 2) !== '\\u') this.fail('lone leading surrogate in a hex escape');
        this.at += 2;
        const low = this.hex4();
        if (low < 0xdc00 || low > 0xdfff) this.fail('lone leading surrogate in a hex escape');
        return String.fromCharCode(unit, low);
      }
      default:
        return this.fail('invalid escape');
    }
  }

  hex4(): number {
    const digits = this.text.slice(this.at, this.at + 4);
    if (!/^[0-9a-fA-F]{4}$/.test(digits)) this.fail('invalid \\u escape');
    this.at += 4;
    return parseInt(digits, 16);
  }

  array(depth: number): JsonNode {
    this.at += 1;
    const items: JsonNode[] = [];
    this.space();
    if (this.text[this.at] === ']') {
      this.at += 1;
      return { kind: 'array', items };
    }
    for (;;) {
      this.space();
      items.push(this.value(depth));
      this.space();
      const c = this.text[this.at];
      this.at += 1;
      if (c === ']') return { kind: 'array', items };
      if (c !== ',') {
        this.at -= 1;
        this.fail('expected `,` or `]`');
      }
    }
  }

  object(depth: number): JsonNode {
    this.at += 1;
    const members = new Map<string, JsonNode>();
    this.space();
    if (this.text[this.at] === '}') {
      this.at += 1;
      return { kind: 'object', members };
    }
    for (;;) {
      this.space();
      if (this.text[this.at] !== '"') this.fail('key must be a string');
      const name = this.string();
      this.space();
      if (this.text[this.at] !== ':') this.fail('expected `:`');
      this.at += 1;
      this.space();
      // A repeated key keeps its last value (Map.set replaces it).
      members.set(name, this.value(depth));
      this.space();
      const c = this.text[this.at];
      this.at += 1;
      if (c === '}') return { kind: 'object', members };
      if (c !== ',') {
        this.at -= 1;
        this.fail('expected `,` or `}`');
      }
    }
  }
}

/** A JSON string literal as serde_json writes it. */
export function quoteJsonString(value: string): string {
  let out = '"';
  let start = 0;
  for (let i = 0; i < value.length; i += 1) {
    const c = value.charCodeAt(i);
    let escaped: string | undefined;
    if (c === 0x22) escaped = '\\"';
    else if (c === 0x5c) escaped = '\\\\';
    else if (c < 0x20) {
      escaped =
        c === 0x08 ? '\\b'
        : c === 0x09 ? '\\t'
        : c === 0x0a ? '\\n'
        : c === 0x0c ? '\\f'
        : c === 0x0d ? '\\r'
        : `\\u00${c.toString(16).padStart(2, '0')}`;
    }
    if (escaped !== undefined) {
      out += value.slice(start, i) + escaped;
      start = i + 1;
    }
  }
  return `${out}${value.slice(start)}"`;
}

/** A finite double in the canonical form (see the module's documentation). */
export function formatFloat(x: number): string {
  if (!Number.isFinite(x)) throw new TypeError(`${x} has no JSON form`);
  if (x === 0) return '0';
  if (Number.isInteger(x) && Math.abs(x) < WHOLE_FLOAT_MAX) return String(x);
  // The shortest digits that read back as x (ECMAScript's Number::toString picks them).
  const [mantissa, exponent] = String(Math.abs(x)).split('e') as [string, string | undefined];
  const [whole, fraction = ''] = mantissa.split('.') as [string, string | undefined];
  let digits = whole + fraction;
  let point = whole.length + (exponent === undefined ? 0 : Number(exponent));
  while (digits.startsWith('0')) {
    digits = digits.slice(1);
    point -= 1;
  }
  digits = digits.replace(/0+$/, '');
  const e = point - 1; // x = d.ddd * 10^e
  const sign = x < 0 ? '-' : '';
  if (e >= -5 && e < 16) {
    if (e < 0) return `${sign}0.${'0'.repeat(-e - 1)}${digits}`;
    if (digits.length <= e + 1) return `${sign}${digits}${'0'.repeat(e + 1 - digits.length)}.0`;
    return `${sign}${digits.slice(0, e + 1)}.${digits.slice(e + 1)}`;
  }
  const tail = digits.length > 1 ? `.${digits.slice(1)}` : '';
  return `${sign}${digits[0]}${tail}e${e < 0 ? '-' : '+'}${Math.abs(e)}`;
}

function compareUtf8(a: string, b: string): number {
  return Buffer.compare(Buffer.from(a, 'utf8'), Buffer.from(b, 'utf8'));
}

/** The canonical text of a parsed JSON value. */
export function canonicalNode(node: JsonNode): string {
  switch (node.kind) {
    case 'null':
      return 'null';
    case 'bool':
      return node.value ? 'true' : 'false';
    case 'int':
      return node.value.toString();
    case 'float':
      return formatFloat(node.value);
    case 'string':
      return quoteJsonString(node.value);
    case 'array':
      return `[${node.items.map(canonicalNode).join(',')}]`;
    case 'object': {
      const names = [...node.members.keys()].sort(compareUtf8);
      const parts = names.map((name) => `${quoteJsonString(name)}:${canonicalNode(node.members.get(name) as JsonNode)}`);
      return `{${parts.join(',')}}`;
    }
  }
}

/** Throws for a string UTF-8 cannot carry (a lone surrogate). */
function wellFormed(value: string): string {
  if (/[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/.test(value)) {
    throw new TypeError('a string holds a lone surrogate, which JSON text in UTF-8 cannot carry');
  }
  return value;
}

/**
 * A JavaScript value as a JSON node, as `JSON.stringify` would see it: `toJSON` is called;
 * `undefined`, functions and symbols are left out of objects and are `null` in arrays.
 * Numbers are doubles (a whole one below 2^53 is an integer; use a `bigint` for larger
 * integers, which are exact within 64 bits). Non-finite numbers, `Map`, `Set` and cycles
 * are refused with a `TypeError` (JSON.stringify would lose them silently).
 */
export function nodeOfValue(value: unknown): JsonNode {
  const node = toNode(value, new Set(), '');
  if (node === undefined) throw new TypeError(`${typeof value} has no JSON form`);
  return node;
}

function toNode(input: unknown, seen: Set<object>, key: string): JsonNode | undefined {
  let value = input;
  if (value !== null && (typeof value === 'object' || typeof value === 'bigint')) {
    const toJSON = (value as { toJSON?: unknown }).toJSON;
    if (typeof toJSON === 'function') value = (toJSON as (key: string) => unknown).call(value, key);
  }
  switch (typeof value) {
    case 'undefined':
    case 'function':
    case 'symbol':
      return undefined;
    case 'boolean':
      return { kind: 'bool', value };
    case 'string':
      return { kind: 'string', value: wellFormed(value) };
    case 'number':
      if (!Number.isFinite(value)) throw new TypeError(`${value} has no JSON form`);
      return { kind: 'float', value };
    case 'bigint':
      return value >= I64_MIN && value <= U64_MAX ? { kind: 'int', value } : { kind: 'float', value: Number(value) };
    case 'object':
      break;
  }
  if (value === null) return { kind: 'null' };
  const object = value as object;
  if (object instanceof Map || object instanceof Set) {
    throw new TypeError('a Map or Set has no JSON form; convert it to an object or an array');
  }
  if (object instanceof Number || object instanceof String || object instanceof Boolean) {
    return toNode(object.valueOf(), seen, key);
  }
  if (seen.has(object)) throw new TypeError('a cyclic value has no JSON form');
  seen.add(object);
  try {
    if (Array.isArray(object)) {
      return { kind: 'array', items: object.map((item, i) => toNode(item, seen, String(i)) ?? { kind: 'null' }) };
    }
    const members = new Map<string, JsonNode>();
    for (const name of Object.keys(object)) {
      const node = toNode((object as Record<string, unknown>)[name], seen, name);
      if (node !== undefined) members.set(wellFormed(name), node);
    }
    return { kind: 'object', members };
  } finally {
    seen.delete(object);
  }
}

/** The canonical text of a JSON document given as text (big integers keep their digits). */
export function canonicalJson(text: string): string {
  return canonicalNode(parseJson(text));
}

/** The canonical text of a JavaScript value (see {@link nodeOfValue} for the mapping). */
export function canonicalValue(value: unknown): string {
  return canonicalNode(nodeOfValue(value));
}

/** The fingerprint of a canonical text: 0x01, then its SHA-256 (33 bytes). */
export function fingerprintCanonical(canonical: string): Buffer {
  const digest = createHash('sha256').update(canonical, 'utf8').digest();
  return Buffer.concat([Buffer.of(FINGERPRINT_FORMAT), digest]);
}

/**
 * The canonical fingerprint of a JSON document given as TEXT. The text is parsed here, not
 * by `JSON.parse`, so integers beyond 2^53 (up to 64 bits) keep their digits as the server
 * keeps them. Throws {@link JsonSyntaxError} for text that is not JSON.
 */
export function fingerprintJson(text: string | Uint8Array): Buffer {
  const source = typeof text === 'string' ? text : new TextDecoder('utf-8', { fatal: true }).decode(text);
  return fingerprintCanonical(canonicalJson(source));
}

/**
 * The canonical fingerprint of a JavaScript value, as if it were serialized with
 * `JSON.stringify` and fingerprinted with {@link fingerprintJson}, except that a `bigint`
 * within 64 bits is an exact integer (see {@link nodeOfValue}).
 */
export function fingerprintValue(value: unknown): Buffer {
  return fingerprintCanonical(canonicalValue(value));
}
