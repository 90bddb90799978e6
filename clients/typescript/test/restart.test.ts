/**
 * `once` through a server killed (`kill -9`) while its works finish: every commit is
 * retried with its token until the server is back, so no work that ran is left
 * unconfirmed (tests/client_restart.rs, for this client).
 */
import { test } from 'node:test';
import * as assert from 'node:assert/strict';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { Client, once } from '../src/index';
import type { CommitInput, CallOptions } from '../src/index';
import { startServer, uniqueKey } from './helpers';
import type { Server } from './helpers';

const WORKS = 16;

/**
 * The client, noting each key whose commit failed at least once (by key: tokens are
 * unique per key, not across keys).
 */
class Noting extends Client {
  readonly failed = new Set<string>();
  private waiters: Array<() => void> = [];

  override async commit(input: CommitInput, options?: CallOptions): Promise<{ expiresAtMs: bigint }> {
    try {
      return await super.commit(input, options);
    } catch (error) {
      this.failed.add(`${input.namespace}/${input.key}`);
      for (const wake of this.waiters.splice(0)) wake();
      throw error;
    }
  }

  /** Settles once `count` keys have had a commit fail. */
  async failedAtLeast(count: number): Promise<void> {
    while (this.failed.size < count) await new Promise<void>((resolve) => this.waiters.push(resolve));
  }
}

/** A promise and the function that settles it. */
function signal(): { promise: Promise<void>; fire: () => void } {
  let fire!: () => void;
  const promise = new Promise<void>((resolve) => {
    fire = resolve;
  });
  return { promise, fire };
}

for (const transport of ['session', 'unary'] as const) {
  test(`commits ride through a server killed while the works finish (${transport})`, { timeout: 120_000 }, async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'oncegate-ts-restart-'));
    let first: Server | undefined;
    let back: Server | undefined;
    let gate: Noting | undefined;
    try {
      first = await startServer({ dir });
      const listen = first.address.replace(/^http:\/\//, '');
      gate = new Noting({ address: first.address, transport });
      const noting = gate;
      const allStarted = signal();
      const finish = signal();
      let started = 0;
      const keys = Array.from({ length: WORKS }, (_, i) => uniqueKey(`order-${i}`));
      const works = keys.map((key) =>
        once(noting, { namespace: 'live', key }, async (lease) => {
          started += 1;
          if (started === WORKS) allStarted.fire();
          await finish.promise;
          return `filled ${lease.token}`;
        }),
      );
      // Nothing rejects unobserved while the server is down.
      const settled = Promise.allSettled(works);
      await allStarted.promise;
      await first.kill();
      finish.fire();
      // Every work has ended and its commit has failed at least once against the dead
      // server before it comes back.
      await gate.failedAtLeast(WORKS);
      back = await startServer({ dir, listen });
      const results = await settled;
      results.forEach((result, i) => {
        assert.equal(result.status, 'fulfilled', `every commit is confirmed: ${result.status === 'rejected' ? String(result.reason) : ''}`);
        if (result.status !== 'fulfilled') return;
        assert.equal(result.value.replayed, false, keys[i]);
        assert.equal(result.value.response.toString(), `filled ${result.value.token}`);
      });
      for (const key of keys) {
        const view = await gate.get({ namespace: 'live', key });
        assert.equal(view.state, 'completed', key);
        assert.equal(view.outcome, 'succeeded', key);
      }
    } finally {
      gate?.close();
      await back?.stop();
      await first?.stop();
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });
}
