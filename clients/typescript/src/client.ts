/**
 * The remote gate: `oncegate.v1.Gate` over gRPC (@grpc/grpc-js), with a bearer token, TLS
 * (and client certificates for mutual TLS), a deadline per call, jittered retries of the
 * calls that are safe to repeat, and calls over a `Session` stream
 * (crates/oncegate-client/src/client.rs).
 */
import * as fs from 'node:fs';
import * as grpc from '@grpc/grpc-js';
import { GateError } from './errors';
import { commitRequest, heartbeatRequest, keyView, renewed, reserveRequest, reserved } from './convert';
import { protoPackage } from './proto';
import type { GateClient } from './proto';
import { DEFAULT_RETRY, withRetries } from './retry';
import type { RetryPolicy } from './retry';
import { SessionStream } from './session';
import type { CallKind, Calls } from './session';
import type {
  CallOptions,
  CommitInput,
  HeartbeatInput,
  HeldKey,
  KeySpec,
  KeyView,
  Renewed,
  ReserveInput,
  Reserved,
} from './types';

/** TLS settings: PEM contents or file paths. */
export interface TlsOptions {
  /** CA certificate(s) to trust instead of the system's roots (PEM). */
  ca?: string | Buffer;
  /** A file holding {@link ca}. */
  caFile?: string;
  /** This client's certificate chain, for mutual TLS (PEM). */
  cert?: string | Buffer;
  certFile?: string;
  /** This client's private key, for mutual TLS (PEM). */
  key?: string | Buffer;
  keyFile?: string;
  /** The name the server's certificate must carry, when it is not the address's host. */
  serverName?: string;
}

/** How calls travel. */
export type Transport =
  /** Non-waiting calls multiplexed over one `Session` stream (opened on first use, again after it ends); reserves that may wait go as unary calls; a server without `Session` gets unary calls. */
  | 'session'
  /** One unary RPC per call. */
  | 'unary';

/** How to reach a server. */
export interface ClientOptions {
  /** `host:port`, `http://host:port`, or `https://host:port` (TLS). */
  address: string;
  /** The tenant's bearer token, sent as `authorization: Bearer <token>`. */
  token?: string;
  /** TLS settings; implied by an `https://` address. */
  tls?: TlsOptions | boolean;
  /** The longest one call may take, in milliseconds (a reserve's `waitMs` is added); default 10 s. */
  timeoutMs?: number;
  /** How failed calls are retried; default 5 tries with jittered back-off from 25 ms to 1 s. */
  retry?: Partial<RetryPolicy>;
  /** How calls travel; default `session`. */
  transport?: Transport;
  /** Further `@grpc/grpc-js` channel options. */
  channelOptions?: grpc.ChannelOptions;
}

const METHODS = { reserve: 'Reserve', commit: 'Commit', release: 'Release', heartbeat: 'Heartbeat', get: 'Get' } as const;

function pem(value: string | Buffer | undefined, file: string | undefined): Buffer | null {
  if (value !== undefined) return Buffer.isBuffer(value) ? value : Buffer.from(value);
  if (file !== undefined) return fs.readFileSync(file);
  return null;
}

/** The target and credentials of an address with its TLS settings. */
function endpoint(options: ClientOptions): { target: string; credentials: grpc.ChannelCredentials; channel: grpc.ChannelOptions } {
  const match = /^(https?):\/\/(.*?)\/?$/.exec(options.address);
  const scheme = match?.[1];
  const target = match?.[2] ?? options.address;
  const tls = options.tls === true ? {} : options.tls === false ? undefined : options.tls;
  if (scheme === 'http' && tls !== undefined) {
    throw new TypeError(`TLS settings need an https:// address; ${options.address} is plaintext`);
  }
  const channel: grpc.ChannelOptions = { ...options.channelOptions };
  if (scheme !== 'https' && tls === undefined) return { target, credentials: grpc.credentials.createInsecure(), channel };
  const settings = tls ?? {};
  const key = pem(settings.key, settings.keyFile);
  const cert = pem(settings.cert, settings.certFile);
  if ((key === null) !== (cert === null)) throw new TypeError('mutual TLS needs both a certificate and its key');
  if (settings.serverName !== undefined) {
    channel['grpc.ssl_target_name_override'] = settings.serverName;
    channel['grpc.default_authority'] = settings.serverName;
  }
  return { target, credentials: grpc.credentials.createSsl(pem(settings.ca, settings.caFile), key, cert), channel };
}

/**
 * A connection to an oncegate server. Call {@link close} when done: an open channel (and
 * session stream) keeps the process alive.
 */
export class Client {
  /** The generated, typed stub (for calls this class does not wrap). */
  readonly gate: GateClient;
  private readonly token: string | undefined;
  private readonly timeoutMs: number;
  private readonly retry: RetryPolicy;
  private readonly transport: Transport;
  private stream: SessionStream | undefined;
  /** Set once the server answered that it has no `Session` call. */
  private unaryOnly = false;

  constructor(options: ClientOptions) {
    const { target, credentials, channel } = endpoint(options);
    const Gate = protoPackage().oncegate.v1.Gate;
    this.gate = new Gate(target, credentials, channel);
    this.token = options.token;
    this.timeoutMs = options.timeoutMs ?? 10_000;
    this.retry = { ...DEFAULT_RETRY, ...options.retry };
    this.transport = options.transport ?? 'session';
  }

  /** The metadata of every call: the bearer token, if any. */
  metadata(): grpc.Metadata {
    const metadata = new grpc.Metadata();
    if (this.token !== undefined) metadata.set('authorization', `Bearer ${this.token}`);
    return metadata;
  }

  /** The default deadline of one call, in milliseconds. */
  get defaultTimeoutMs(): number {
    return this.timeoutMs;
  }

  /** Asks whether this attempt may proceed (retried on `unavailable` and `resource_exhausted`). */
  async reserve(input: ReserveInput, options: CallOptions = {}): Promise<Reserved> {
    const message = reserveRequest(input);
    const reply = await this.retried('reserve', message, options, input.waitMs ?? 0);
    return reserved(reply);
  }

  /** Stores the holder's outcome and response; returns when the record expires. */
  async commit(input: CommitInput, options: CallOptions = {}): Promise<{ expiresAtMs: bigint }> {
    const reply = await this.retried('commit', commitRequest(input), options);
    return { expiresAtMs: BigInt(reply.expires_at_ms) };
  }

  /** Gives the key up so that a retry may proceed. */
  async release(input: HeldKey, options: CallOptions = {}): Promise<void> {
    await this.retried('release', { namespace: input.namespace, key: input.key, token: input.token.toString() }, options);
  }

  /** Renews the holder's lease. */
  async heartbeat(input: HeartbeatInput, options: CallOptions = {}): Promise<Renewed> {
    return renewed(await this.retried('heartbeat', heartbeatRequest(input), options));
  }

  /** Reads a key's state without changing it. */
  async get(input: Pick<KeySpec, 'namespace'> & { key: string }, options: CallOptions = {}): Promise<KeyView> {
    return keyView(await this.retried('get', { namespace: input.namespace, key: input.key }, options));
  }

  /**
   * A {@link Session} of its own: calls on one dedicated `Session` stream, matched by id
   * (not retried; a refused call rejects with its {@link GateError}).
   */
  openSession(): Session {
    return new Session(SessionStream.open(this.gate, this.metadata()), this.timeoutMs);
  }

  /** Closes the session stream and the channel. */
  close(): void {
    this.stream?.close();
    this.stream = undefined;
    this.gate.close();
  }

  private retried<K extends CallKind>(kind: K, message: Calls[K][0], options: CallOptions, waitMs = 0): Promise<Calls[K][1]> {
    return withRetries(this.retry, () => this.call(kind, message, options, waitMs));
  }

  /** One call, on the session stream or as a unary RPC, within the deadline plus `waitMs`. */
  private async call<K extends CallKind>(kind: K, message: Calls[K][0], options: CallOptions, waitMs: number): Promise<Calls[K][1]> {
    const timeoutMs = (options.timeoutMs ?? this.timeoutMs) + waitMs;
    // A reserve that may wait goes as a unary call: parked on the server it must not hold
    // up the stream's other calls (a holder's heartbeat behind a crowd of waiters).
    if (this.transport === 'session' && waitMs === 0 && !this.unaryOnly) {
      try {
        return await this.sessionStream().call(kind, message, timeoutMs, options.signal);
      } catch (error) {
        if (!(error instanceof GateError)) throw error;
        if (error.grpcCode === grpc.status.UNIMPLEMENTED) this.unaryOnly = true;
        // Refused a stream (the tenant's `sessions_max`): this call goes unary.
        else if (!(error.grpcCode === grpc.status.RESOURCE_EXHAUSTED && this.stream?.ended)) throw error;
      }
    }
    return this.unary(kind, message, timeoutMs, options.signal);
  }

  private sessionStream(): SessionStream {
    if (this.stream === undefined || this.stream.ended) this.stream = SessionStream.open(this.gate, this.metadata());
    return this.stream;
  }

  private unary<K extends CallKind>(kind: K, message: Calls[K][0], timeoutMs: number, signal?: AbortSignal): Promise<Calls[K][1]> {
    return new Promise((resolve, reject) => {
      signal?.throwIfAborted();
      const method = this.gate[METHODS[kind]].bind(this.gate) as unknown as (
        message: Calls[K][0],
        metadata: grpc.Metadata,
        options: grpc.CallOptions,
        callback: (error: grpc.ServiceError | null, reply?: Calls[K][1]) => void,
      ) => grpc.ClientUnaryCall;
      const onAbort = (): void => call.cancel();
      const call = method(message, this.metadata(), { deadline: Date.now() + timeoutMs }, (error, reply) => {
        signal?.removeEventListener('abort', onAbort);
        if (error) reject(GateError.fromStatus(error));
        else if (reply === undefined) reject(GateError.unanswered('an empty answer'));
        else resolve(reply);
      });
      signal?.addEventListener('abort', onAbort, { once: true });
    });
  }
}

/** Calls over one `Session` stream (see {@link Client.openSession}). */
export class Session {
  constructor(
    private readonly stream: SessionStream,
    private readonly timeoutMs: number,
  ) {}

  /** Waits until the server accepted the stream (rejects with its refusal). */
  ready(): Promise<void> {
    return this.stream.ready;
  }

  /** The server's limit of calls in flight on this stream (`Infinity` when it gives none). */
  get callsInFlightMax(): number {
    return this.stream.callsInFlightMax;
  }

  async reserve(input: ReserveInput, options: CallOptions = {}): Promise<Reserved> {
    const timeout = (options.timeoutMs ?? this.timeoutMs) + (input.waitMs ?? 0);
    return reserved(await this.stream.call('reserve', reserveRequest(input), timeout, options.signal));
  }

  async commit(input: CommitInput, options: CallOptions = {}): Promise<{ expiresAtMs: bigint }> {
    const reply = await this.stream.call('commit', commitRequest(input), options.timeoutMs ?? this.timeoutMs, options.signal);
    return { expiresAtMs: BigInt(reply.expires_at_ms) };
  }

  async release(input: HeldKey, options: CallOptions = {}): Promise<void> {
    const message = { namespace: input.namespace, key: input.key, token: input.token.toString() };
    await this.stream.call('release', message, options.timeoutMs ?? this.timeoutMs, options.signal);
  }

  async heartbeat(input: HeartbeatInput, options: CallOptions = {}): Promise<Renewed> {
    return renewed(await this.stream.call('heartbeat', heartbeatRequest(input), options.timeoutMs ?? this.timeoutMs, options.signal));
  }

  async get(input: { namespace: string; key: string }, options: CallOptions = {}): Promise<KeyView> {
    return keyView(await this.stream.call('get', input, options.timeoutMs ?? this.timeoutMs, options.signal));
  }

  /** Ends the stream; calls still waiting fail with `unavailable`. */
  close(): void {
    this.stream.close();
  }
}
