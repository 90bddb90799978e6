/** `once` and the client against a real server. */
import { after, before, test } from 'node:test';
import * as assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import * as path from 'node:path';
import * as readline from 'node:readline';
import { status as GrpcStatus } from '@grpc/grpc-js';
import { Client, FinalError, GateError, LEASE_DEFAULT_MS, OnceError, RetryableError, TradeKey, fingerprintJson, once } from '../src/index';
import type { CallOptions, CommitInput, HeartbeatInput, HeldKey, Lease, Renewed, ReserveInput, Reserved } from '../src/index';
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
  let seen: Lease | undefined;
  await assert.rejects(
    once(client, { namespace: 'live', key, leaseMs: 200 }, async (lease) => {
      seen = lease;
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
  assert.equal(seen?.signal.aborted, true, 'a fenced attempt is told so');
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

/**
 * The client, noting the calls `once` makes after the grant (and the abort of the lease's
 * signal, by the test), in order; `commitFails` makes every commit fail with that error.
 */
class Noting extends Client {
  readonly events: string[] = [];
  commitFails: GateError | undefined;
  /** Whether grants say their lease's length (a server older than the field says 0). */
  grantsSayLease = true;
  /** The server-side wait each reserve asked for. */
  readonly waits: number[] = [];

  override async reserve(input: ReserveInput, options?: CallOptions): Promise<Reserved> {
    this.waits.push(input.waitMs ?? 0);
    const reply = await super.reserve(input, options);
    return reply.status === 'granted' && !this.grantsSayLease ? { ...reply, leaseMs: 0 } : reply;
  }

  override async heartbeat(input: HeartbeatInput, options?: CallOptions): Promise<Renewed> {
    this.events.push(`heartbeat ${input.leaseMs ?? 0}`);
    return super.heartbeat(input, options);
  }

  override async commit(input: CommitInput, options?: CallOptions): Promise<{ expiresAtMs: bigint }> {
    this.events.push(`commit ${input.outcome}`);
    if (this.commitFails !== undefined) throw this.commitFails;
    return super.commit(input, options);
  }

  override async release(input: HeldKey, options?: CallOptions): Promise<void> {
    this.events.push('release');
    return super.release(input, options);
  }
}

test('lease.signal is aborted on every end of the attempt but a committed success, before the key is given back', async () => {
  const noting = new Noting({ address: server.address });
  try {
    /** Runs once with a work that notes its lease and the abort of its signal, then ends as `end` says. */
    const attempt = async (end: (lease: Lease) => string | Promise<string>, options: { leaseMs?: number } = {}) => {
      noting.events.length = 0;
      let seen: Lease | undefined;
      const settled = await once(noting, { namespace: 'live', key: uniqueKey('ends'), ...options }, (lease) => {
        seen = lease;
        lease.signal.addEventListener('abort', () => noting.events.push('aborted'));
        return end(lease);
      }).then(
        (result) => result,
        (error: unknown) => error,
      );
      assert.ok(seen !== undefined, 'the work ran');
      return { settled, lease: seen, events: [...noting.events] };
    };

    const succeeded = await attempt(() => 'fine');
    assert.equal(succeeded.lease.signal.aborted, false, 'a committed success is not aborted');
    assert.deepEqual(succeeded.events, ['commit succeeded']);

    const unknown = await attempt(() => {
      throw new Error('the exchange timed out');
    });
    assert.ok(unknown.settled instanceof OnceError && unknown.settled.kind === 'unknown');
    assert.equal(unknown.lease.signal.aborted, true);
    assert.equal(unknown.lease.signal.reason, unknown.settled);
    assert.deepEqual(unknown.events, ['aborted']);

    // Told before the release: the next attempt may be granted right after it.
    const retryable = await attempt(() => {
      throw new RetryableError('the exchange is down');
    });
    assert.ok(retryable.settled instanceof OnceError && retryable.settled.kind === 'retryable');
    assert.deepEqual(retryable.events, ['aborted', 'release']);

    const failed = await attempt(() => {
      throw new FinalError('declined', { response: 'no' });
    });
    assert.ok(failed.settled instanceof OnceError && failed.settled.kind === 'failed');
    assert.deepEqual(failed.events, ['aborted', 'commit failed']);

    noting.commitFails = new GateError({ code: 'invalid_argument', grpcCode: GrpcStatus.INVALID_ARGUMENT, message: 'refused' });
    const unconfirmed = await attempt(() => 'ran');
    assert.ok(unconfirmed.settled instanceof OnceError && unconfirmed.settled.kind === 'unconfirmed');
    assert.equal(unconfirmed.lease.signal.reason, unconfirmed.settled);
    assert.deepEqual(unconfirmed.events, ['commit succeeded', 'aborted']);
    noting.commitFails = undefined;
  } finally {
    noting.close();
  }
});

// The timeout only stops a client that ignores the caller's signal from hanging the run.
test('a caller that gives up ends the attempt: lease.signal is aborted and the key is held until its lease ends', { timeout: 20_000 }, async () => {
  const key = uniqueKey('gave-up');
  const caller = new AbortController();
  let started!: (lease: Lease) => void;
  const running = new Promise<Lease>((resolve) => {
    started = resolve;
  });
  let stopped: Promise<string> | undefined;
  const given = once(client, { namespace: 'live', key, signal: caller.signal }, (lease) => {
    started(lease);
    // Work outside the promise stops when the signal tells it to.
    stopped = new Promise<string>((resolve) => lease.signal.addEventListener('abort', () => resolve('stopped')));
    return stopped;
  });
  const seen = await running;
  caller.abort(new Error('the caller went away'));
  const error = await given.then(
    () => assert.fail('resolved after the caller gave up'),
    (e: unknown) => e,
  );
  assert.ok(error instanceof OnceError);
  assert.equal(error.kind, 'unknown');
  assert.equal(seen.signal.aborted, true);
  assert.equal(seen.signal.reason, error);
  assert.equal(await stopped, 'stopped');
  const view = await client.get({ namespace: 'live', key });
  assert.equal(view.state, 'pending', 'held, neither released nor committed');

  // Given up before the grant: nothing runs, and the wait ends with the signal's reason.
  const reason = new Error('given up before');
  await assert.rejects(
    once(client, { namespace: 'live', key, signal: AbortSignal.abort(reason) }, () => assert.fail('ran')),
    (e: unknown) => e === reason,
  );
});

test("a grant that does not say its lease's length (an older server) is renewed with an explicit lease before the work starts", async () => {
  const old = new Noting({ address: server.address });
  try {
    old.grantsSayLease = false;
    const before: string[][] = [];
    const key = uniqueKey('old-server');
    const result = await once(old, { namespace: 'live', key }, () => {
      before.push([...old.events]);
      return 'ran';
    });
    assert.equal(result.replayed, false);
    assert.deepEqual(before, [[`heartbeat ${LEASE_DEFAULT_MS}`]], 'the lease is renewed with 30 s before the work, never assumed');
    // Asked for a lease, the grant's length is known: no renewal before the work.
    old.events.length = 0;
    await once(old, { namespace: 'live', key: uniqueKey('old-server-asked'), leaseMs: 5_000 }, () => {
      before.push([...old.events]);
      return 'ran';
    });
    assert.deepEqual(before[1], []);
  } finally {
    old.close();
  }
});

test("a wait beyond the server's wait_ms_max polls instead of failing", async () => {
  const strict = await startServer({ config: ['[engine.limits]', 'wait_ms_max = 1000', ''].join('\n') });
  const gate = new Noting({ address: strict.address });
  try {
    const key = uniqueKey('wait-max');
    const holder = await gate.reserve({ namespace: 'live', key, leaseMs: 300 });
    assert.equal(holder.status, 'granted');
    gate.waits.length = 0;
    // The default wait (30 s) asks the server for more than it allows: refused, then polled
    // until the holder's lease (never renewed) runs out.
    const result = await once(gate, { namespace: 'live', key }, (lease) => {
      assert.equal(lease.attempt, 2);
      return lease.previous;
    });
    assert.equal(result.replayed, false);
    assert.equal(result.previous, 'abandoned');
    assert.equal(result.response.toString(), 'abandoned');
    // At most 5 s asked of the server per reserve; refused, the rest is polled.
    assert.equal(gate.waits[0], 5_000);
    assert.ok(gate.waits.length >= 2 && gate.waits.slice(1).every((ms) => ms === 0), `${gate.waits}`);
    // A reserve refused for another reason is refused again, and that refusal is the answer.
    const bad = await once(gate, { namespace: 'not a namespace', key }, () => 'no').then(
      () => assert.fail('accepted'),
      (error: unknown) => error,
    );
    assert.ok(bad instanceof GateError);
    assert.equal(bad.code, 'invalid_argument');
    assert.equal(bad.field, 'namespace');
  } finally {
    gate.close();
    await strict.stop();
  }
});
