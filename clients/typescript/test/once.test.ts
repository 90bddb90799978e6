/** `once` and the client against a real server. */
import { after, before, test } from 'node:test';
import * as assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import * as path from 'node:path';
import * as readline from 'node:readline';
import { status as GrpcStatus } from '@grpc/grpc-js';
import { Client, FinalError, GateError, OnceError, RetryableError, TradeKey, fingerprintJson, once } from '../src/index';
import type { Lease } from '../src/index';
import { startServer, uniqueKey } from './helpers';
import type { Server } from './helpers';

let server: Server;
let client: Client;
let unary: Client;

before(async () => {
  server = await startServer();
  client = new Client({ address: server.address });
  unary = new Client({ address: server.address, transport: 'unary' });
});

after(async () => {
  client.close();
  unary.close();
  await server.stop();
});

test('a work runs once and a retry replays its stored response', async () => {
  const key = uniqueKey('replay');
  let runs = 0;
  const first = await once(client, { namespace: 'live', key }, (lease) => {
    runs += 1;
    assert.equal(lease.key, key);
    assert.equal(lease.attempt, 1);
    assert.equal(lease.previous, 'none');
    assert.equal(typeof lease.token, 'bigint');
    assert.ok(lease.deadline > Date.now());
    assert.equal(lease.signal.aborted, false);
    return 'order A-77';
  });
  assert.equal(first.replayed, false);
  assert.equal(first.response.toString(), 'order A-77');
  const second = await once(unary, { namespace: 'live', key }, () => {
    runs += 1;
    return 'again';
  });
  assert.equal(runs, 1);
  assert.equal(second.replayed, true);
  assert.equal(second.outcome, 'succeeded');
  assert.equal(second.response.toString(), 'order A-77');
  assert.equal(second.token, first.token);
  assert.equal(second.key, key);
  assert.equal(typeof second.completedAtMs, 'bigint');
});

for (const transport of ['session', 'unary'] as const) {
  test(`64 concurrent once on one key run the work exactly once (${transport})`, async () => {
    const key = uniqueKey(`crowd-${transport}`);
    const crowd = new Client({ address: server.address, transport });
    let runs = 0;
    try {
      const results = await Promise.all(
        Array.from({ length: 64 }, () =>
          once(crowd, { namespace: 'live', key, waitMs: 30_000 }, async () => {
            runs += 1;
            await new Promise((resolve) => setImmediate(resolve));
            return 'the one answer';
          }),
        ),
      );
      assert.equal(runs, 1);
      assert.equal(results.filter((r) => !r.replayed).length, 1);
      assert.equal(results.filter((r) => r.replayed).length, 63);
      for (const result of results) {
        assert.equal(result.outcome, 'succeeded');
        assert.equal(result.response.toString(), 'the one answer');
      }
    } finally {
      crowd.close();
    }
  });
}

test('a work that raises a retryable error releases the key: the next once runs', async () => {
  const key = uniqueKey('retryable');
  let runs = 0;
  await assert.rejects(
    once(client, { namespace: 'live', key }, () => {
      runs += 1;
      throw new RetryableError('the exchange is down');
    }),
    (error: unknown) => error instanceof OnceError && error.kind === 'retryable' && error.cause instanceof RetryableError,
  );
  assert.equal((await client.get({ namespace: 'live', key })).state, 'free');
  const again = await once(client, { namespace: 'live', key, waitMs: 0 }, (lease) => {
    runs += 1;
    assert.equal(lease.previous, 'none');
    return 'placed';
  });
  assert.equal(runs, 2);
  assert.equal(again.replayed, false);
  assert.equal(again.response.toString(), 'placed');
});

test('a stored failure replays as a failure, never as a success', async () => {
  const key = uniqueKey('failed');
  let runs = 0;
  await assert.rejects(
    once(client, { namespace: 'live', key }, () => {
      runs += 1;
      throw new FinalError('card declined', { response: '{"error":"declined"}' });
    }),
    (error: unknown) => error instanceof OnceError && error.kind === 'failed' && !error.replayed,
  );
  const replay = await once(client, { namespace: 'live', key }, () => {
    runs += 1;
    return 'must not run';
  }).then(
    () => assert.fail('a stored failure resolved like a success'),
    (error: unknown) => error,
  );
  assert.ok(replay instanceof OnceError);
  assert.equal(replay.kind, 'failed');
  assert.equal(replay.replayed, true);
  assert.equal(replay.response?.toString(), '{"error":"declined"}');
  assert.equal(typeof replay.completedAtMs, 'bigint');
  assert.equal(runs, 1);
  const view = await client.get({ namespace: 'live', key });
  assert.equal(view.state, 'completed');
  assert.equal(view.outcome, 'failed');
});

test('a killed worker leaves the key to lapse: the next once is granted as abandoned', async () => {
  const key = uniqueKey('killed');
  const worker = path.join(__dirname, 'fixtures', 'worker.js');
  const child = spawn(process.execPath, [worker, server.address, key], { stdio: ['ignore', 'pipe', 'inherit'] });
  const exited = new Promise<NodeJS.Signals | null>((resolve) => child.once('exit', (_code, signal) => resolve(signal)));
  const line = await new Promise<string>((resolve, reject) => {
    readline.createInterface({ input: child.stdout as NodeJS.ReadableStream }).once('line', resolve);
    child.once('exit', (code) => reject(new Error(`the worker exited (${code}) before its grant`)));
  });
  const [word, token] = line.split(' ');
  assert.equal(word, 'granted');
  child.kill('SIGKILL');
  assert.equal(await exited, 'SIGKILL');

  let ran: Lease | undefined;
  // The server-side wait parks this reserve until the dead worker's lease runs out.
  const result = await once(client, { namespace: 'live', key, waitMs: 30_000, leaseMs: 5_000 }, (lease) => {
    ran = lease;
    return 'second attempt';
  });
  assert.ok(ran !== undefined, 'the work ran');
  assert.equal(ran.previous, 'abandoned');
  assert.equal(ran.attempt, 2);
  assert.ok(ran.token > BigInt(token as string));
  assert.equal(result.replayed, false);
  assert.equal(result.previous, 'abandoned');
});

test('a stale token is refused after a takeover', async () => {
  const key = uniqueKey('stale');
  const first = await client.reserve({ namespace: 'live', key, leaseMs: 200 });
  assert.equal(first.status, 'granted');
  if (first.status !== 'granted') return;
  // No heartbeat: the lease lapses, and a waiting once takes the key over.
  const result = await once(client, { namespace: 'live', key, waitMs: 30_000 }, async (lease) => {
    assert.equal(lease.previous, 'abandoned');
    const stale = await client.commit({ namespace: 'live', key, token: first.token, outcome: 'succeeded', response: 'late' }).then(
      () => assert.fail('the stale commit was accepted'),
      (error: unknown) => error,
    );
    assert.ok(stale instanceof GateError);
    assert.equal(stale.code, 'lease_lost');
    assert.equal(stale.grpcCode, GrpcStatus.FAILED_PRECONDITION);
    assert.equal(stale.retryable, false);
    return 'the new holder';
  });
  assert.equal(result.response.toString(), 'the new holder');
  // And after the completion a commit with the old token is refused too.
  await assert.rejects(
    client.commit({ namespace: 'live', key, token: first.token, outcome: 'succeeded' }),
    (error: unknown) => error instanceof GateError && (error.code === 'conflict' || error.code === 'lease_lost'),
  );
});

test('a commit fenced off by a newer token makes once fail with lease_lost', async () => {
  const key = uniqueKey('fenced');
  await assert.rejects(
    once(client, { namespace: 'live', key, leaseMs: 200 }, async (lease) => {
      // Another attempt takes the key over while this work runs (here: the key is given
      // up under the work's feet and reserved again), so this attempt's commit is fenced.
      await client.release({ namespace: 'live', key, token: lease.token });
      const other = await client.reserve({ namespace: 'live', key, leaseMs: 30_000 });
      assert.equal(other.status, 'granted');
      return 'too late';
    }),
    (error: unknown) => error instanceof OnceError && error.kind === 'lease_lost',
  );
  const view = await client.get({ namespace: 'live', key });
  assert.notEqual(view.state, 'completed', 'the fenced commit stored nothing');
});

test('a different payload under the same key is a mismatch', async () => {
  const key = uniqueKey('mismatch');
  await once(client, { namespace: 'live', key, fingerprint: fingerprintJson('{"qty": 1, "side": "buy"}') }, () => 'ok');
  // The same payload written differently replays.
  const same = await once(client, { namespace: 'live', key, fingerprint: fingerprintJson('{"side":"buy","qty":1.0}') }, () => 'no');
  assert.equal(same.replayed, true);
  await assert.rejects(
    once(client, { namespace: 'live', key, fingerprint: fingerprintJson('{"qty": 2, "side": "buy"}') }, () => 'no'),
    (error: unknown) => error instanceof OnceError && error.kind === 'mismatch' && typeof error.expiresAtMs === 'bigint',
  );
});

test('still in progress at the wait deadline is an error, not a success', async () => {
  const key = uniqueKey('busy');
  const holder = await client.reserve({ namespace: 'live', key, leaseMs: 60_000 });
  assert.equal(holder.status, 'granted');
  let runs = 0;
  await assert.rejects(
    once(client, { namespace: 'live', key, waitMs: 300 }, () => {
      runs += 1;
      return 'no';
    }),
    (error: unknown) => error instanceof OnceError && error.kind === 'in_progress' && (error.retryAfterMs ?? 0) >= 1,
  );
  await assert.rejects(
    once(client, { namespace: 'live', key, waitMs: 0 }, () => 'no'),
    (error: unknown) => error instanceof OnceError && error.kind === 'in_progress',
  );
  assert.equal(runs, 0);
  if (holder.status === 'granted') await client.release({ namespace: 'live', key, token: holder.token });
});

test('an unknown failure leaves the key held until its lease ends', async () => {
  const key = uniqueKey('unknown');
  await assert.rejects(
    once(client, { namespace: 'live', key, leaseMs: 500 }, () => {
      throw new Error('the exchange timed out after the order was sent');
    }),
    (error: unknown) => error instanceof OnceError && error.kind === 'unknown',
  );
  const view = await client.get({ namespace: 'live', key });
  assert.ok(view.state === 'pending' || view.state === 'abandoned');
  const next = await once(client, { namespace: 'live', key, waitMs: 30_000 }, (lease) => lease.previous);
  assert.equal(next.response.toString(), 'abandoned');
});

test('a trade key derives its key on the server', async () => {
  const trade = new TradeKey({ exchange: 'binance', symbol: uniqueKey('BTC'), action: 'buy', qty: '0.5', live: true, bucketMs: 60_000, bucketGraceMs: 2_000 });
  const result = await once(client, { namespace: 'orders', tradeKey: trade }, (lease) => lease.key);
  assert.ok(result.key.startsWith(`${trade.base}::`), result.key);
  assert.equal(result.response.toString(), result.key);
  const again = await once(client, { namespace: 'orders', tradeKey: trade }, () => 'no');
  assert.equal(again.replayed, true);
  assert.ok(again.key.startsWith(`${trade.base}::`));
});

test('refusals carry the stable code, the gRPC code and the field', async () => {
  const bad = await client.reserve({ namespace: 'not a namespace', key: 'k' }).then(
    () => assert.fail('accepted'),
    (error: unknown) => error,
  );
  assert.ok(bad instanceof GateError);
  assert.equal(bad.code, 'invalid_argument');
  assert.equal(bad.grpcCode, GrpcStatus.INVALID_ARGUMENT);
  assert.equal(bad.field, 'namespace');
  await assert.rejects(client.heartbeat({ namespace: 'live', key: uniqueKey('none'), token: 7n }), (error: unknown) => error instanceof GateError && error.code === 'not_found');
  await assert.rejects(once(client, { namespace: 'live' }, () => 'x'), TypeError);
});

test('the Session stream carries reserve, commit and get, matched by id', async () => {
  const session = client.openSession();
  try {
    await session.ready();
    assert.ok(session.callsInFlightMax >= 1);
    const keys = Array.from({ length: 40 }, (_, i) => uniqueKey(`session-${i}`));
    const grants = await Promise.all(keys.map((key) => session.reserve({ namespace: 'live', key })));
    grants.forEach((grant, i) => {
      assert.equal(grant.status, 'granted');
      assert.equal(grant.key, keys[i]);
    });
    await Promise.all(
      grants.map((grant, i) =>
        grant.status === 'granted' ? session.commit({ namespace: 'live', key: grant.key, token: grant.token, outcome: 'succeeded', response: `r${i}` }) : undefined,
      ),
    );
    const views = await Promise.all(keys.map((key) => session.get({ namespace: 'live', key })));
    views.forEach((view, i) => {
      assert.equal(view.state, 'completed');
      assert.equal(view.response.toString(), `r${i}`);
    });
    const replay = await session.reserve({ namespace: 'live', key: keys[0] as string });
    assert.equal(replay.status, 'completed');
    // A refused call is answered with its refusal, and the stream goes on.
    const first = grants[0];
    assert.ok(first?.status === 'granted');
    await assert.rejects(
      session.commit({ namespace: 'live', key: first.key, token: first.token + 1n, outcome: 'succeeded' }),
      (error: unknown) => error instanceof GateError && error.code === 'conflict' && error.grpcCode === GrpcStatus.FAILED_PRECONDITION,
    );
    assert.equal((await session.get({ namespace: 'live', key: keys[1] as string })).state, 'completed');
  } finally {
    session.close();
  }
});

test("an unset leaseMs takes the server's lease_ms_default, and the lease follows the grant", async () => {
  const short = await startServer({ config: ['[engine.limits]', 'lease_ms_default = 600', ''].join('\n') });
  const gate = new Client({ address: short.address });
  try {
    // The grant reports the lease's length: the server's default for 0, else what was asked.
    const asked = await gate.reserve({ namespace: 'live', key: uniqueKey('lease-asked'), leaseMs: 5_000 });
    assert.equal(asked.status, 'granted');
    assert.equal(asked.status === 'granted' && asked.leaseMs, 5_000);
    const defaulted = await gate.reserve({ namespace: 'live', key: uniqueKey('lease-default') });
    assert.equal(defaulted.status, 'granted');
    assert.equal(defaulted.status === 'granted' && defaulted.leaseMs, 600);

    const key = uniqueKey('lease-default-once');
    const left: number[] = [];
    const result = await once(gate, { namespace: 'live', key }, async (lease) => {
      left.push(lease.deadline - Date.now());
      // Longer than the lease: heartbeats every third of the granted 600 ms keep it.
      await new Promise((resolve) => setTimeout(resolve, 1_000));
      assert.equal(lease.signal.aborted, false);
      left.push(lease.deadline - Date.now());
      return 'ran under the default lease';
    });
    for (const ms of left) assert.ok(ms > 0 && ms <= 600, `the lease has ${ms} ms left, not within the granted 600`);
    assert.equal(result.replayed, false);
    assert.equal(result.response.toString(), 'ran under the default lease');
    const view = await gate.get({ namespace: 'live', key });
    assert.equal(view.state, 'completed');
    assert.equal(view.response.toString(), 'ran under the default lease');
  } finally {
    gate.close();
    await short.stop();
  }
});
