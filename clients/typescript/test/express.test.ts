/** The Idempotency-Key middleware on Express, against a real server. */
import { after, before, test } from 'node:test';
import * as assert from 'node:assert/strict';
import type { AddressInfo } from 'node:net';
import type { Server as HttpServer } from 'node:http';
import express from 'express';
import { Client } from '../src/index';
import { idempotency } from '../src/express';
import type { GuardedRequest } from '../src/express';
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

after(async () => {
  await new Promise<void>((resolve) => http.close(() => resolve()));
  client.close();
  await server.stop();
});

function post(path: string, key: string | undefined, body: unknown, headers: Record<string, string> = {}): Promise<Response> {
  return fetch(`${base}${path}`, {
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
