/** The Idempotency-Key middleware on Express, against a real server. */
import { after, before, test } from 'node:test';
import * as assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import type { AddressInfo } from 'node:net';
import { ServerResponse } from 'node:http';
import type { Server as HttpServer } from 'node:http';
import * as zlib from 'node:zlib';
import express from 'express';
import type { Express } from 'express';
import bodyParserV1 from 'body-parser-v1';
import { Client } from '../src/index';
import { idempotency, saveRawBody } from '../src/express';
import type { GuardedRequest, IdempotencyOptions } from '../src/express';
import { startServer, uniqueKey } from './helpers';
import type { Server } from './helpers';

let server: Server;
let client: Client;
let http: HttpServer;
let base: string;
const runs = new Map<string, number>();
let failNext = true;

before(async () => {
  server = await startServer();
  client = new Client({ address: server.address });
  const app = express();
  app.use(idempotency({ client, namespace: 'http', waitMs: 20_000, keyRequiredPrefixes: ['/strict'] }));
  app.use(express.json());
  app.post('/orders', async (req, res) => {
    const body = req.body as { order: string };
    const n = (runs.get(body.order) ?? 0) + 1;
    runs.set(body.order, n);
    // Some asynchronous work, as a handler calling an exchange would have.
    await new Promise((resolve) => setImmediate(resolve));
    res.status(201).location(`/orders/${body.order}`).set('x-not-stored', 'yes').cookie('session', 'first-caller').json({ order: body.order, run: n, token: (req as GuardedRequest).oncegate?.token.toString() });
  });
  app.post('/flaky', (req, res) => {
    const key = String(req.headers['idempotency-key']);
    runs.set(key, (runs.get(key) ?? 0) + 1);
    if (failNext) {
      failNext = false;
      res.status(503).send('upstream down');
      return;
    }
    res.status(200).send('fine');
  });
  app.post('/strict', (_req, res) => {
    res.send('ok');
  });
  app.get('/orders', (_req, res) => {
    res.json({ listed: true });
  });
  await new Promise<void>((resolve) => {
    http = app.listen(0, '127.0.0.1', () => resolve());
  });
  base = `http://127.0.0.1:${(http.address() as AddressInfo).port}`;
});

/** More apps the tests start, closed after them. */
const others: HttpServer[] = [];

/** Serves `app` on a free port; its base URL. */
async function serve(app: Express): Promise<string> {
  const listening = await new Promise<HttpServer>((resolve) => {
    const started = app.listen(0, '127.0.0.1', () => resolve(started));
  });
  others.push(listening);
  return `http://127.0.0.1:${(listening.address() as AddressInfo).port}`;
}

/** The middleware's options for a test's own app. */
function options(more: Partial<IdempotencyOptions> = {}): IdempotencyOptions {
  return { client, namespace: 'http', waitMs: 20_000, ...more };
}

/** The record key the middleware gives a POST to `path` by the default caller (`Bearer alice`). */
function recordKey(path: string, key: string): string {
  return `POST ${path} c:${createHash('sha256').update('Bearer alice').digest('hex').slice(0, 16)} ${key}`;
}

after(async () => {
  for (const other of others) other.closeAllConnections();
  await Promise.all(others.map((other) => new Promise<void>((resolve) => other.close(() => resolve()))));
  await new Promise<void>((resolve) => http.close(() => resolve()));
  client.close();
  await server.stop();
});

function post(path: string, key: string | undefined, body: unknown, headers: Record<string, string> = {}, at: string = base): Promise<Response> {
  return fetch(`${at}${path}`, {
    method: 'POST',
    headers: {
      'content-type': 'application/json',
      authorization: 'Bearer alice',
      ...(key === undefined ? {} : { 'idempotency-key': key }),
      ...headers,
    },
    body: typeof body === 'string' ? body : JSON.stringify(body),
  });
}

test('50 concurrent duplicate POSTs run the handler once and all get its answer', async () => {
  const key = uniqueKey('dup');
  const order = uniqueKey('order');
  const answers = await Promise.all(
    Array.from({ length: 50 }, async () => {
      const res = await post('/orders', key, { order, qty: 1 });
      return { status: res.status, body: await res.text(), replayed: res.headers.get('idempotent-replayed'), location: res.headers.get('location'), type: res.headers.get('content-type') };
    }),
  );
  assert.equal(runs.get(order), 1);
  const first = answers[0];
  assert.ok(first !== undefined);
  for (const answer of answers) {
    assert.equal(answer.status, 201);
    assert.equal(answer.body, first.body);
    assert.equal(answer.location, `/orders/${order}`);
    assert.match(answer.type ?? '', /^application\/json/);
  }
  assert.equal(JSON.parse(first.body).run, 1);
  assert.equal(answers.filter((a) => a.replayed === 'true').length, 49);
  assert.equal(answers.filter((a) => a.replayed === null).length, 1);

  // A later retry, written with other spacing and member order, is replayed too; the
  // stored headers only, never the first caller's cookie.
  const later = await post('/orders', key, `{ "qty": 1, "order": "${order}" }`);
  assert.equal(later.status, 201);
  assert.equal(later.headers.get('idempotent-replayed'), 'true');
  assert.equal(later.headers.get('set-cookie'), null);
  assert.equal(later.headers.get('x-not-stored'), null);
  assert.equal(await later.text(), first.body);
  assert.equal(runs.get(order), 1);
});

test('a different body under the same key gets 422', async () => {
  const key = uniqueKey('reuse');
  const order = uniqueKey('order');
  assert.equal((await post('/orders', key, { order, qty: 1 })).status, 201);
  const res = await post('/orders', key, { order, qty: 2 });
  assert.equal(res.status, 422);
  assert.equal(res.headers.get('content-type'), 'application/problem+json');
  const problem = (await res.json()) as { code: string; status: number; type: string };
  assert.equal(problem.code, 'mismatch');
  assert.equal(problem.status, 422);
  assert.equal(problem.type, 'https://oncegate.dev/problems/mismatch');
  assert.equal(runs.get(order), 1);
});

test('a 5xx is passed on and releases the key: the retry runs again', async () => {
  const key = uniqueKey('flaky');
  failNext = true;
  const first = await post('/flaky', key, { n: 1 });
  assert.equal(first.status, 503);
  assert.equal(await first.text(), 'upstream down');
  const second = await post('/flaky', key, { n: 1 });
  assert.equal(second.status, 200);
  assert.equal(second.headers.get('idempotent-replayed'), null);
  assert.equal(await second.text(), 'fine');
  const third = await post('/flaky', key, { n: 1 });
  assert.equal(third.headers.get('idempotent-replayed'), 'true');
  assert.equal(await third.text(), 'fine');
  assert.equal(runs.get(key), 2);
});

test('requests the rules do not guard pass through, and bad ones are refused', async () => {
  const unkeyed = await post('/orders', undefined, { order: uniqueKey('free') });
  assert.equal(unkeyed.status, 201);
  assert.equal(unkeyed.headers.get('idempotent-replayed'), null);
  const listed = await fetch(`${base}/orders`, { headers: { 'idempotency-key': 'k' } });
  assert.deepEqual(await listed.json(), { listed: true });
  const required = await post('/strict', undefined, {});
  assert.equal(required.status, 400);
  assert.equal(((await required.json()) as { code: string }).code, 'invalid_argument');
  const anonymous = await fetch(`${base}/orders`, { method: 'POST', headers: { 'idempotency-key': uniqueKey('anon'), 'content-type': 'application/json' }, body: '{}' });
  assert.equal(anonymous.status, 400);
  assert.equal(((await anonymous.json()) as { title: string }).title, 'Caller required');
  const tooLong = await post('/orders', 'k'.repeat(256), { order: 'x' });
  assert.equal(tooLong.status, 400);
});

test('callers are told apart: one caller key never answers another', async () => {
  const key = uniqueKey('callers');
  const order = uniqueKey('order');
  const alice = await post('/orders', key, { order });
  const bob = await post('/orders', key, { order }, { authorization: 'Bearer bob' });
  assert.equal(alice.status, 201);
  assert.equal(bob.status, 201);
  assert.equal(bob.headers.get('idempotent-replayed'), null);
  assert.equal(runs.get(order), 2);
});

test("behind Express 4's body-parser, a body it skipped is read, never taken for {}", async () => {
  const app = express();
  app.use(bodyParserV1.json()); // leaves req.body = {} for a text/plain body it does not read
  app.use(idempotency(options()));
  let runs = 0;
  app.post('/note', (req, res) => {
    runs += 1;
    res.json({ body: req.body as unknown, runs });
  });
  const at = await serve(app);
  const key = uniqueKey('skipped');
  const text = { 'content-type': 'text/plain' };
  const first = await post('/note', key, 'first note', text, at);
  assert.equal(first.status, 200);
  assert.deepEqual(await first.json(), { body: 'first note', runs: 1 });
  const other = await post('/note', key, 'another note', text, at);
  assert.equal(other.status, 422, 'another body under the same key is another payload');
  const again = await post('/note', key, 'first note', text, at);
  assert.equal(again.headers.get('idempotent-replayed'), 'true');
  // A body the parser did read (it says so with req._body) is taken as it parsed it.
  const parsedKey = uniqueKey('parsed');
  const parsed = await post('/note', parsedKey, { n: 1 }, {}, at);
  assert.deepEqual(await parsed.json(), { body: { n: 1 }, runs: 2 });
  assert.equal((await post('/note', parsedKey, { n: 2 }, {}, at)).status, 422);
  assert.equal((await post('/note', parsedKey, { n: 1 }, {}, at)).headers.get('idempotent-replayed'), 'true');
  assert.equal(runs, 2);
});

test('a body consumed before the middleware with nothing kept is a configuration problem, not a guess', async () => {
  const app = express();
  app.use(express.json()); // body-parser 2.x: reads the body, keeps no raw bytes, no req._body
  app.use(idempotency(options()));
  let runs = 0;
  app.post('/note', (_req, res) => {
    runs += 1;
    res.send('ran');
  });
  const kept = express();
  kept.use(express.json({ verify: saveRawBody }));
  kept.use(idempotency(options()));
  kept.post('/note', (req, res) => {
    res.json(req.body);
  });
  const at = await serve(app);
  const refused = await post('/note', uniqueKey('consumed'), { n: 1 }, {}, at);
  assert.equal(refused.status, 500);
  assert.equal(refused.headers.get('content-type'), 'application/problem+json');
  const problem = (await refused.json()) as { detail: string };
  assert.match(problem.detail, /before body parsers/);
  assert.match(problem.detail, /saveRawBody/);
  assert.equal(runs, 0);
  // With verify: saveRawBody the bytes as written are fingerprinted.
  const keptAt = await serve(kept);
  const key = uniqueKey('raw');
  assert.deepEqual(await (await post('/note', key, '{"n": 1}', {}, keptAt)).json(), { n: 1 });
  assert.equal((await post('/note', key, '{"n": 2}', {}, keptAt)).status, 422);
});

test('the handler is never asked for an encoded answer, and an encoded one is stored without its body', async () => {
  const app = express();
  app.use(idempotency(options()));
  const asked: Array<string | undefined> = [];
  const json = JSON.stringify({ compressed: 'maybe' });
  app.post('/gz', (req, res) => {
    asked.push(req.headers['accept-encoding']);
    // What a compression middleware does when the request accepts it.
    if (/gzip/.test(req.headers['accept-encoding'] ?? '')) res.set('content-encoding', 'gzip').type('json').send(zlib.gzipSync(json));
    else res.type('json').send(json);
  });
  app.post('/always-gz', (_req, res) => {
    res.set('content-encoding', 'gzip').type('json').send(zlib.gzipSync(json));
  });
  const at = await serve(app);
  const key = uniqueKey('gz');
  const first = await post('/gz', key, {}, { 'accept-encoding': 'gzip' }, at);
  assert.equal(await first.text(), json);
  const replay = await post('/gz', key, {}, { 'accept-encoding': 'gzip' }, at);
  assert.equal(replay.headers.get('idempotent-replayed'), 'true');
  assert.equal(await replay.text(), json, 'the stored answer reads back without an encoding header');
  assert.deepEqual(asked, [undefined]);

  const encodedKey = uniqueKey('always-gz');
  const encoded = await post('/always-gz', encodedKey, {}, {}, at);
  assert.equal(encoded.status, 200);
  assert.equal(await encoded.text(), json, 'passed on to the first caller as it came');
  assert.match(encoded.headers.get('warning') ?? '', /not stored whole/);
  // Completed without its body (it was held, and ran again once its lease ended).
  const retried = await post('/always-gz', encodedKey, {}, {}, at);
  assert.equal(retried.status, 200);
  assert.equal(retried.headers.get('idempotent-replayed'), 'true');
  assert.equal(retried.headers.get('content-encoding'), null, 'no body to decode');
  assert.equal(await retried.text(), '');
  assert.match(retried.headers.get('warning') ?? '', /not stored whole: encoded \(gzip\)/);
});

test('an answer past the capture limit is passed on as it comes and stored without its body', async () => {
  const app = express();
  app.use(idempotency(options({ bodyBytesMax: 1024, storedBytesMax: 512 })));
  const chunk = 'x'.repeat(1000);
  app.post('/big', (_req, res) => {
    res.status(200).type('text');
    for (let i = 0; i < 3; i += 1) res.write(chunk);
    res.end(chunk);
  });
  let midRuns = 0;
  app.post('/mid', (_req, res) => {
    midRuns += 1;
    res.status(201).type('text').send('y'.repeat(800));
  });
  const at = await serve(app);
  const key = uniqueKey('big');
  const big = await post('/big', key, {}, {}, at);
  assert.equal(big.status, 200);
  assert.equal(await big.text(), chunk.repeat(4));
  assert.match(big.headers.get('warning') ?? '', /a retry is answered without its body/);
  // Completed without its body (it was held, and ran again once its lease ended).
  const bigRetry = await post('/big', key, {}, {}, at);
  assert.equal(bigRetry.headers.get('idempotent-replayed'), 'true');
  assert.equal(await bigRetry.text(), '');
  assert.match(bigRetry.headers.get('warning') ?? '', /not stored whole: more than 1024 bytes/);
  // Within the capture but too large to store: passed on whole, and stored without its
  // body, so a retry is told it ran and never runs it again (it was released, and a
  // caller that lost the answer ran the handler twice).
  const midKey = uniqueKey('mid');
  const mid = await post('/mid', midKey, {}, {}, at);
  assert.equal(mid.status, 201);
  assert.equal((await mid.text()).length, 800);
  assert.match(mid.headers.get('warning') ?? '', /a retry is answered without its body/);
  const retry = await post('/mid', midKey, {}, {}, at);
  assert.equal(retry.status, 201);
  assert.equal(await retry.text(), '');
  assert.equal(retry.headers.get('idempotent-replayed'), 'true');
  assert.match(retry.headers.get('content-type') ?? '', /^text\/plain/);
  assert.match(retry.headers.get('warning') ?? '', /bytes to store, over stored_bytes_max \(512\)/);
  assert.equal(midRuns, 1, 'the retry did not run the handler again');
});

test('an answer not stored whole reaches its caller when the lease is lost before its commit', async () => {
  // Released and granted to another attempt before the commit, which is fenced off.
  const lost = new Client({ address: server.address });
  const commit = lost.commit.bind(lost);
  lost.commit = async (input, callOptions) => {
    await lost.release({ namespace: input.namespace, key: input.key, token: input.token });
    await lost.reserve({ namespace: input.namespace, key: input.key });
    return commit(input, callOptions);
  };
  const app = express();
  app.use(idempotency({ ...options({ storedBytesMax: 512 }), client: lost }));
  app.post('/mid', (_req, res) => {
    res.status(201).type('text').send('y'.repeat(800));
  });
  const at = await serve(app);
  // The only copy the caller can get: passed on, warned (it was dropped for a 502).
  const first = await post('/mid', uniqueKey('lost'), {}, {}, at);
  assert.equal(first.status, 201);
  assert.equal((await first.text()).length, 800);
  assert.match(first.headers.get('warning') ?? '', /lease lost before the answer was stored/);
  lost.close();
});

test('storedBytesMax below 256 is refused: what is stored for an answer not stored whole must fit', () => {
  assert.throws(() => idempotency(options({ storedBytesMax: 255 })), /storedBytesMax is 255; it must be at least 256/);
});

test("a 504 drops the handler's headers, and the handler's signal is aborted before it is sent", async () => {
  const app = express();
  app.use(idempotency(options({ handlerTimeoutMs: 300 })));
  let abortedBeforeAnswer: boolean | undefined;
  let answered = false;
  app.post('/slow', async (req, res) => {
    res.status(201).set('etag', '"v1"').set('content-length', '5').location('/made/1').cookie('session', 'first');
    const signal = (req as GuardedRequest).oncegate?.signal;
    assert.ok(signal !== undefined);
    await new Promise((resolve) => signal.addEventListener('abort', resolve));
    abortedBeforeAnswer = !answered;
    res.end('late!');
  });
  app.post('/sent', async (req, res) => {
    // Headers gone out behind the middleware's back: a problem cannot follow them.
    ServerResponse.prototype.writeHead.call(res, 200, { 'content-type': 'text/plain' });
    (ServerResponse.prototype.write as (this: ServerResponse, chunk: string) => boolean).call(res, 'partial');
    const signal = (req as GuardedRequest).oncegate?.signal;
    await new Promise((resolve) => signal?.addEventListener('abort', resolve));
  });
  const at = await serve(app);
  const slow = await post('/slow', uniqueKey('slow'), {}, {}, at);
  answered = true;
  assert.equal(slow.status, 504);
  assert.equal(abortedBeforeAnswer, true, 'the handler was told before the 504 went out');
  assert.equal(slow.headers.get('content-type'), 'application/problem+json');
  for (const name of ['etag', 'location', 'set-cookie']) assert.equal(slow.headers.get(name), null, name);
  const problem = (await slow.json()) as { status: number; code: string };
  assert.equal(problem.status, 504);

  const sent = await post('/sent', uniqueKey('sent'), {}, {}, at);
  assert.equal(sent.status, 200);
  await assert.rejects(sent.text(), 'the connection is closed rather than a second answer written');
});
