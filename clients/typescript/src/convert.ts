/** Conversions between the client's types and the generated wire types. */
import { toBytes } from './errors';
import type { CommitRequest, GetResponse, HeartbeatResponse, ReserveRequest, ReserveResponse } from './proto';
import type { CommitInput, HeartbeatInput, KeyView, Outcome, Renewed, ReserveInput, Reserved } from './types';
import { GateError } from './errors';
import { status as GrpcStatus } from '@grpc/grpc-js';

/** A reply this client cannot read (a newer server's enum, a missing oneof). */
export function protocolError(message: string): GateError {
  return new GateError({ code: 'unavailable', grpcCode: GrpcStatus.INTERNAL, message: `unexpected answer: ${message}` });
}

function u64(value: number | bigint | undefined): string {
  if (value === undefined) return '0';
  if (typeof value === 'number' && (!Number.isInteger(value) || value < 0)) {
    throw new RangeError(`${value} is not a non-negative integer`);
  }
  return BigInt(value).toString();
}

export function reserveRequest(input: ReserveInput): ReserveRequest {
  return {
    namespace: input.namespace,
    key: input.key ?? '',
    key_parts: input.keyParts === undefined ? [] : [...input.keyParts],
    bucket_ms: u64(input.bucketMs),
    ttl_ms: u64(input.ttlMs),
    lease_ms: u64(input.leaseMs),
    fingerprint: toBytes(input.fingerprint),
    wait_ms: u64(input.waitMs),
    bucket_grace_ms: u64(input.bucketGraceMs),
  };
}

export function outcomeOf(wire: string): Outcome {
  if (wire === 'OUTCOME_SUCCEEDED') return 'succeeded';
  if (wire === 'OUTCOME_FAILED') return 'failed';
  throw protocolError(`outcome ${wire}`);
}

export function reserved(reply: ReserveResponse): Reserved {
  const key = reply.key;
  switch (reply.outcome) {
    case 'granted': {
      const g = reply.granted as NonNullable<ReserveResponse['granted']>;
      return {
        status: 'granted',
        key,
        token: BigInt(g.token),
        attempt: g.attempt,
        leaseUntilMs: BigInt(g.lease_until_ms),
        expiresAtMs: BigInt(g.expires_at_ms),
        previous: g.previous === 'PREVIOUS_ABANDONED' ? 'abandoned' : 'none',
        // '0' (the default) from servers older than the field.
        leaseMs: Number(g.lease_ms),
      };
    }
    case 'in_progress': {
      const p = reply.in_progress as NonNullable<ReserveResponse['in_progress']>;
      return {
        status: 'in_progress',
        key,
        attempt: p.attempt,
        leaseUntilMs: BigInt(p.lease_until_ms),
        retryAfterMs: Number(p.retry_after_ms),
      };
    }
    case 'completed': {
      const c = reply.completed as NonNullable<ReserveResponse['completed']>;
      return {
        status: 'completed',
        key,
        token: BigInt(c.token),
        outcome: outcomeOf(c.outcome),
        response: Buffer.from(c.response),
        completedAtMs: BigInt(c.completed_at_ms),
        expiresAtMs: BigInt(c.expires_at_ms),
      };
    }
    case 'mismatch': {
      const m = reply.mismatch as NonNullable<ReserveResponse['mismatch']>;
      return { status: 'mismatch', key, expiresAtMs: BigInt(m.expires_at_ms) };
    }
    default:
      throw protocolError('a reserve reply without an outcome');
  }
}

export function commitRequest(input: CommitInput): CommitRequest {
  return {
    namespace: input.namespace,
    key: input.key,
    token: u64(input.token),
    outcome: input.outcome === 'succeeded' ? 'OUTCOME_SUCCEEDED' : 'OUTCOME_FAILED',
    response: toBytes(input.response),
  };
}

export function heartbeatRequest(input: HeartbeatInput): { namespace: string; key: string; token: string; lease_ms: string } {
  return { namespace: input.namespace, key: input.key, token: u64(input.token), lease_ms: u64(input.leaseMs) };
}

export function renewed(reply: HeartbeatResponse): Renewed {
  return { leaseUntilMs: BigInt(reply.lease_until_ms), expiresAtMs: BigInt(reply.expires_at_ms) };
}

export function keyView(reply: GetResponse): KeyView {
  const states: Record<string, KeyView['state']> = {
    STATE_FREE: 'free',
    STATE_PENDING: 'pending',
    STATE_ABANDONED: 'abandoned',
    STATE_COMPLETED: 'completed',
  };
  const state = states[reply.state];
  if (state === undefined) throw protocolError(`state ${reply.state}`);
  return {
    state,
    token: BigInt(reply.token),
    attempt: reply.attempt,
    leaseUntilMs: BigInt(reply.lease_until_ms),
    expiresAtMs: BigInt(reply.expires_at_ms),
    outcome: reply.outcome === 'OUTCOME_UNSPECIFIED' ? undefined : outcomeOf(reply.outcome),
    response: Buffer.from(reply.response),
  };
}
