/**
 * `once`: the protocol every user of a gate needs, written once
 * (crates/oncegate-client/src/once.rs).
 *
 * Reserve the key, waiting for an attempt in flight (the server-side wait, then polls that
 * honour `retry_after_ms`, up to a deadline). On a grant, run the work while heartbeats
 * keep the lease (every third of the granted lease, alongside the work); commit the work's
 * response as succeeded, or a {@link FinalError} as failed (a commit that gets no answer is
 * retried with its token for `commitRetryForMs`, through a server restart); release the key on a
 * {@link RetryableError}; leave the lease to lapse on an {@link UnknownError} (or any other
 * error, or a process that dies), so that the next attempt is granted with
 * `previous = 'abandoned'` and can check for a side effect. A completed key replays what
 * the first attempt stored: a success is returned, a stored failure is thrown.
 */
import type { Client } from './client';
import { FinalError, GateError, OnceError, RetryableError, toBytes } from './errors';
import type { TradeKey } from './keys';
import { DEFAULT_RETRY, retryPause, sleep } from './retry';
import type { Granted, KeySpec, Outcome, Previous } from './types';

/**
 * The lease's length assumed when the grant does not say it (a server older than
 * `Granted.lease_ms`) and the options leave it unset: the contract's default. An unset
 * `leaseMs` sends 0, so the server's `lease_ms_default` applies.
 */
export const LEASE_DEFAULT_MS = 30_000;
/** How long `once` retries a commit that got no answer, by default (`commitRetryForMs`). */
export const COMMIT_RETRY_FOR_DEFAULT_MS = 10_000;
/** How long `once` waits for an attempt in flight by default. */
export const WAIT_DEFAULT_MS = 30_000;
/** The longest server-side wait one reserve asks for (the server's default `wait_ms_max`). */
export const WAIT_PER_RESERVE_MAX_MS = 30_000;

/** How `once` reserves. Name the key with exactly one of `key`, `keyParts` or `tradeKey`. */
export interface OnceOptions extends KeySpec {
  /** A trade's derived key (its parts, bucket and grace). */
  tradeKey?: TradeKey;
  /** How long the record is remembered, in milliseconds; unset: the server's default. */
  ttlMs?: number;
  /**
   * The lease the work runs under, in milliseconds, renewed by heartbeats every third of
   * it; unset (or 0): the server's `lease_ms_default` (the grant says how long it is).
   */
  leaseMs?: number;
  /** How long to wait for another attempt holding the key, in milliseconds; default 30 s; 0 answers at once. Still in progress then: an {@link OnceError} `in_progress`. */
  waitMs?: number;
  /** The request's fingerprint (`fingerprintJson(body)`): a different payload under the same key is then a `mismatch`. */
  fingerprint?: Uint8Array;
  /**
   * How long a commit that failed with `unavailable` or `resource_exhausted` (a server
   * restarting, a failover) is retried with the same token after the work ran, in
   * milliseconds, with jittered back-off; default 10 s. Not confirmed by then: an
   * {@link OnceError} `unconfirmed`.
   */
  commitRetryForMs?: number;
}

/** The lease a work runs under. */
export interface Lease {
  readonly namespace: string;
  /** The key (the derived one, for key parts). */
  readonly key: string;
  /** The fencing token: pass it to whatever the work writes, so a stale attempt's writes can be refused. */
  readonly token: bigint;
  /** 1 for a first attempt, one more after each abandoned one. */
  readonly attempt: number;
  /** `abandoned` when an attempt before this one may have partly run: check its side effects. */
  readonly previous: Previous;
  /** When the lease ends unless renewed, by this client's clock (ms since the epoch); heartbeats move it. */
  readonly deadline: number;
  /** Aborted when the lease is lost (taken over, or not renewed in time): stop, the attempt is fenced off. */
  readonly signal: AbortSignal;
}

/** What a work returns: the response to store (bytes, or text stored as UTF-8). */
export type WorkResult = Uint8Array | string | void | undefined;

/** A successful `once`: the work ran now, or an earlier attempt's stored success replayed. */
export interface OnceResult {
  /** Whether this is an earlier attempt's stored answer. */
  replayed: boolean;
  /** Always `succeeded` here: a failure (now or replayed) is thrown as an {@link OnceError} `failed`. */
  outcome: Outcome;
  /** The response stored. */
  response: Buffer;
  /** The key that answered (for a replay under bucket grace, possibly the previous bucket's). */
  key: string;
  /** The token of the attempt that completed the key. */
  token: bigint;
  /** For a replay: when it was completed (server clock, ms since the epoch). */
  completedAtMs: bigint | undefined;
  /** When the record expires (server clock). */
  expiresAtMs: bigint;
  /** For a run now: the attempt number and whether an earlier one was abandoned. */
  attempt: number | undefined;
  previous: Previous | undefined;
}

function keySpec(options: OnceOptions): KeySpec {
  const named = [options.key !== undefined, options.keyParts !== undefined, options.tradeKey !== undefined].filter(Boolean);
  if (named.length !== 1) throw new TypeError('name the key with exactly one of key, keyParts or tradeKey');
  if (options.tradeKey !== undefined) {
    const trade = options.tradeKey;
    return { namespace: options.namespace, keyParts: trade.keyParts, bucketMs: trade.bucketMs, bucketGraceMs: trade.bucketGraceMs };
  }
  return {
    namespace: options.namespace,
    key: options.key,
    keyParts: options.keyParts,
    bucketMs: options.bucketMs,
    bucketGraceMs: options.bucketGraceMs,
  };
}

/**
 * Runs `work` at most once for the key (see the module's documentation). Resolves with the
 * stored success (now or replayed); rejects with an {@link OnceError} (its `kind` says
 * why) or, when a call to the gate failed before the work ran, a {@link GateError}.
 */
export async function once(client: Client, options: OnceOptions, work: (lease: Lease) => WorkResult | Promise<WorkResult>): Promise<OnceResult> {
  const spec = keySpec(options);
  // 0 asks for the server's default lease; the grant says how long it is.
  const leaseAsked = options.leaseMs || 0;
  const commitRetryForMs = options.commitRetryForMs ?? COMMIT_RETRY_FOR_DEFAULT_MS;
  const waitFor = options.waitMs ?? WAIT_DEFAULT_MS;
  const until = performance.now() + waitFor;
  for (;;) {
    const waitMs = Math.max(0, Math.min(Math.floor(until - performance.now()), WAIT_PER_RESERVE_MAX_MS));
    // The lease is counted from before the reserve was sent: the server started it when it
    // decided, which may be long before the answer arrives.
    const sent = performance.now();
    const reply = await client.reserve({ ...spec, ttlMs: options.ttlMs, leaseMs: leaseAsked, fingerprint: options.fingerprint, waitMs });
    switch (reply.status) {
      case 'granted': {
        // The granted length; a server older than the field says 0: what was asked for.
        const leaseMs = reply.leaseMs || leaseAsked || LEASE_DEFAULT_MS;
        return run(client, spec.namespace, reply, sent, leaseMs, commitRetryForMs, work);
      }
      case 'completed':
        if (reply.outcome === 'succeeded') {
          return {
            replayed: true,
            outcome: 'succeeded',
            response: reply.response,
            key: reply.key,
            token: reply.token,
            completedAtMs: reply.completedAtMs,
            expiresAtMs: reply.expiresAtMs,
            attempt: undefined,
            previous: undefined,
          };
        }
        throw new OnceError({
          kind: 'failed',
          message: `the key ${reply.key} was completed as failed by an earlier attempt (token ${reply.token})`,
          key: reply.key,
          token: reply.token,
          response: reply.response,
          replayed: true,
          completedAtMs: reply.completedAtMs,
          expiresAtMs: reply.expiresAtMs,
        });
      case 'mismatch':
        throw new OnceError({
          kind: 'mismatch',
          message: `mismatch: the key ${reply.key} was used with another payload (it expires at ${reply.expiresAtMs})`,
          key: reply.key,
          expiresAtMs: reply.expiresAtMs,
        });
      case 'in_progress': {
        const left = until - performance.now();
        if (left <= 0) {
          throw new OnceError({
            kind: 'in_progress',
            message: `another attempt (attempt ${reply.attempt}) still holds the key ${reply.key}`,
            key: reply.key,
            retryAfterMs: reply.retryAfterMs,
          });
        }
        await sleep(Math.min(Math.max(reply.retryAfterMs, 1), left));
      }
    }
  }
}

/** Whether a heartbeat's refusal means the lease is gone for good. */
function lostFor(error: unknown): boolean {
  return error instanceof GateError && (error.code === 'lease_lost' || error.code === 'not_found' || error.code === 'already_completed');
}

/**
 * Keeps a lease: a heartbeat a third of a lease after the lease was last counted from,
 * and within half of what is left after a failed one; `lost` settles when the lease is
 * refused, or not renewed before it ends by this client's (conservative) clock.
 */
class Keeper {
  validUntil: number;
  private next: number;
  private readonly every: number;
  private beating = false;
  private stopped = false;
  private timer: NodeJS.Timeout | undefined;
  private onLost: () => void = () => undefined;
  readonly lost: Promise<void>;

  constructor(
    private readonly beat: () => Promise<unknown>,
    sent: number,
    private readonly leaseMs: number,
  ) {
    this.every = Math.max(leaseMs / 3, 1);
    this.validUntil = sent + leaseMs;
    this.next = sent + this.every;
    this.lost = new Promise((resolve) => {
      this.onLost = resolve;
    });
  }

  start(): void {
    this.schedule();
  }

  stop(): void {
    this.stopped = true;
    clearTimeout(this.timer);
  }

  private lose(): void {
    if (this.stopped) return;
    this.stop();
    this.onLost();
  }

  private schedule(): void {
    clearTimeout(this.timer);
    if (this.stopped) return;
    const now = performance.now();
    if (now >= this.validUntil) return this.lose();
    const wake = this.beating ? this.validUntil : Math.min(this.next, this.validUntil);
    this.timer = setTimeout(() => this.tick(), Math.max(0, wake - now));
  }

  private tick(): void {
    if (this.stopped) return;
    if (performance.now() >= this.validUntil) return this.lose();
    if (!this.beating) this.renew();
    this.schedule();
  }

  private renew(): void {
    this.beating = true;
    const sent = performance.now();
    this.beat().then(
      () => {
        this.validUntil = sent + this.leaseMs;
        this.next = sent + this.every;
      },
      (error: unknown) => {
        if (lostFor(error)) return this.lose();
        // Not renewed this time: the lease runs on until validUntil; try again within half of what is left.
        const now = performance.now();
        this.next = now + Math.max(1, Math.min(this.every, (this.validUntil - now) / 2));
      },
    ).finally(() => {
      this.beating = false;
      this.schedule();
    });
  }
}

type Finished = { kind: 'done'; value: WorkResult } | { kind: 'threw'; error: unknown } | { kind: 'lost' };

async function run(
  client: Client,
  namespace: string,
  grant: Granted,
  sent: number,
  leaseMs: number,
  commitRetryForMs: number,
  work: (lease: Lease) => WorkResult | Promise<WorkResult>,
): Promise<OnceResult> {
  const { key, token } = grant;
  const held = { namespace, key, token };
  const leaseLost = (): OnceError =>
    new OnceError({ kind: 'lease_lost', message: `lease_lost: the attempt holding token ${token} was fenced off`, key, token });
  const keeper = new Keeper(() => client.heartbeat({ ...held, leaseMs }), sent, leaseMs);
  // A grant that came after its lease would have ended by this client's count (a long
  // wait, retries) is renewed before the work starts.
  if (performance.now() >= keeper.validUntil) {
    const renewedAt = performance.now();
    try {
      await client.heartbeat({ ...held, leaseMs });
    } catch (error) {
      throw new OnceError({ kind: 'lease_lost', message: `the lease of token ${token} ended before the work could start`, key, token, cause: error });
    }
    keeper.validUntil = renewedAt + leaseMs;
  }
  const controller = new AbortController();
  const lease: Lease = {
    namespace,
    key,
    token,
    attempt: grant.attempt,
    previous: grant.previous,
    get deadline(): number {
      return Date.now() + (keeper.validUntil - performance.now());
    },
    signal: controller.signal,
  };
  keeper.start();
  const working = (async () => work(lease))();
  const finished: Finished = await Promise.race([
    working.then(
      (value): Finished => ({ kind: 'done', value }),
      (error: unknown): Finished => ({ kind: 'threw', error }),
    ),
    keeper.lost.then((): Finished => ({ kind: 'lost' })),
  ]);
  keeper.stop();
  if (finished.kind === 'lost') {
    const error = leaseLost();
    controller.abort(error);
    working.catch(() => undefined);
    throw error;
  }
  if (finished.kind === 'done') {
    const response = toBytes(finished.value as Uint8Array | string | undefined);
    const { expiresAtMs } = await commit(client, held, 'succeeded', response, leaseLost, commitRetryForMs);
    return {
      replayed: false,
      outcome: 'succeeded',
      response,
      key,
      token,
      completedAtMs: undefined,
      expiresAtMs,
      attempt: grant.attempt,
      previous: grant.previous,
    };
  }
  const error = finished.error;
  if (error instanceof FinalError) {
    await commit(client, held, 'failed', error.response, leaseLost, commitRetryForMs);
    throw new OnceError({ kind: 'failed', message: `the work failed for good (committed as failed): ${error.message}`, key, token, response: error.response, cause: error });
  }
  if (error instanceof RetryableError) {
    // A release that fails changes nothing for the caller: the key is no longer this
    // attempt's, or frees when its lease ends.
    await client.release(held).catch(() => undefined);
    throw new OnceError({ kind: 'retryable', message: `the work failed and the key was released: ${error.message}`, key, token, cause: error });
  }
  const message = error instanceof Error ? error.message : String(error);
  throw new OnceError({ kind: 'unknown', message: `the work's outcome is unknown; the key frees when its lease ends: ${message}`, key, token, cause: error });
}

/**
 * Commits the work's end, retried with the same token while the gate is unavailable or
 * busy (a restarting server; a commit repeated after its answer was lost is acknowledged
 * again) for up to `retryForMs`, with jittered back-off between the client's own retries.
 * `lease_lost` or `conflict`: fenced off by a newer token. A commit that still fails leaves
 * the key held until its lease ends: the work ran, so the key must not be freed for
 * another run; the next attempt finds it abandoned and can check this one's effects.
 */
async function commit(
  client: Client,
  held: { namespace: string; key: string; token: bigint },
  outcome: Outcome,
  response: Buffer,
  leaseLost: () => OnceError,
  retryForMs: number,
): Promise<{ expiresAtMs: bigint }> {
  const until = performance.now() + retryForMs;
  for (let tried = 1; ; tried += 1) {
    try {
      return await client.commit({ ...held, outcome, response });
    } catch (error) {
      if (error instanceof GateError && (error.code === 'lease_lost' || error.code === 'conflict')) {
        const lost = leaseLost();
        throw new OnceError({ kind: 'lease_lost', message: lost.message, key: held.key, token: held.token, cause: error });
      }
      const left = until - performance.now();
      if (!(error instanceof GateError && error.retryable) || left <= 0) {
        throw new OnceError({
          kind: 'unconfirmed',
          message: `the work ran (token ${held.token}) but its commit could not be confirmed: ${error instanceof Error ? error.message : String(error)}`,
          key: held.key,
          token: held.token,
          response,
          cause: error,
        });
      }
      await sleep(Math.min(retryPause(DEFAULT_RETRY, tried), left));
    }
  }
}
