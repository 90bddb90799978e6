/**
 * The oncegate client for Node: {@link Client} (gRPC, token, TLS, deadlines, retries,
 * sessions), {@link once}, canonical fingerprints, {@link TradeKey}, and (from
 * `oncegate/express`) the Idempotency-Key middleware.
 */
export { Client, Session } from './client';
export type { ClientOptions, TlsOptions, Transport } from './client';
export { once, LEASE_DEFAULT_MS, WAIT_DEFAULT_MS, COMMIT_RETRY_FOR_DEFAULT_MS } from './once';
export type { Lease, OnceOptions, OnceResult, WorkResult } from './once';
export { GateError, OnceError, RetryableError, FinalError, UnknownError, isRetryableCode } from './errors';
export type { Code, OnceErrorKind } from './errors';
export {
  canonicalJson,
  canonicalValue,
  fingerprintJson,
  fingerprintValue,
  fingerprintCanonical,
  parseJson,
  JsonSyntaxError,
  FINGERPRINT_FORMAT,
} from './fingerprint';
export type { JsonNode } from './fingerprint';
export { TradeKey, derivedKey } from './keys';
export type { TradeKeyInit, DerivedKey } from './keys';
export { DEFAULT_RETRY, NO_RETRY } from './retry';
export type { RetryPolicy } from './retry';
export type * from './types';
