/**
 * The proxy's request payload fingerprint (crates/oncegate-proxy/src/payload.rs and
 * `Proxy::fingerprint`), so that the middleware and `oncegate proxy` agree: a JSON body
 * counts as written, except that spacing and the order of an object's members do not
 * count (members sorted by their decoded names, a stable sort; every string and number
 * exactly as written).
 */
import { canonicalValue, fingerprintCanonical, parseJson } from './fingerprint';

/** Nesting deeper than this has no canonical form here (the proxy's limit). */
const DEPTH_MAX = 128;

function compareUtf8(a: string, b: string): number {
  return Buffer.compare(Buffer.from(a, 'utf8'), Buffer.from(b, 'utf8'));
}

/** The canonical form of a valid JSON text, as written; `undefined` past the depth limit. */
export function canonicalAsWritten(json: string): string | undefined {
  const walker = new Walker(json);
  const out = walker.value();
  return walker.tooDeep ? undefined : out;
}

class Walker {
  at = 0;
  depth = 0;
  tooDeep = false;

  constructor(private readonly text: string) {}

  private peek(): string {
    return this.text[this.at] ?? '\0';
  }

  private atEnd(): boolean {
    return this.at >= this.text.length;
  }

  private skipSpace(): void {
    while (' \t\n\r'.includes(this.peek()) && !this.atEnd()) this.at += 1;
  }

  value(): string {
    this.skipSpace();
    const c = this.peek();
    if ((c === '{' || c === '[') && this.depth === DEPTH_MAX) {
      this.tooDeep = true;
      this.at = this.text.length;
      return '';
    }
    if (c === '{' || c === '[') {
      this.depth += 1;
      const out = c === '{' ? this.object() : this.array();
      this.depth -= 1;
      return out;
    }
    if (c === '"') return this.string();
    const start = this.at;
    while (!this.atEnd() && !',]} \t\n\r'.includes(this.peek())) this.at += 1;
    if (this.at === start) this.at += 1;
    return this.text.slice(start, this.at);
  }

  private skipSeparator(): void {
    this.skipSpace();
    if (this.peek() === ',') this.at += 1;
    this.skipSpace();
  }

  private string(): string {
    const start = this.at;
    this.at += 1;
    while (!this.atEnd() && this.peek() !== '"') this.at += this.peek() === '\\' ? 2 : 1;
    this.at = Math.min(this.at + 1, this.text.length);
    return this.text.slice(start, this.at);
  }

  private array(): string {
    this.at += 1;
    const items: string[] = [];
    this.skipSpace();
    while (!this.atEnd() && this.peek() !== ']') {
      items.push(this.value());
      this.skipSeparator();
    }
    this.at = Math.min(this.at + 1, this.text.length);
    return `[${items.join(',')}]`;
  }

  private object(): string {
    this.at += 1;
    const members: Array<[string, string]> = [];
    this.skipSpace();
    while (!this.atEnd() && this.peek() !== '}') {
      const name = this.string();
      let decoded: string;
      try {
        decoded = JSON.parse(name) as string;
      } catch {
        decoded = name;
      }
      this.skipSpace();
      this.at = Math.min(this.at + 1, this.text.length); // the colon
      members.push([decoded, `${name}:${this.value()}`]);
      this.skipSeparator();
    }
    this.at = Math.min(this.at + 1, this.text.length);
    members.sort((a, b) => compareUtf8(a[0], b[0]));
    return `{${members.map((m) => m[1]).join(',')}}`;
  }
}

/** The body as the fingerprint holds it: canonical JSON as written, or hex bytes. */
function bodyPart(body: Buffer): { json: string } | { bytes: string } {
  let text: string | undefined;
  try {
    text = new TextDecoder('utf-8', { fatal: true }).decode(body);
    parseJson(text);
  } catch {
    text = undefined;
  }
  const json = text === undefined ? undefined : canonicalAsWritten(text);
  return json === undefined ? { bytes: body.toString('hex') } : { json };
}

/**
 * The fingerprint of a request's payload, as `oncegate proxy` computes it: the method, the
 * path and query, the fingerprinted headers' values, and the body.
 */
export function requestFingerprint(method: string, target: string, headers: Record<string, string>, body: Buffer): Buffer {
  return fingerprintCanonical(canonicalValue({ method, target, headers, body: bodyPart(body) }));
}
