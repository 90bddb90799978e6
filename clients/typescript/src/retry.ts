/**
 * Retrying calls that are safe to repeat, with jittered exponential back-off
 * (crates/oncegate-client/src/retry.rs). Every call of the gate is safe to repeat by
 * itself: a reserve repeated after its grant was lost finds the key in progress (held by
 * the lost grant) rather than granting it twice; a commit with the same token and outcome
 * is acknowledged again; release, heartbeat and get change nothing twice. What must never
 * be repeated is the caller's work, and nothing here runs it.
 */
import { GateError } from './errors';

/** Which failures are retried, how often, and how long to pause between tries. */
export interface RetryPolicy {
  /** Tries in all, the first included; 1 retries nothing. Default 5. */
  attemptsMax: number;
  /** The pause before the first retry is drawn from `0..=backoffMinMs`; each retry after doubles the bound ("full jitter"). Default 25. */
  backoffMinMs: number;
  /** The largest bound of a pause. Default 1000. */
  backoffMaxMs: number;
}

/** The default policy: 5 tries, pauses of up to 25 ms doubling to 1 s. */
export const DEFAULT_RETRY: Readonly<RetryPolicy> = Object.freeze({ attemptsMax: 5, backoffMinMs: 25, backoffMaxMs: 1000 });

/** No retries. */
export const NO_RETRY: Readonly<RetryPolicy> = Object.freeze({ attemptsMax: 1, backoffMinMs: 0, backoffMaxMs: 0 });

/** The pause before retry `n` (1 for the first retry), in milliseconds. */
export function retryPause(policy: RetryPolicy, n: number): number {
  const bound = Math.min(policy.backoffMinMs * 2 ** Math.min(Math.max(n - 1, 0), 20), policy.backoffMaxMs);
  return Math.floor(Math.random() * (bound + 1));
}

/** A promise resolved after `ms` milliseconds. */
export function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, Math.max(0, ms)));
}

/**
 * Runs `call` until it succeeds, fails with a {@link GateError} that is not retryable
 * (`unavailable` and `resource_exhausted` are), or has been tried `attemptsMax` times.
 */
export async function withRetries<T>(policy: RetryPolicy, call: () => Promise<T>): Promise<T> {
  for (let tried = 1; ; tried += 1) {
    try {
      return await call();
    } catch (error) {
      if (!(error instanceof GateError) || !error.retryable || tried >= policy.attemptsMax) throw error;
      await sleep(retryPause(policy, tried));
    }
  }
}
