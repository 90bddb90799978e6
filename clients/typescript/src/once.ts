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
 * the first attempt stored: a success is returned, a stored failure is thrown. Every end of
 * the attempt but a committed success aborts `lease.signal`, before the key can be granted
 * to another attempt, so that work outside the promise hears it no longer holds the key.
 */
import type { Client } from './client';
import { FinalError, GateError, OnceError, RetryableError, toBytes } from './errors';
import type { TradeKey } from './keys';
import { DEFAULT_RETRY, retryPause, sleep } from './retry';
import type { Granted, KeySpec, Outcome, Previous } from './types';

/**
 * The lease asked for when the grant does not say how long it is (a server older than
 * `Granted.lease_ms`) and the options leave it unset: the lease is then renewed with a
 * heartbeat asking for this explicitly, before the work starts (its length is never
 * assumed). An unset `leaseMs` sends 0, so the server's `lease_ms_default` applies.
 */
export const LEASE_DEFAULT_MS = 30_000;
/** How long `once` retries a commit that got no answer, by default (`commitRetryForMs`). */
export const COMMIT_RETRY_FOR_DEFAULT_MS = 10_000;
/** How long `once` waits for an attempt in flight by default. */
export const WAIT_DEFAULT_MS = 30_000;
/**
 * The longest server-side wait one reserve asks for, well within the server's default
 * `wait_ms_max` (30 s); a longer `waitMs` is several reserves. A server configured below
 * what is asked refuses the reserve (`invalid_argument`), and is then polled instead.
 */
export const WAIT_PER_RESERVE_MAX_MS = 5_000;

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
  /**
   * Gives `once` up. While it waits for the key (before a grant): the wait ends and `once`
   * rejects with the signal's reason (a reserve cut off in flight may have been granted:
   * the key is then held until its lease ends). Granted but before the work starts: the
   * key is released and `once` rejects with the signal's reason; nothing ran. While the
   * work runs: `once` rejects at once with an {@link OnceError} `unknown`, `lease.signal`
   * is aborted, and the key is held until its lease ends (the work may have made its side
   * effect), as after an {@link UnknownError}. Once the work has returned, its commit goes on.
   */
  signal?: AbortSignal;
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
  /**
   * Aborted as soon as this attempt no longer holds the key, which is on every end but a
   * committed success: the lease lost (taken over, or not renewed in time), the work's
   * error (before the key is released or committed as failed), the caller giving up
   * (`OnceOptions.signal`), a commit refused or not confirmed, or the lease running out
   * while the commit is retried. Work that left the promise (a child process, a blocking
   * call, a timer) must stop when it sees this: another attempt may be granted the key.
   */
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
  const gaveUp = options.signal;
  const until = performance.now() + waitFor;
  // Whether the server is asked to wait: one whose `wait_ms_max` is below what is asked
  // refuses the reserve, and is then polled instead.
  let serverWaits = true;
  for (;;) {
    gaveUp?.throwIfAborted();
    const waitMs = serverWaits ? Math.max(0, Math.min(Math.floor(until - performance.now()), WAIT_PER_RESERVE_MAX_MS)) : 0;
    // The lease is counted from before the reserve was sent: the server started it when it
    // decided, which may be long before the answer arrives.
    const sent = performance.now();
    let reply;
    try {
      reply = await client.reserve(
        { ...spec, ttlMs: options.ttlMs, leaseMs: leaseAsked, fingerprint: options.fingerprint, waitMs },
        gaveUp === undefined ? {} : { signal: gaveUp },
      );
    } catch (error) {
      gaveUp?.throwIfAborted();
      // A wait beyond the server's `wait_ms_max` is refused: poll instead (a second
      // refusal, of a reserve that does not wait, is the caller's to see).
      if (error instanceof GateError && error.code === 'invalid_argument' && waitMs > 0) {
        serverWaits = false;
        continue;
      }
      throw error;
    }
    switch (reply.status) {
      case 'granted': {
        // The granted length. A server older than the field says 0: then what was asked
        // for; asked for nothing, the length is unknown, so the lease counts as over
        // already and is renewed with an explicit one before the work starts.
        const known = reply.leaseMs || leaseAsked;
        const leaseMs = known || LEASE_DEFAULT_MS;
        const validUntil = known > 0 ? sent + known : sent;
        return run(client, spec.namespace, reply, validUntil, leaseMs, commitRetryForMs, gaveUp, work);
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
        // Polling, as the server advised, within what is left of the wait.
        await pause(Math.min(Math.max(reply.retryAfterMs, 1), left), gaveUp);
      }
    }
  }
}

/** A pause of `ms` milliseconds, cut short when `signal` is aborted. */
function pause(ms: number, signal: AbortSignal | undefined): Promise<void> {
  if (signal === undefined) return sleep(ms);
  return new Promise((resolve) => {
    if (signal.aborted) return resolve();
    const done = (): void => {
      clearTimeout(timer);
      signal.removeEventListener('abort', done);
      resolve();
    };
    const timer = setTimeout(done, Math.max(0, ms));
    signal.addEventListener('abort', done, { once: true });
  });
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
    validUntil: number,
    private readonly leaseMs: number,
  ) {
    this.every = Math.max(leaseMs / 3, 1);
    this.validUntil = validUntil;
    // A third of a lease after the lease was counted from.
    this.next = validUntil - leaseMs + this.every;
    this.lost = new Promise((resolve) => {
      this.onLost = resolve;
    });
  }

  /** The lease was renewed by a heartbeat sent at `sent`. */
  renewed(sent: number): void {
    this.validUntil = sent + this.leaseMs;
    this.next = sent + this.every;
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
      () => this.renewed(sent),
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

type Finished = { kind: 'done'; value: WorkResult } | { kind: 'threw'; error: unknown } | { kind: 'lost' } | { kind: 'gave_up'; reason: unknown };

/** A promise settled when `signal` is aborted (never without one), and how to stop listening. */
function aborted(signal: AbortSignal | undefined): { promise: Promise<unknown>; dispose: () => void } {
  if (signal === undefined) return { promise: new Promise(() => undefined), dispose: () => undefined };
  let dispose = (): void => undefined;
  const promise = new Promise<unknown>((resolve) => {
    const onAbort = (): void => resolve(signal.reason);
    if (signal.aborted) return onAbort();
    signal.addEventListener('abort', onAbort, { once: true });
    dispose = () => signal.removeEventListener('abort', onAbort);
  });
  return { promise, dispose };
}

async function run(
  client: Client,
  namespace: string,
  grant: Granted,
  validUntil: number,
  leaseMs: number,
  commitRetryForMs: number,
  gaveUp: AbortSignal | undefined,
  work: (lease: Lease) => WorkResult | Promise<WorkResult>,
): Promise<OnceResult> {
  const { key, token } = grant;
  const held = { namespace, key, token };
  const leaseLost = (): OnceError =>
    new OnceError({ kind: 'lease_lost', message: `lease_lost: the attempt holding token ${token} was fenced off`, key, token });
  const controller = new AbortController();
  /**
   * Ends the attempt for whatever runs outside the work's promise: on every end but a
   * committed success, before the key can be granted to another attempt (before a
   * release, or at once when the key is left to lapse).
   */
  const end = (reason: unknown): void => {
    if (!controller.signal.aborted) controller.abort(reason);
  };
  const keeper = new Keeper(() => client.heartbeat({ ...held, leaseMs }), validUntil, leaseMs);
  // A grant that came after its lease would have ended by this client's count (a long
  // wait, retries), or whose lease's length is unknown (an older server), is renewed
  // before the work starts.
  if (performance.now() >= keeper.validUntil) {
    const renewedAt = performance.now();
    try {
      await client.heartbeat({ ...held, leaseMs });
    } catch (error) {
      const lost = new OnceError({ kind: 'lease_lost', message: `the lease of token ${token} ended before the work could start`, key, token, cause: error });
      end(lost);
      throw lost;
    }
    keeper.renewed(renewedAt);
  }
  if (gaveUp?.aborted) {
    // Nothing ran: the key is given back at once.
    end(gaveUp.reason);
    await client.release(held).catch(() => undefined);
    throw gaveUp.reason;
  }
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
  const giving = aborted(gaveUp);
  const working = (async () => work(lease))();
  let finished: Finished;
  try {
    finished = await Promise.race([
      working.then(
        (value): Finished => ({ kind: 'done', value }),
        (error: unknown): Finished => ({ kind: 'threw', error }),
      ),
      keeper.lost.then((): Finished => ({ kind: 'lost' })),
      giving.promise.then((reason): Finished => ({ kind: 'gave_up', reason })),
    ]);
  } finally {
    keeper.stop();
    giving.dispose();
  }
  if (finished.kind === 'lost') {
    const error = leaseLost();
    end(error);
    working.catch(() => undefined);
    throw error;
  }
  if (finished.kind === 'gave_up') {
    const error = new OnceError({
      kind: 'unknown',
      message: `given up while the work ran; the key frees when its lease ends: ${finished.reason instanceof Error ? finished.reason.message : String(finished.reason)}`,
      key,
      token,
      cause: finished.reason,
    });
    end(error);
    working.catch(() => undefined);
    throw error;
  }
  if (finished.kind === 'done') {
    const response = toBytes(finished.value as Uint8Array | string | undefined);
    // Retried, a commit may outlast the lease (no heartbeat runs meanwhile): from its end
    // by this client's clock, another attempt may be granted the key.
    const over = setTimeout(
      () => end(new OnceError({ kind: 'lease_lost', message: `the lease of token ${token} ended before its commit was confirmed`, key, token })),
      Math.max(0, keeper.validUntil - performance.now()),
    );
    let expiresAtMs: bigint;
    try {
      ({ expiresAtMs } = await commit(client, held, 'succeeded', response, leaseLost, commitRetryForMs));
    } catch (error) {
      end(error);
      throw error;
    } finally {
      clearTimeout(over);
    }
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
    const failed = new OnceError({ kind: 'failed', message: `the work failed for good (committed as failed): ${error.message}`, key, token, response: error.response, cause: error });
    end(failed);
    await commit(client, held, 'failed', error.response, leaseLost, commitRetryForMs);
    throw failed;
  }
  if (error instanceof RetryableError) {
    const retryable = new OnceError({ kind: 'retryable', message: `the work failed and the key was released: ${error.message}`, key, token, cause: error });
    // Told before the key is released: the next attempt may be granted right after.
    end(retryable);
    // A release that fails changes nothing for the caller: the key is no longer this
    // attempt's, or frees when its lease ends.
    await client.release(held).catch(() => undefined);
    throw retryable;
  }
  const message = error instanceof Error ? error.message : String(error);
  const unknown = new OnceError({ kind: 'unknown', message: `the work's outcome is unknown; the key frees when its lease ends: ${message}`, key, token, cause: error });
  end(unknown);
  throw unknown;
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
