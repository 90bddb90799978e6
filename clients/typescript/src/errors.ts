/**
 * Errors: {@link GateError} for a refused or failed call (with the stable oncegate code),
 * the wrappers a work throws to say how it failed ({@link RetryableError},
 * {@link FinalError}, {@link UnknownError}), and {@link OnceError} for why `once` did not
 * run the work to a committed success.
 */
import { status as GrpcStatus } from '@grpc/grpc-js';
import type { Metadata, StatusObject } from '@grpc/grpc-js';

/** The stable oncegate codes (docs/semantics.md, "Error codes"). */
export type Code =
  | 'lease_lost'
  | 'conflict'
  | 'already_completed'
  | 'not_found'
  | 'invalid_argument'
  | 'unauthenticated'
  | 'unavailable'
  | 'resource_exhausted';

const CODES: readonly Code[] = [
  'lease_lost',
  'conflict',
  'already_completed',
  'not_found',
  'invalid_argument',
  'unauthenticated',
  'unavailable',
  'resource_exhausted',
];

/** The trailer carrying the stable code of a refusal. */
export const CODE_METADATA = 'oncegate-code';
/** The trailer naming the request field at fault, for `invalid_argument`. */
export const FIELD_METADATA = 'oncegate-field';
/** The trailer naming the limit reached, for `resource_exhausted`. */
export const LIMIT_METADATA = 'oncegate-limit';

/** Whether a failure with `code` may succeed when tried again (as retry.rs says). */
export function isRetryableCode(code: Code): boolean {
  return code === 'unavailable' || code === 'resource_exhausted';
}

/** What a gRPC status means when the server sent no `oncegate-code` (status.rs `code_of`). */
export function codeOfGrpc(grpcCode: number): Code {
  switch (grpcCode) {
    case GrpcStatus.INVALID_ARGUMENT:
    case GrpcStatus.OUT_OF_RANGE:
      return 'invalid_argument';
    case GrpcStatus.NOT_FOUND:
      return 'not_found';
    case GrpcStatus.FAILED_PRECONDITION:
    case GrpcStatus.ALREADY_EXISTS:
    case GrpcStatus.ABORTED:
      return 'conflict';
    case GrpcStatus.RESOURCE_EXHAUSTED:
      return 'resource_exhausted';
    case GrpcStatus.UNAUTHENTICATED:
    case GrpcStatus.PERMISSION_DENIED:
      return 'unauthenticated';
    default:
      // A deadline, a reset stream, an unknown or internal error: the call may not have
      // reached the server, or its answer did not come back.
      return 'unavailable';
  }
}

/** Reads a stable code by name; `undefined` for one this client does not know. */
export function parseCode(name: string | undefined): Code | undefined {
  return CODES.find((code) => code === name);
}

/** The fields of a {@link GateError}. */
export interface GateErrorInit {
  code: Code;
  grpcCode: number;
  message: string;
  field?: string | undefined;
  limit?: string | undefined;
  cause?: unknown;
}

/**
 * A call refused by the server, or one that got no answer (`unavailable`): the one error
 * class of the client's calls.
 */
export class GateError extends Error {
  /** The stable oncegate code (`lease_lost`, `unavailable`, ...). */
  readonly code: Code;
  /** The gRPC status code it came with (`@grpc/grpc-js`'s `status`). */
  readonly grpcCode: number;
  /** The request field at fault, for `invalid_argument`. */
  readonly field: string | undefined;
  /** The configuration key of the limit reached, for `resource_exhausted`. */
  readonly limit: string | undefined;

  constructor(init: GateErrorInit) {
    super(`${init.message} (${init.code})`, init.cause === undefined ? undefined : { cause: init.cause });
    this.name = 'GateError';
    this.code = init.code;
    this.grpcCode = init.grpcCode;
    this.field = init.field;
    this.limit = init.limit;
  }

  /** Whether trying the same call again may succeed (`unavailable`, `resource_exhausted`). */
  get retryable(): boolean {
    return isRetryableCode(this.code);
  }

  /** A call that got no answer (a deadline passed, a stream ended). */
  static unanswered(message: string, cause?: unknown): GateError {
    return new GateError({ code: 'unavailable', grpcCode: GrpcStatus.UNAVAILABLE, message, cause });
  }

  /** The error for a failed unary call's status (its trailers carry the code). */
  static fromStatus(status: Partial<StatusObject> & { code: number; details?: string; metadata?: Metadata }): GateError {
    const trailer = (name: string): string | undefined => {
      const value = status.metadata?.get(name)[0];
      return typeof value === 'string' && value !== '' ? value : undefined;
    };
    return new GateError({
      code: parseCode(trailer(CODE_METADATA)) ?? codeOfGrpc(status.code),
      grpcCode: status.code,
      message: status.details || GrpcStatus[status.code] || `gRPC status ${status.code}`,
      field: trailer(FIELD_METADATA),
      limit: trailer(LIMIT_METADATA),
      cause: status,
    });
  }
}

/**
 * Thrown by a work that failed in a way worth retrying: `once` releases the key so the
 * next attempt may run, and rejects with an {@link OnceError} of kind `retryable`.
 */
export class RetryableError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = 'RetryableError';
  }
}

/**
 * Thrown by a work that failed for good: `once` commits the key as failed with
 * `response`, which later attempts replay (as failures), and rejects with an
 * {@link OnceError} of kind `failed`.
 */
export class FinalError extends Error {
  /** What to store for later attempts. */
  readonly response: Buffer;

  constructor(message: string, options?: { cause?: unknown; response?: Uint8Array | string }) {
    super(message, options);
    this.name = 'FinalError';
    this.response = toBytes(options?.response);
  }
}

/**
 * Thrown by a work that cannot tell whether its side effect happened (a call that timed
 * out after it was sent): the key is neither committed nor released, it stays held until
 * its lease ends, and the next attempt is granted with `previous = 'abandoned'`. Any
 * other error a work throws is treated the same way.
 */
export class UnknownError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = 'UnknownError';
  }
}

/** Bytes of a response given as bytes or text (UTF-8); empty for `undefined`. */
export function toBytes(value: Uint8Array | string | undefined | null): Buffer {
  if (value === undefined || value === null) return Buffer.alloc(0);
  if (typeof value === 'string') return Buffer.from(value, 'utf8');
  return Buffer.from(value.buffer, value.byteOffset, value.byteLength);
}

/** Why `once` did not end with a committed (or replayed) success. */
export type OnceErrorKind =
  /** The work threw {@link RetryableError}; the key was released. */
  | 'retryable'
  /** The work threw {@link FinalError} (committed as failed), or the key replays a stored failure. */
  | 'failed'
  /** The work threw {@link UnknownError} or another error; the key frees when its lease ends. */
  | 'unknown'
  /** The work ran but its commit could not be confirmed; the key frees when its lease ends. */
  | 'unconfirmed'
  /** The lease was lost while the work ran, or its commit was fenced off by a newer token. */
  | 'lease_lost'
  /** The key is held with another request's fingerprint. */
  | 'mismatch'
  /** Another attempt still held the key when the wait deadline passed. */
  | 'in_progress';

/** The fields of a {@link OnceError}. */
export interface OnceErrorInit {
  kind: OnceErrorKind;
  message: string;
  cause?: unknown;
  key?: string | undefined;
  token?: bigint | undefined;
  response?: Buffer | undefined;
  replayed?: boolean;
  completedAtMs?: bigint | undefined;
  expiresAtMs?: bigint | undefined;
  retryAfterMs?: number | undefined;
}

/** Why `once` did not run the work to a committed success (see {@link OnceErrorKind}). */
export class OnceError extends Error {
  /** What happened. */
  readonly kind: OnceErrorKind;
  /** The key that answered (the derived one for key parts). */
  readonly key: string | undefined;
  /** The attempt's token (or, for a replayed failure, the completing attempt's). */
  readonly token: bigint | undefined;
  /** The stored response of a failure (`failed`), or the unstored one (`unconfirmed`). */
  readonly response: Buffer | undefined;
  /** For `failed`: whether this is an earlier attempt's stored failure, replayed. */
  readonly replayed: boolean;
  /** For a replayed failure: when it was committed (server clock, ms since the epoch). */
  readonly completedAtMs: bigint | undefined;
  /** For `mismatch` or a replayed failure: when the record expires. */
  readonly expiresAtMs: bigint | undefined;
  /** For `in_progress`: when to look again, in milliseconds. */
  readonly retryAfterMs: number | undefined;

  constructor(init: OnceErrorInit) {
    super(init.message, init.cause === undefined ? undefined : { cause: init.cause });
    this.name = 'OnceError';
    this.kind = init.kind;
    this.key = init.key;
    this.token = init.token;
    this.response = init.response;
    this.replayed = init.replayed ?? false;
    this.completedAtMs = init.completedAtMs;
    this.expiresAtMs = init.expiresAtMs;
    this.retryAfterMs = init.retryAfterMs;
  }
}
