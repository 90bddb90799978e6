/**
 * Calls multiplexed over one `Session` stream (crates/oncegate-client/src/session.rs):
 * many calls in flight on one HTTP/2 stream, answered out of order and matched by id. A
 * call carries the time its caller has left (`timeout_ms`); a caller that gives up before
 * its answer (its timeout passed, its signal aborted) has a `cancel` sent for its call, so
 * that the server drops it as it drops a unary call whose client went away. No more calls
 * are kept in flight than the server's `oncegate-session-calls-in-flight-max`; the rest
 * wait here, unsent, so a cancel is always read as it arrives.
 */
import type * as grpc from '@grpc/grpc-js';
import { GateError, codeOfGrpc, parseCode } from './errors';
import { protocolError } from './convert';
import type {
  CommitRequest,
  CommitResponse,
  GateClient,
  GetRequest,
  GetResponse,
  HeartbeatRequest,
  HeartbeatResponse,
  ReleaseRequest,
  ReleaseResponse,
  ReserveRequest,
  ReserveResponse,
  SessionRequest,
  SessionResponse,
} from './proto';

/** The calls of the gate, by their name on the wire (the oneof's field). */
export interface Calls {
  reserve: [ReserveRequest, ReserveResponse];
  commit: [CommitRequest, CommitResponse];
  release: [ReleaseRequest, ReleaseResponse];
  heartbeat: [HeartbeatRequest, HeartbeatResponse];
  get: [GetRequest, GetResponse];
}

/** A call's name. */
export type CallKind = keyof Calls;

/** The response header giving the most calls the server keeps in flight on a stream. */
export const SESSION_CALLS_IN_FLIGHT_MAX_METADATA = 'oncegate-session-calls-in-flight-max';

interface Pending {
  id: string;
  kind: CallKind;
  message: Calls[CallKind][0];
  /** When the caller stops waiting (performance.now()). */
  endsAt: number;
  sent: boolean;
  resolve: (reply: Calls[CallKind][1]) => void;
  reject: (error: unknown) => void;
  cleanup: () => void;
}

/** A refused session call, as the unary call's status would have said it. */
export function refusalError(refusal: NonNullable<SessionResponse['refusal']>): GateError {
  return new GateError({
    code: parseCode(refusal.code) ?? codeOfGrpc(refusal.grpc_code),
    grpcCode: refusal.grpc_code,
    message: refusal.message,
    field: refusal.field === '' ? undefined : refusal.field,
    limit: refusal.limit === '' ? undefined : refusal.limit,
  });
}

/** One open `Session` stream. Opened by {@link SessionStream.open}; ended by {@link close}. */
export class SessionStream {
  private readonly stream: grpc.ClientDuplexStream<SessionRequest, SessionResponse>;
  private readonly waiting = new Map<string, Pending>();
  private readonly queue: Pending[] = [];
  private nextId = 1n;
  private inFlightMax = Number.POSITIVE_INFINITY;
  private endedWith: GateError | undefined;
  /** Settles when the server answered the stream's headers (or refused it). */
  readonly ready: Promise<void>;

  private constructor(gate: GateClient, metadata: grpc.Metadata) {
    this.stream = gate.Session(metadata);
    this.ready = new Promise<void>((resolve, reject) => {
      this.stream.once('metadata', (headers: grpc.Metadata) => {
        const limit = Number(headers.get(SESSION_CALLS_IN_FLIGHT_MAX_METADATA)[0]);
        if (Number.isInteger(limit) && limit > 0) this.inFlightMax = limit;
        resolve();
      });
      this.stream.once('error', (error: grpc.ServiceError) => reject(GateError.fromStatus(error)));
    });
    // Handled where awaited; this keeps an early refusal from being unhandled.
    this.ready.catch(() => undefined);
    this.stream.on('data', (answer: SessionResponse) => this.answered(answer));
    this.stream.on('error', (error: grpc.ServiceError) => this.end(GateError.fromStatus(error)));
    this.stream.on('end', () => this.end(GateError.unanswered('the session stream ended')));
    this.stream.on('close', () => this.end(GateError.unanswered('the session stream closed')));
  }

  /** Opens a stream on `gate` with `metadata` (the bearer token). */
  static open(gate: GateClient, metadata: grpc.Metadata): SessionStream {
    return new SessionStream(gate, metadata);
  }

  /** Whether the stream has ended (a new one must be opened for further calls). */
  get ended(): boolean {
    return this.endedWith !== undefined;
  }

  /** The most calls this stream keeps in flight (the server's limit). */
  get callsInFlightMax(): number {
    return this.inFlightMax;
  }

  /**
   * Sends one call and waits for its answer, at most `timeoutMs`; a refusal rejects
   * with its {@link GateError}, as the unary call would.
   */
  async call<K extends CallKind>(kind: K, message: Calls[K][0], timeoutMs: number, signal?: AbortSignal): Promise<Calls[K][1]> {
    const endsAt = performance.now() + timeoutMs;
    await this.ready;
    if (this.endedWith !== undefined) throw this.endedWith;
    signal?.throwIfAborted();
    return new Promise<Calls[K][1]>((resolve, reject) => {
      const id = String(this.nextId);
      this.nextId += 1n;
      const giveUp = (error: GateError): void => this.giveUp(id, error);
      const left = Math.max(0, endsAt - performance.now());
      const timer = setTimeout(() => giveUp(GateError.unanswered(`no answer within ${Math.round(timeoutMs)} ms`)), left);
      const onAbort = (): void => giveUp(GateError.unanswered('the call was given up by its caller', signal?.reason));
      signal?.addEventListener('abort', onAbort, { once: true });
      const pending: Pending = {
        id,
        kind,
        message,
        endsAt,
        sent: false,
        resolve: resolve as Pending['resolve'],
        reject,
        cleanup: () => {
          clearTimeout(timer);
          signal?.removeEventListener('abort', onAbort);
        },
      };
      if (this.waiting.size < this.inFlightMax && this.queue.length === 0) this.send(pending);
      else this.queue.push(pending);
    });
  }

  /** Ends the stream; calls still waiting fail with `unavailable`. */
  close(): void {
    this.end(GateError.unanswered('the session was closed'));
    this.stream.cancel();
  }

  private send(pending: Pending): void {
    const left = Math.ceil(pending.endsAt - performance.now());
    if (left <= 0) {
      // Its caller has given up already: a reserve granted now would hold the key for nobody.
      pending.cleanup();
      pending.reject(GateError.unanswered('the call timed out before it was sent'));
      return;
    }
    pending.sent = true;
    this.waiting.set(pending.id, pending);
    const request: SessionRequest = { id: pending.id, timeout_ms: String(left), [pending.kind]: pending.message };
    this.stream.write(request);
  }

  private pump(): void {
    while (this.queue.length > 0 && this.waiting.size < this.inFlightMax && this.endedWith === undefined) {
      this.send(this.queue.shift() as Pending);
    }
  }

  private giveUp(id: string, error: GateError): void {
    const sent = this.waiting.get(id);
    if (sent !== undefined) {
      this.waiting.delete(id);
      if (this.endedWith === undefined) this.stream.write({ id, cancel: {} });
      sent.cleanup();
      sent.reject(error);
      this.pump();
      return;
    }
    const at = this.queue.findIndex((p) => p.id === id);
    if (at >= 0) {
      const [queued] = this.queue.splice(at, 1) as [Pending];
      queued.cleanup();
      queued.reject(error);
    }
  }

  private answered(answer: SessionResponse): void {
    const pending = this.waiting.get(answer.id);
    if (pending === undefined) return; // a call given up already
    this.waiting.delete(answer.id);
    pending.cleanup();
    if (answer.result === 'refusal' && answer.refusal) pending.reject(refusalError(answer.refusal));
    else if (answer.result === pending.kind && answer[pending.kind]) pending.resolve(answer[pending.kind] as Calls[CallKind][1]);
    else pending.reject(protocolError(`a ${pending.kind} was answered with ${answer.result ?? 'nothing'}`));
    this.pump();
  }

  private end(error: GateError): void {
    if (this.endedWith !== undefined) return;
    this.endedWith = error;
    for (const pending of [...this.waiting.values(), ...this.queue]) {
      pending.cleanup();
      pending.reject(error);
    }
    this.waiting.clear();
    this.queue.length = 0;
  }
}
