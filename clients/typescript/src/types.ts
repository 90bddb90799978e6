/** The client's own view of the wire messages: camelCase, `bigint` tokens and deadlines. */

/** How a completed key ended. */
export type Outcome = 'succeeded' | 'failed';

/** Whether an attempt before a grant was abandoned. */
export type Previous = 'none' | 'abandoned';

/** A key's state, as `get` reports it. */
export type KeyState = 'free' | 'pending' | 'abandoned' | 'completed';

/** Where a reserve's record lives: a key, or parts the server derives one from. */
export interface KeySpec {
  /** 1 to 64 bytes of `[A-Za-z0-9._-]`, such as `live`. */
  namespace: string;
  /** The idempotency key (1 to 512 bytes); leave unset to derive one from `keyParts`. */
  key?: string;
  /** Parts of a derived key: `parts.join(":") + "::" + floor(now / bucketMs)`. */
  keyParts?: readonly string[];
  /** The bucket width of a derived key, in milliseconds; only with `keyParts`. */
  bucketMs?: number;
  /** Only with `keyParts`, below `bucketMs`: answer from the previous bucket's key within this long after a boundary while it holds a live record. */
  bucketGraceMs?: number;
}

/** A reserve request. */
export interface ReserveInput extends KeySpec {
  /** How long the record is remembered, in milliseconds; 0 or unset: the server's default. */
  ttlMs?: number;
  /** How long the holder may work before it must heartbeat; 0 or unset: the server's default. */
  leaseMs?: number;
  /** A hash of the request payload (at most 64 bytes), such as `fingerprintJson(body)`. */
  fingerprint?: Uint8Array;
  /** How long the server waits when the key is in progress, in milliseconds; 0 answers at once. */
  waitMs?: number;
}

/** A reserve's answer: proceed. */
export interface Granted {
  status: 'granted';
  /** The key the record lives under (the derived one for `keyParts`). */
  key: string;
  /** The fencing token. */
  token: bigint;
  attempt: number;
  /** The lease's end, by the server's clock (ms since the epoch). */
  leaseUntilMs: bigint;
  expiresAtMs: bigint;
  previous: Previous;
  /**
   * The lease's length in milliseconds: the request's `leaseMs`, or the server's
   * `lease_ms_default` when it sent 0; a holder heartbeats every third of it. 0 from a
   * server older than this field (the lease's length is then what was asked for).
   */
  leaseMs: number;
}

/** A reserve's answer: another attempt holds the key. */
export interface InProgress {
  status: 'in_progress';
  key: string;
  attempt: number;
  leaseUntilMs: bigint;
  /** When to look again, in milliseconds. */
  retryAfterMs: number;
}

/** A reserve's answer: the key was completed; this is what the first attempt stored. */
export interface Completed {
  status: 'completed';
  key: string;
  token: bigint;
  outcome: Outcome;
  response: Buffer;
  completedAtMs: bigint;
  expiresAtMs: bigint;
}

/** A reserve's answer: the key exists with another request's fingerprint. */
export interface Mismatch {
  status: 'mismatch';
  key: string;
  expiresAtMs: bigint;
}

/** What a reserve answers. */
export type Reserved = Granted | InProgress | Completed | Mismatch;

/** A call naming a held key (release, heartbeat). */
export interface HeldKey {
  namespace: string;
  key: string;
  token: bigint;
}

/** A heartbeat request. */
export interface HeartbeatInput extends HeldKey {
  /** The new lease, from now; 0 or unset: the server's default. */
  leaseMs?: number;
}

/** A heartbeat's answer. */
export interface Renewed {
  leaseUntilMs: bigint;
  expiresAtMs: bigint;
}

/** A commit request. */
export interface CommitInput extends HeldKey {
  outcome: Outcome;
  response?: Uint8Array | string;
}

/** A get's answer (`free` with zeros for a key without a live record). */
export interface KeyView {
  state: KeyState;
  token: bigint;
  attempt: number;
  leaseUntilMs: bigint;
  expiresAtMs: bigint;
  /** Set for a completed key. */
  outcome: Outcome | undefined;
  response: Buffer;
}

/** Options of one call. */
export interface CallOptions {
  /** This call's deadline in milliseconds, instead of the client's default (a reserve's `waitMs` is added to it). */
  timeoutMs?: number;
  /** Gives the call up (a session call sends a cancel; a unary call is cancelled). */
  signal?: AbortSignal;
}
