/**
 * Idempotency-Key middleware for Express (4 or 5), with the rules of `oncegate proxy`
 * (docs/proxy.md): a guarded request (POST and PATCH by default) carrying an
 * `Idempotency-Key` runs its handler at most once; retries get the stored answer (status,
 * `Content-Type` and `Location`, the body byte for byte) with `Idempotent-Replayed: true`;
 * the same key while the first is in flight waits, then gets `409`; the same key with
 * another payload gets `422`; a `5xx` (or `408`, `409`, `429`) is passed on and releases
 * the key. An answer to store that cannot be stored whole (over `storedBytesMax`, past
 * the capture, or encoded) goes whole to its caller with a `Warning`, and is stored
 * without its body: a retry gets the status and stored headers, an empty body and a
 * `Warning`, and never runs the handler again. Errors are `application/problem+json`
 * with oncegate's stable `code`.
 *
 * The middleware reads the request body itself (the fingerprint covers all of it), so
 * mount it BEFORE body parsers: it sets `req.body` (parsed JSON for a JSON content type,
 * text for `text/*`, else the bytes; see {@link IdempotencyOptions.parseBody}) and
 * `req.rawBody`, and body parsers mounted after it then skip the request. Mounted after a
 * parser, it fingerprints `req.rawBody` when the parser saved it ({@link saveRawBody});
 * else the parsed body re-serialized, but only when the parser says it read the body
 * (`req._body`, body-parser 1.x); a body the parser skipped (another content type) is read
 * here; a body consumed with nothing kept to fingerprint is answered with a `500` problem
 * naming the fix, never guessed.
 *
 * The handler's answer is captured (up to the larger of `bodyBytesMax` and
 * `storedBytesMax`; past it, passed on as it comes and stored without its body). The
 * request's `Accept-Encoding` is removed before the handler runs, so that a stored answer
 * is never compressed; an answer that carries a `Content-Encoding` all the same is
 * passed on and stored without its body. A problem sent after the
 * handler ran (a `504`, a lost lease) drops every header the handler set; if its headers
 * were already sent, the connection is closed instead.
 */
import type { IncomingMessage, OutgoingHttpHeaders, ServerResponse } from 'node:http';
import { createHash } from 'node:crypto';
import type { Client } from './client';
import { GateError, OnceError, RetryableError, UnknownError } from './errors';
import { canonicalValue } from './fingerprint';
import { once } from './once';
import type { Lease } from './once';
import { requestFingerprint } from './payload';
import { decodeStored, encodeStored } from './stored';
import type { StoredAnswer } from './stored';

export { encodeStored, decodeStored } from './stored';
export type { StoredAnswer } from './stored';
export { requestFingerprint, canonicalAsWritten } from './payload';

/** How the middleware guards and stores (defaults: `oncegate proxy`'s). */
export interface IdempotencyOptions {
  /** The gate. */
  client: Client;
  /** The gate namespace of the keys; default `proxy`. Give each service its own when several share a gate. */
  namespace?: string;
  /** Methods whose requests are guarded; default POST and PATCH. */
  guardedMethods?: string[];
  /** The header carrying the key; default `Idempotency-Key`. */
  keyHeader?: string;
  /** Path prefixes whose guarded requests must carry a key (`400` without one). */
  keyRequiredPrefixes?: string[];
  /** A header naming the caller's tenant (then required); unset, callers are told apart by a hash of `callerHeaders`. */
  tenantHeader?: string;
  /** The headers that tell callers apart; default `Authorization`. */
  callerHeaders?: string[];
  /** Whether a guarded request carrying none of `callerHeaders` is served, sharing one key space with all such callers (else `400`). */
  anonymousCallersShareKeys?: boolean;
  /** The longest key, in bytes; default 255. */
  keyBytesMax?: number;
  /** The most bytes of request headers a guarded request may carry; default 16 KiB. */
  headersBytesMax?: number;
  /** The largest request body; default 1 MiB. The handler's answer is captured up to the larger of this and `storedBytesMax` (past it: passed on as it comes, and stored without its body). */
  bodyBytesMax?: number;
  /** How long a guarded request's body may take to arrive (`408` past it); default 10 s. */
  bodyReadTimeoutMs?: number;
  /** The largest answer stored whole (format bytes included); default 60 KiB, at least 256. A larger one goes whole to its caller with a `Warning`, and its key is completed without its body: a retry gets the status and stored headers, an empty body and a `Warning`, and never runs the handler again. */
  storedBytesMax?: number;
  /** How long a retry waits for the first request's answer before `409`; default 5 s. */
  waitMs?: number;
  /**
   * How long the handler may take (the lease is this plus 5 s, renewed meanwhile); past it
   * `504`, the key held until its lease ends. Default 25 s. The lease must fit within the
   * gate's `lease_ms_max` (1 h by default), which the middleware cannot see: a gate that
   * refuses the lease makes every guarded request a `500` problem saying so.
   */
  handlerTimeoutMs?: number;
  /** How long an answer is kept for replays; default 24 h. */
  ttlMs?: number;
  /** Request headers that are part of the payload; default `Content-Type`. */
  fingerprintHeaders?: string[];
  /** Response headers stored and replayed; default `Content-Type` and `Location` (never `Set-Cookie`, `Content-Length` or hop-by-hop ones). */
  storedHeaders?: string[];
  /** Which statuses are stored: classes (`2xx`), statuses (`503`) and exclusions (`!409`); default `2xx`, `4xx`, `!408`, `!409`, `!429`. */
  storedStatuses?: string[];
  /** A `2xx` whose JSON body has this value at this JSON pointer failed: released like a `5xx`. */
  softFailure?: { pointer: string; equals: unknown };
  /** Where the key policy is published: sent on every guarded answer as `Link: <URL>; rel="describedby"`. */
  keyPolicyUrl?: string;
  /** Turns the body read here into `req.body`; default: JSON for JSON types, text for `text/*`, else the bytes. */
  parseBody?: (raw: Buffer, req: IncomingMessage) => unknown;
}

/** A request as the middleware sees it (Express's, or plain Node's). */
export interface GuardedRequest extends IncomingMessage {
  originalUrl?: string;
  body?: unknown;
  rawBody?: Buffer;
  /** The lease the handler runs under (set on guarded requests that run). */
  oncegate?: Lease;
  _body?: boolean;
}

/** The next function of a middleware. */
export type Next = (error?: unknown) => void;

const NEVER_STORED = new Set([
  'set-cookie',
  'content-length',
  'connection',
  'keep-alive',
  'proxy-connection',
  'proxy-authenticate',
  'proxy-authorization',
  'te',
  'trailer',
  'transfer-encoding',
  'upgrade',
]);
const ATTEMPT_HEADERS = ['oncegate-token', 'oncegate-attempt', 'oncegate-previous'];
const LEASE_MARGIN_MS = 5_000;

/**
 * A `verify` function for `express.json()`/`express.raw()` mounted BEFORE the middleware:
 * it keeps the bytes as `req.rawBody`, so the fingerprint covers the body as written.
 */
export function saveRawBody(req: IncomingMessage, _res: ServerResponse, buf: Buffer): void {
  (req as GuardedRequest).rawBody = Buffer.from(buf);
}

/** Which statuses are stored (see {@link IdempotencyOptions.storedStatuses}). */
export class StoredStatuses {
  private readonly classes: number[] = [];
  private readonly statuses: number[] = [];
  private readonly excluded: number[] = [];

  constructor(entries: readonly string[]) {
    if (entries.length === 0) throw new TypeError('storedStatuses is empty: no answer would be stored');
    for (const entry of entries) {
      if (/^[1-5]xx$/.test(entry)) this.classes.push(Number(entry[0]));
      else if (/^![1-5][0-9][0-9]$/.test(entry)) this.excluded.push(Number(entry.slice(1)));
      else if (/^[1-5][0-9][0-9]$/.test(entry)) this.statuses.push(Number(entry));
      else throw new TypeError(`${JSON.stringify(entry)} is not a status (503), a class (5xx) or an exclusion (!409)`);
    }
  }

  /** Whether an answer with `status` is stored. */
  stores(status: number): boolean {
    return !this.excluded.includes(status) && (this.statuses.includes(status) || this.classes.includes(Math.floor(status / 100)));
  }
}

/** An RFC 9457 problem, as the proxy sends it. */
interface Problem {
  status: number;
  title: string;
  code: string;
  detail: string;
  retryAfterS?: number;
}

/** What the handler answered, captured; `passed` when it outgrew the capture and went to the caller as it came. */
interface Captured {
  status: number;
  body: Buffer;
  passed: boolean;
}

/** The handler's answer, not stored (a status not stored, or a soft failure): passed on, and the key released. */
class Unstored extends RetryableError {
  constructor() {
    super('the answer is not stored');
  }
}

class OutcomeUnknown extends UnknownError {
  constructor(readonly problem: Problem) {
    super(problem.detail);
  }
}

function visibleAscii(value: string): boolean {
  return /^[\t\x20-\x7e]*$/.test(value);
}

function sha256Hex16(parts: Buffer[]): string {
  const hash = createHash('sha256');
  for (const part of parts) hash.update(part);
  return hash.digest('hex').slice(0, 16);
}

function headerValues(req: IncomingMessage, name: string): string[] {
  return req.headersDistinct[name.toLowerCase()] ?? [];
}

/** Removes a request header from every view Node gives of it (`headers`, `headersDistinct`, `rawHeaders`). */
function dropHeader(req: IncomingMessage, name: string): void {
  delete req.headers[name];
  delete req.headersDistinct[name];
  const raw = req.rawHeaders;
  for (let i = raw.length - 2; i >= 0; i -= 2) {
    if (raw[i]?.toLowerCase() === name) raw.splice(i, 2);
  }
}

/** A JSON pointer's value (RFC 6901), or `undefined`. */
function pointerGet(value: unknown, pointer: string): unknown {
  if (pointer === '') return value;
  if (!pointer.startsWith('/')) return undefined;
  let at: unknown = value;
  for (const raw of pointer.slice(1).split('/')) {
    const token = raw.replace(/~1/g, '/').replace(/~0/g, '~');
    if (Array.isArray(at) && /^(0|[1-9][0-9]*)$/.test(token)) at = at[Number(token)];
    else if (at !== null && typeof at === 'object' && !Array.isArray(at) && Object.hasOwn(at, token)) at = (at as Record<string, unknown>)[token];
    else return undefined;
  }
  return at;
}

function defaultParse(raw: Buffer, req: IncomingMessage): unknown {
  const type = (req.headers['content-type'] ?? '').split(';')[0]?.trim().toLowerCase() ?? '';
  if (type === 'application/json' || type.endsWith('+json')) {
    try {
      return raw.length === 0 ? undefined : JSON.parse(raw.toString('utf8'));
    } catch {
      return raw;
    }
  }
  if (type.startsWith('text/')) return raw.toString('utf8');
  return raw;
}

/** Reads the whole body, within a size and a time limit. */
function readBody(req: IncomingMessage, limit: number, timeoutMs: number): Promise<Buffer | 'too_large' | 'too_slow'> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let size = 0;
    const declared = Number(req.headers['content-length']);
    if (Number.isFinite(declared) && declared > limit) {
      resolve('too_large');
      return;
    }
    const done = (result: Buffer | 'too_large' | 'too_slow'): void => {
      clearTimeout(timer);
      req.off('data', onData);
      req.off('end', onEnd);
      req.off('error', onError);
      if (result !== 'too_large' && result !== 'too_slow') resolve(result);
      else {
        req.resume();
        resolve(result);
      }
    };
    const onData = (chunk: Buffer): void => {
      size += chunk.length;
      if (size > limit) done('too_large');
      else chunks.push(chunk);
    };
    const onEnd = (): void => done(Buffer.concat(chunks));
    const onError = (error: Error): void => {
      clearTimeout(timer);
      reject(error);
    };
    const timer = setTimeout(() => done('too_slow'), timeoutMs);
    req.on('data', onData);
    req.on('end', onEnd);
    req.on('error', onError);
  });
}

/**
 * Captures what the handler answers instead of sending it: `writeHead`, `flushHeaders`,
 * `write` and `end` are held until {@link send}, which sends through the real ones. An
 * answer that grows past `limit` bytes is passed on instead: `onPass` marks it, what was
 * held is written, and the rest goes out as the handler writes it. Writes after the
 * capture ended (a handler that outlived its timeout) are dropped.
 */
class Capture {
  private mode: 'capturing' | 'passing' | 'ended' | 'sending' = 'capturing';
  private readonly chunks: Buffer[] = [];
  private size = 0;
  /** The captured body, once the handler ended its answer. */
  body: Buffer = Buffer.alloc(0);
  private settle: (captured: Captured) => void = () => undefined;
  /** Settles when the handler ends its answer (captured, or passed on). */
  readonly done: Promise<Captured>;
  private readonly original: Pick<ServerResponse, 'writeHead' | 'write' | 'end' | 'flushHeaders'>;
  /** The response's headers and status before the handler ran. */
  private readonly before: { headers: OutgoingHttpHeaders; status: number; message: string };

  constructor(
    private readonly res: ServerResponse,
    private readonly limit: number,
    private readonly onPass: (res: ServerResponse) => void,
  ) {
    this.done = new Promise((resolve) => {
      this.settle = resolve;
    });
    this.original = { writeHead: res.writeHead, write: res.write, end: res.end, flushHeaders: res.flushHeaders };
    this.before = { headers: res.getHeaders(), status: res.statusCode, message: res.statusMessage };
    const capture = this;
    const chunk = (data: unknown, encoding: unknown): Buffer | undefined => {
      if (data === undefined || data === null || typeof data === 'function') return undefined;
      if (typeof data === 'string') return Buffer.from(data, typeof encoding === 'string' ? (encoding as BufferEncoding) : 'utf8');
      return Buffer.from(data as Uint8Array);
    };
    /** Takes a chunk of the handler's; `false` when it passes the limit (the answer is then passed on). */
    const take = (res: ServerResponse, bytes: Buffer | undefined): boolean => {
      if (bytes === undefined) return true;
      if (capture.size + bytes.length > capture.limit) {
        capture.pass(res);
        return false;
      }
      capture.size += bytes.length;
      capture.chunks.push(bytes);
      return true;
    };
    res.writeHead = function writeHead(this: ServerResponse, ...args: unknown[]) {
      if (capture.mode === 'sending' || (capture.mode === 'passing' && !this.headersSent)) {
        return (capture.original.writeHead as (...a: unknown[]) => ServerResponse).apply(this, args);
      }
      if (capture.mode === 'capturing') {
        const [status, reason, headers] = args as [number, unknown, unknown];
        this.statusCode = status;
        const fields = typeof reason === 'string' ? headers : reason;
        if (typeof reason === 'string') this.statusMessage = reason;
        if (Array.isArray(fields)) {
          const flat = Array.isArray(fields[0]) ? (fields as string[][]).flat() : (fields as string[]);
          for (let i = 0; i + 1 < flat.length; i += 2) this.appendHeader(String(flat[i]), String(flat[i + 1]));
        } else if (fields !== undefined && fields !== null) {
          for (const [name, value] of Object.entries(fields as OutgoingHttpHeaders)) {
            if (value !== undefined) this.setHeader(name, value);
          }
        }
      }
      return this;
    } as ServerResponse['writeHead'];
    res.flushHeaders = function flushHeaders(this: ServerResponse) {
      // Held: the headers go out with the answer, or not at all.
      if (capture.mode === 'sending' || capture.mode === 'passing') capture.original.flushHeaders.call(this);
    };
    res.write = function write(this: ServerResponse, data: unknown, encoding?: unknown, callback?: unknown) {
      if (capture.mode === 'sending' || capture.mode === 'passing') return (capture.original.write as (...a: unknown[]) => boolean).call(this, data, encoding, callback);
      if (capture.mode === 'capturing' && !take(this, chunk(data, encoding))) {
        return (capture.original.write as (...a: unknown[]) => boolean).call(this, data, encoding, callback);
      }
      const cb = typeof encoding === 'function' ? encoding : callback;
      if (typeof cb === 'function') process.nextTick(cb as () => void);
      return true;
    } as ServerResponse['write'];
    res.end = function end(this: ServerResponse, data?: unknown, encoding?: unknown, callback?: unknown) {
      if (capture.mode === 'capturing' && !take(this, chunk(data, encoding))) {
        // Passed on from here: the rest goes out with the end.
      } else if (capture.mode === 'capturing') {
        capture.mode = 'ended';
        capture.body = Buffer.concat(capture.chunks);
        capture.settle({ status: this.statusCode, body: capture.body, passed: false });
        const cb = [data, encoding, callback].find((f) => typeof f === 'function');
        if (typeof cb === 'function') process.nextTick(cb as () => void);
        return this;
      }
      if (capture.mode === 'passing') {
        capture.settle({ status: this.statusCode, body: Buffer.alloc(0), passed: true });
      }
      if (capture.mode === 'sending' || capture.mode === 'passing') {
        return (capture.original.end as (...a: unknown[]) => ServerResponse).call(this, data, encoding, callback);
      }
      const cb = [data, encoding, callback].find((f) => typeof f === 'function');
      if (typeof cb === 'function') process.nextTick(cb as () => void);
      return this;
    } as ServerResponse['end'];
  }

  /** Whether the answer outgrew the capture and is going to the caller as the handler writes it. */
  get passing(): boolean {
    return this.mode === 'passing';
  }

  /** Starts passing the answer on: marks it, and writes what was held. */
  private pass(res: ServerResponse): void {
    this.mode = 'passing';
    this.onPass(res);
    const held = this.chunks.splice(0);
    this.size = 0;
    for (const bytes of held) (this.original.write as (...a: unknown[]) => boolean).call(res, bytes);
  }

  /** Sends the handler's own answer, as it made it (the capture ends: later handler writes are dropped). */
  send(write: (res: ServerResponse) => void): void {
    this.mode = 'sending';
    try {
      write(this.res);
    } finally {
      this.mode = 'ended';
    }
  }

  /**
   * Sends an answer of the middleware's own (a problem, a replay) instead of the handler's:
   * every header the handler set is removed first (its `Content-Length`, `ETag`,
   * `Set-Cookie`, `Location`...); if the handler's headers already went out, the
   * connection is closed instead, rather than a second answer written after them.
   */
  replace(write: (res: ServerResponse) => void): void {
    const res = this.res;
    if (res.headersSent) {
      this.mode = 'ended';
      res.destroy();
      return;
    }
    for (const name of res.getHeaderNames()) {
      if (!Object.hasOwn(this.before.headers, name)) res.removeHeader(name);
    }
    for (const [name, value] of Object.entries(this.before.headers)) {
      if (value !== undefined) res.setHeader(name, value);
    }
    res.statusCode = this.before.status;
    res.statusMessage = this.before.message;
    this.send(write);
  }
}

/**
 * The Idempotency-Key middleware (see the module's documentation). Express 4 and 5 take it
 * as any middleware: `app.use(idempotency({ client }))`, or on a route.
 */
export function idempotency(options: IdempotencyOptions): (req: IncomingMessage, res: ServerResponse, next: Next) => void {
  const config = {
    namespace: options.namespace ?? 'proxy',
    guardedMethods: (options.guardedMethods ?? ['POST', 'PATCH']).map((m) => m.toUpperCase()),
    keyHeader: (options.keyHeader ?? 'idempotency-key').toLowerCase(),
    keyRequiredPrefixes: options.keyRequiredPrefixes ?? [],
    tenantHeader: options.tenantHeader?.toLowerCase(),
    callerHeaders: (options.callerHeaders ?? ['authorization']).map((h) => h.toLowerCase()),
    anonymousCallersShareKeys: options.anonymousCallersShareKeys ?? false,
    keyBytesMax: options.keyBytesMax ?? 255,
    headersBytesMax: options.headersBytesMax ?? 16 * 1024,
    bodyBytesMax: options.bodyBytesMax ?? 1 << 20,
    bodyReadTimeoutMs: options.bodyReadTimeoutMs ?? 10_000,
    storedBytesMax: options.storedBytesMax ?? 60 * 1024,
    // The largest answer captured, as the proxy reads it (`body_bytes_max.max(stored_bytes_max)`).
    answerBytesMax: Math.max(options.bodyBytesMax ?? 1 << 20, options.storedBytesMax ?? 60 * 1024),
    waitMs: options.waitMs ?? 5_000,
    handlerTimeoutMs: options.handlerTimeoutMs ?? 25_000,
    ttlMs: options.ttlMs ?? 86_400_000,
    fingerprintHeaders: (options.fingerprintHeaders ?? ['content-type']).map((h) => h.toLowerCase()),
    storedHeaders: (options.storedHeaders ?? ['content-type', 'location']).map((h) => h.toLowerCase()).filter((h) => !NEVER_STORED.has(h)),
    storedStatuses: new StoredStatuses(options.storedStatuses ?? ['2xx', '4xx', '!408', '!409', '!429']),
    link: options.keyPolicyUrl === undefined ? undefined : `<${options.keyPolicyUrl}>; rel="describedby"`,
    parseBody: options.parseBody ?? defaultParse,
  };
  if (!(config.storedBytesMax >= 256)) throw new RangeError(`storedBytesMax is ${config.storedBytesMax}; it must be at least 256 (what is stored for an answer not stored whole)`);
  const client = options.client;

  const sendProblem = (res: ServerResponse, problem: Problem): void => {
    const body = JSON.stringify({
      type: `https://oncegate.dev/problems/${problem.code}`,
      title: problem.title,
      status: problem.status,
      detail: problem.detail,
      code: problem.code,
    });
    res.statusCode = problem.status;
    res.setHeader('content-type', 'application/problem+json');
    if (problem.retryAfterS !== undefined) res.setHeader('retry-after', String(problem.retryAfterS));
    if (config.link !== undefined) res.appendHeader('link', config.link);
    res.end(body);
  };

  /** Who is calling, as the record key names it (`ProxyConfig::caller`). */
  const caller = (req: IncomingMessage): string | Problem => {
    if (config.tenantHeader !== undefined) {
      const tenant = headerValues(req, config.tenantHeader)[0];
      if (tenant !== undefined && tenant !== '' && tenant.length <= 64 && !tenant.includes(' ') && visibleAscii(tenant)) return `t:${tenant}`;
      return {
        status: 400,
        title: 'Tenant required',
        code: 'invalid_argument',
        detail: `a guarded request needs a ${config.tenantHeader} header: 1 to 64 visible ASCII characters`,
      };
    }
    const sent = config.callerHeaders.flatMap((name) => headerValues(req, name).map((value) => [name, value] as const));
    if (sent.length === 0) {
      if (config.anonymousCallersShareKeys) return '-';
      return {
        status: 400,
        title: 'Caller required',
        code: 'invalid_argument',
        detail: `a guarded request needs one of the caller headers (${config.callerHeaders.join(', ')}), which tell callers apart so that one caller's key never answers another's request`,
      };
    }
    const [first] = sent as [readonly [string, string]];
    if (first[0] === 'authorization' && config.callerHeaders.length === 1) return `c:${sha256Hex16([Buffer.from(first[1], 'latin1')])}`;
    return `h:${sha256Hex16(sent.flatMap(([name, value]) => [Buffer.from(`${name}:`, 'latin1'), Buffer.from(value, 'latin1'), Buffer.from('\n')]))}`;
  };

  const storedAnswer = (res: ServerResponse, captured: Captured): StoredAnswer => {
    const headers: Array<[string, string]> = [];
    for (const name of config.storedHeaders) {
      const value = res.getHeader(name);
      if (value === undefined) continue;
      for (const one of Array.isArray(value) ? value : [value]) headers.push([name, String(one)]);
    }
    return { status: captured.status, headers, body: captured.body };
  };

  const softFailure = (body: Buffer): boolean => {
    if (options.softFailure === undefined) return false;
    try {
      const found = pointerGet(JSON.parse(body.toString('utf8')), options.softFailure.pointer);
      return found !== undefined && canonicalValue(found) === canonicalValue(options.softFailure.equals);
    } catch {
      return false;
    }
  };

  const guard = async (req: GuardedRequest, res: ServerResponse, next: Next, key: string): Promise<void> => {
    const headerBytes = req.rawHeaders.reduce((sum, part) => sum + Buffer.byteLength(part, 'latin1'), 0);
    if (headerBytes > config.headersBytesMax) {
      return sendProblem(res, {
        status: 431,
        title: 'Request headers too large',
        code: 'invalid_argument',
        detail: `the headers are ${headerBytes} bytes; headers_bytes_max is ${config.headersBytesMax}`,
      });
    }
    if (!visibleAscii(key) || /[^\x00-\x7f]/.test(key)) {
      return sendProblem(res, { status: 400, title: 'Invalid Idempotency-Key', code: 'invalid_argument', detail: 'the key is not visible ASCII' });
    }
    if (key.length === 0 || key.length > config.keyBytesMax) {
      return sendProblem(res, {
        status: 400,
        title: 'Invalid Idempotency-Key',
        code: 'invalid_argument',
        detail: `the key is ${key.length} bytes; it must be 1 to ${config.keyBytesMax} (key_bytes_max)`,
      });
    }
    const who = caller(req);
    if (typeof who !== 'string') return sendProblem(res, who);
    const target = req.originalUrl ?? req.url ?? '/';
    const path = target.split('?')[0] ?? '/';
    const method = (req.method ?? 'GET').toUpperCase();
    const recordKey = `${method} ${path} ${who} ${key}`;

    let body: Buffer;
    if (req.rawBody !== undefined) body = req.rawBody;
    // A parser that read the body says so (body-parser 1.x); one that skipped it (another
    // content type) leaves `req.body` as `{}` all the same, so the body is read here.
    else if (req._body === true) body = parsedBodyBytes(req.body);
    else if (req.readableEnded || req.readableDidRead) {
      return sendProblem(res, {
        status: 500,
        title: 'Idempotency middleware misplaced',
        code: 'unavailable',
        detail:
          'the request body was read before the idempotency middleware, and nothing kept it to fingerprint: mount idempotency() before body parsers, or give the parser verify: saveRawBody so that req.rawBody holds the body as written',
      });
    } else {
      const read = await readBody(req, config.bodyBytesMax, config.bodyReadTimeoutMs);
      if (read === 'too_large') {
        return sendProblem(res, { status: 413, title: 'Request body too large', code: 'invalid_argument', detail: `the body passes body_bytes_max (${config.bodyBytesMax} bytes)` });
      }
      if (read === 'too_slow') {
        return sendProblem(res, {
          status: 408,
          title: 'Request body too slow',
          code: 'unavailable',
          detail: `the body did not arrive within body_read_timeout_ms (${config.bodyReadTimeoutMs} ms)`,
        });
      }
      body = read;
      req.rawBody = read;
      req.body = config.parseBody(read, req);
      req._body = true; // body-parser 1.x skips a request so marked (2.x sees it finished)
    }
    const headers: Record<string, string> = {};
    for (const name of config.fingerprintHeaders) {
      const value = headerValues(req, name)[0];
      if (value !== undefined && visibleAscii(value)) headers[name] = value;
    }
    const fingerprint = requestFingerprint(method, target, headers, body);

    const capture = new Capture(res, config.answerBytesMax, (out) => {
      if (config.storedStatuses.stores(out.statusCode)) out.appendHeader('warning', FIRST_OF_OMITTED);
      if (config.link !== undefined) out.appendHeader('link', config.link);
    });
    // Set when the answer was captured but not stored whole: it is stored without its body.
    let omitted = false;
    const work = async (lease: Lease): Promise<Buffer> => {
      // The answer is stored as it comes: asked for unencoded, so that a replay needs no
      // encoding header to be read.
      dropHeader(req, 'accept-encoding');
      req.headers['oncegate-token'] = lease.token.toString();
      req.headers['oncegate-attempt'] = String(lease.attempt);
      if (lease.previous === 'abandoned') req.headers['oncegate-previous'] = 'abandoned';
      req.oncegate = lease;
      (res as ServerResponse & { locals?: Record<string, unknown> }).locals ??= {};
      const locals = (res as ServerResponse & { locals: Record<string, unknown> }).locals;
      locals['oncegate'] = lease;
      let timer: NodeJS.Timeout | undefined;
      const timedOut = new Promise<never>((_, reject) => {
        timer = setTimeout(
          () =>
            reject(
              new OutcomeUnknown({
                status: 504,
                title: 'Outcome unknown',
                code: 'unavailable',
                detail: `no answer within handler_timeout_ms (${config.handlerTimeoutMs} ms); the handler may have run the request`,
              }),
            ),
          config.handlerTimeoutMs,
        );
      });
      try {
        next();
        const captured = await Promise.race([capture.done, timedOut]);
        // The handler ran it: an answer that cannot be stored whole completes the key
        // with its status and headers, its body left out and said so; a retry never runs
        // it again.
        const storable = config.storedStatuses.stores(captured.status) && (captured.passed || !softFailure(captured.body));
        if (!storable) throw new Unstored();
        const stored = storedAnswer(res, captured);
        if (captured.passed) return omittedAnswer(stored, `more than ${config.answerBytesMax} bytes`, config.storedBytesMax);
        const encoding = res.getHeader('content-encoding');
        if (encoding !== undefined && String(encoding).trim() !== '' && String(encoding).trim().toLowerCase() !== 'identity') {
          omitted = true;
          return omittedAnswer(stored, `encoded (${String(encoding).trim()})`, config.storedBytesMax);
        }
        const bytes = encodeStored(stored);
        if (bytes.length <= config.storedBytesMax) return bytes;
        omitted = true;
        return omittedAnswer(stored, `${bytes.length} bytes to store, over stored_bytes_max (${config.storedBytesMax})`, config.storedBytesMax);
      } finally {
        clearTimeout(timer);
      }
    };

    /** Sends the handler's own answer, as it made it (all its headers). */
    const sendCaptured = (warning?: string): void =>
      capture.send((out) => {
        if (warning !== undefined) out.appendHeader('warning', warning);
        if (config.link !== undefined) out.appendHeader('link', config.link);
        out.end(capture.body);
      });

    try {
      const result = await once(client, { namespace: config.namespace, key: recordKey, ttlMs: config.ttlMs, leaseMs: config.handlerTimeoutMs + LEASE_MARGIN_MS, waitMs: config.waitMs, fingerprint }, work);
      // Passed on as it came: the answer is out already.
      if (!result.replayed && capture.passing) return;
      if (!result.replayed) return sendCaptured(omitted ? FIRST_OF_OMITTED : undefined);
      const stored = decodeStored(result.response);
      if (stored === undefined) {
        return capture.replace((out) => sendProblem(out, { status: 502, title: 'Bad gateway', code: 'unavailable', detail: 'the stored answer is in a format this middleware does not read' }));
      }
      return capture.replace((out) => {
        out.statusCode = stored.status;
        const byName = new Map<string, string[]>();
        for (const [name, value] of stored.headers) byName.set(name, [...(byName.get(name) ?? []), value]);
        for (const [name, values] of byName) out.setHeader(name, values.length === 1 ? (values[0] as string) : values);
        out.setHeader('idempotent-replayed', 'true');
        if (config.link !== undefined) out.appendHeader('link', config.link);
        out.end(stored.body);
      });
    } catch (error) {
      if (error instanceof OnceError && (error.kind === 'unconfirmed' || (error.kind === 'retryable' && error.cause instanceof Unstored))) {
        // The handler answered; only storing it failed, or it is not to be stored. An
        // answer passed on as it came is out already.
        if (capture.passing) return;
        return sendCaptured(error.kind === 'unconfirmed' ? '299 - "answer may not be stored; a retry may run again"' : undefined);
      }
      // Passed on as it came and ended: nothing may follow it, nor cut it short.
      if (capture.passing && res.writableEnded) return;
      // An answer not stored whole is the only copy the caller can get.
      if (omitted && error instanceof OnceError && error.kind === 'lease_lost') return sendCaptured(LOST_BEFORE_STORED);
      capture.replace((out) => refused(out, error));
    }
  };

  /** The answer for a request `once` did not complete (`Proxy::refused`). */
  const refused = (res: ServerResponse, error: unknown): void => {
    if (error instanceof OnceError) {
      const cause = error.cause;
      switch (error.kind) {
        case 'unknown':
          if (cause instanceof OutcomeUnknown) return sendProblem(res, cause.problem);
          break;
        case 'mismatch':
          return sendProblem(res, { status: 422, title: 'Idempotency-Key reused', code: 'mismatch', detail: 'this Idempotency-Key was used with another request payload' });
        case 'in_progress':
          return sendProblem(res, {
            status: 409,
            title: 'Request in progress',
            code: 'in_progress',
            detail: 'a request with this Idempotency-Key is being processed; retry later',
            retryAfterS: Math.max(1, Math.ceil((error.retryAfterMs ?? 1000) / 1000)),
          });
        default:
          break;
      }
      return sendProblem(res, {
        status: 502,
        title: 'Outcome unknown',
        code: 'lease_lost',
        detail: 'the handler may have run this request, but its answer could not be stored; do not retry blindly: check for its effects',
      });
    }
    if (error instanceof GateError) {
      if (error.code === 'invalid_argument' && error.field === 'lease_ms') {
        return sendProblem(res, {
          status: 500,
          title: 'Idempotency middleware misconfigured',
          code: 'unavailable',
          detail: `the gate refused the lease of handlerTimeoutMs + ${LEASE_MARGIN_MS} ms (${config.handlerTimeoutMs + LEASE_MARGIN_MS} ms): keep it within the server's lease_ms_max (${error.message})`,
        });
      }
      if (error.code === 'invalid_argument') return sendProblem(res, { status: 400, title: 'Request refused', code: 'invalid_argument', detail: error.message });
      if (error.code === 'resource_exhausted') {
        return sendProblem(res, { status: 429, title: 'Too many requests', code: 'resource_exhausted', detail: error.message, retryAfterS: 1 });
      }
      return sendProblem(res, { status: 503, title: 'Gate unavailable', code: 'unavailable', detail: error.message, retryAfterS: 1 });
    }
    return sendProblem(res, { status: 500, title: 'Internal error', code: 'unavailable', detail: error instanceof Error ? error.message : String(error) });
  };

  return (incoming: IncomingMessage, res: ServerResponse, next: Next): void => {
    const req = incoming as GuardedRequest;
    // Only the middleware says which attempt runs.
    for (const name of ATTEMPT_HEADERS) delete req.headers[name];
    const method = (req.method ?? 'GET').toUpperCase();
    if (!config.guardedMethods.includes(method)) return next();
    const keys = headerValues(req, config.keyHeader);
    const key = keys[0];
    if (keys.some((other) => other !== key)) {
      return sendProblem(res, { status: 400, title: 'Conflicting Idempotency-Key', code: 'invalid_argument', detail: `the request carries two different ${config.keyHeader} headers` });
    }
    if (key === undefined) {
      const path = (req.originalUrl ?? req.url ?? '/').split('?')[0] ?? '/';
      if (config.keyRequiredPrefixes.some((prefix) => path.startsWith(prefix))) {
        return sendProblem(res, { status: 400, title: 'Idempotency-Key required', code: 'invalid_argument', detail: `${path} needs an ${config.keyHeader} header` });
      }
      return next();
    }
    guard(req, res, next, key).catch(next);
  };
}

/** A body a parser already read, as bytes for the fingerprint (its JSON when parsed). */
function parsedBodyBytes(body: unknown): Buffer {
  if (body === undefined || body === null) return Buffer.alloc(0);
  if (Buffer.isBuffer(body)) return body;
  if (typeof body === 'string') return Buffer.from(body, 'utf8');
  return Buffer.from(JSON.stringify(body), 'utf8');
}

/** The warning on an answer not stored whole whose lease was lost before it was stored. */
const LOST_BEFORE_STORED = '299 - "lease lost before the answer was stored; a retry may run again"';

/** The warning on the whole answer of a request whose answer was not stored whole. */
const FIRST_OF_OMITTED = '299 - "answer not stored whole; a retry is answered without its body"';

/**
 * What is stored for an answer that cannot be stored whole (`reason` says why): its
 * status and stored headers (but `Content-Encoding`: there is no body to decode) with an
 * empty body and a `Warning` saying so, or, when even those are over `storedBytesMax`,
 * the status and the warning alone. A retry is told the request ran and how it ended,
 * and never runs it again. The same bytes as the proxy's and the ASGI middleware's
 * (clients/vectors.json).
 */
export function omittedAnswer(answer: StoredAnswer, reason: string, storedBytesMax: number): Buffer {
  const text = `299 - "the answer was not stored whole: ${reason}; its body is not replayed"`;
  const warning: [string, string] = ['warning', text.replace(/[^\x20-\x7e]/g, '?')];
  const kept = answer.headers.filter(([name]) => name !== 'content-encoding');
  const marker = encodeStored({ status: answer.status, headers: [...kept, warning], body: Buffer.alloc(0) });
  if (marker.length <= storedBytesMax) return marker;
  return encodeStored({ status: answer.status, headers: [warning], body: Buffer.alloc(0) });
}
