/** A typed client of `context_engine.v1.ContextEngine` over `@grpc/grpc-js`. */
import * as grpc from "@grpc/grpc-js";

import {
  DEFAULT_MAX_MESSAGE_BYTES,
  KEYED_METHODS,
  type MetadataInit,
  type ServiceConfig,
  type TlsOptions,
  callMetadata,
  channelCredentials,
  channelOptions,
  checkToken,
  keyedServiceConfig,
  packagedServiceConfig,
  tokenTransportOptions,
  unkeyedServiceConfig,
} from "./channel";
import { ContextEngineError, fromServiceError } from "./errors";
import { DecimalWriter } from "./int64";
import {
  BUILD_BASE_UNKNOWN,
  type BuildStats,
  type BuildTally,
  DEFAULT_MAX_SESSIONS,
  DeltaMismatchError,
  IncrementalBuilds,
  type Prepared,
} from "./incremental";
import {
  BuildRequest,
  BuildResponse,
  CarryWorkingStateRequest,
  type CarryWorkingStateResponse,
  CompactRequest,
  type CompactResponse,
  ContextEngineService,
  type DeepPartial,
  DeleteSessionRequest,
  type DeleteSessionResponse,
  GetPlanRequest,
  type GetPlanResponse,
  PlanRequest,
  type PlanResponse,
  ReportUsageRequest,
  type ReportUsageResponse,
  RotateRequest,
  type RotateResponse,
  UpdateWorkingStateRequest,
  type UpdateWorkingStateResponse,
} from "./gen/context_engine/v1/context_engine";

export interface ClientOptions {
  /** `host:port` of the service (any grpc-js target, e.g. `dns:ce.internal:443`). */
  target: string;
  /** Bearer token sent as `authorization: Bearer <token>` on every call. */
  token?: string;
  /** TLS settings. Without `tls` and without `insecure`, TLS with the system roots is used. */
  tls?: TlsOptions;
  /** Check the server's certificate against this name instead of the target's host. */
  serverName?: string;
  /**
   * Plaintext channel: a dev-mode server on loopback, or a hop another layer encrypts (a
   * service-mesh sidecar). With a token it is sent in plaintext, deliberately, as the Python
   * client's `tls=False` sends it; to a loopback target it goes straight, never through a
   * proxy of the environment.
   */
  insecure?: boolean;
  /** Deadline of every call, retries included, unless the call passes its own (default 10 s). */
  deadlineMs?: number;
  /**
   * Deadline of a `compact` call that passes none (default 60 s): Compact waits on an LLM
   * summarizer, which the service gives 20 s by default (CE_SUMMARIZER_TIMEOUT_SECONDS).
   */
  compactDeadlineMs?: number;
  /** Send and receive limit (default 64 MiB, the service's default receive limit). */
  maxMessageBytes?: number;
  /**
   * A gRPC service config (JSON text or object) replacing the packaged one
   * (`clients/retry_service_config.json`); its retry policy also retries keyed writes.
   */
  serviceConfig?: string | ServiceConfig;
  /** Extra grpc-js channel options (applied last). */
  channelOptions?: grpc.ChannelOptions;
  /**
   * Incremental Build (default on): each Build names the session's previous Build as its base
   * and sends only the checkpoint items past their common prefix; the response comes back
   * relative to the base's and `build()` returns it in full. `false` sends every Build whole;
   * an object sets how many sessions' last Builds are held (least recently used dropped).
   */
  incremental?: boolean | IncrementalOptions;
}

export interface IncrementalOptions {
  /** Sessions whose last Build is held (default 1,024). */
  maxSessions?: number;
}

export interface CallOptions {
  /** Deadline of this call, retries included, in milliseconds from now. */
  deadlineMs?: number;
  /**
   * Request metadata for this call (trace context, request ids): a grpc-js `Metadata` or a
   * plain record; binary values go under keys ending in `-bin`.
   */
  metadata?: MetadataInit;
  /** Cancels the call (it then fails with `CANCELLED`). */
  signal?: AbortSignal;
}

/** A request as the methods take it: any subset of the message's fields, nested likewise. */
export type Input<T> = DeepPartial<T>;

const DEFAULT_DEADLINE_MS = 10_000;
const DEFAULT_COMPACT_DEADLINE_MS = 60_000;

/** What the client needs of a generated message: fill in the defaults of a partial one, and
 * encode it. */
interface Fills<T> {
  fromPartial(object: DeepPartial<T>): T;
  encode(message: T, writer: DecimalWriter): { finish(): Uint8Array };
}

/**
 * The context-engine client. One instance holds its channel; share it and `close()` it at
 * shutdown. Every method resolves to the typed response or rejects with a
 * {@link ContextEngineError}.
 *
 * `UNAVAILABLE` is retried by grpc-js, as the channel's service config says (by default the
 * packaged `retry_service_config.json`): always for Plan, GetPlan, Build, UpdateWorkingState,
 * CarryWorkingState and DeleteSession; for Rotate, Compact and ReportUsage only when the request
 * carries an `idempotencyKey`, through a second channel (opened on first use) whose config adds
 * them.
 */
/**
 * A response that does not read back where no resend can mend it (a delta answering a Build
 * that named no base, or the whole resend's answer): INTERNAL, as every other failure of a
 * call is a ContextEngineError.
 */
function faulty(err: unknown): unknown {
  if (!(err instanceof DeltaMismatchError)) return err;
  return new ContextEngineError({ code: grpc.status.INTERNAL, method: "Build",
    details: `the service's answer does not read back: ${err.message}`, cause: err });
}

/** The longest wait `waitForReady` takes (2^31 - 1 ms, about 24.8 days): it waits on a Node
 * timer, which fires a longer one after 1 ms. (A call's deadline may be longer: grpc-js takes
 * one past it as none.) */
export const MAX_WAIT_MS = 2_147_483_647;

/** grpc-js throws, inside its own promise chain (the process dies of it), for a deadline 10^8
 * hours or more away: one that far is sent as no deadline. */
const NO_DEADLINE_FROM_MS = 1e8 * 3_600_000;

/** `ms` as a deadline: a positive, finite number of milliseconds (no more than `max`), else a
 * RangeError (and nothing is sent). */
function checkDeadlineMs(ms: unknown, max = Number.MAX_VALUE): number {
  if (typeof ms !== "number" || !(ms > 0) || !Number.isFinite(ms)) {
    throw new RangeError("deadlineMs must be a positive, finite number of milliseconds, " +
      `got ${String(ms)}`);
  }
  if (ms > max) {
    throw new RangeError(`deadlineMs must be at most ${max} here (a Node timer holds no more), ` +
      `got ${ms}`);
  }
  return ms;
}

export class ContextEngineClient {
  readonly target: string;
  private readonly channel: grpc.Client;
  private keyedChannel: grpc.Client | undefined;
  private closed = false; // a keyed channel is never opened after close()
  /** What close() ends: each call in flight and each pending waitForReady. */
  private readonly pending = new Set<() => void>();
  private readonly openKeyed: () => grpc.Client;
  private readonly token: string | undefined;
  private readonly deadlineMs: number;
  private readonly compactDeadlineMs: number;
  private readonly builds: IncrementalBuilds | undefined;

  constructor(options: ClientOptions) {
    this.token = checkToken(options.token);
    this.deadlineMs = checkDeadlineMs(options.deadlineMs ?? DEFAULT_DEADLINE_MS);
    this.compactDeadlineMs = checkDeadlineMs(options.compactDeadlineMs
      ?? DEFAULT_COMPACT_DEADLINE_MS);
    const credentials = channelCredentials(options.insecure, options.tls);
    const limit = options.maxMessageBytes ?? DEFAULT_MAX_MESSAGE_BYTES;
    const config = typeof options.serviceConfig === "string"
      ? JSON.parse(options.serviceConfig) as ServiceConfig
      : options.serviceConfig ?? packagedServiceConfig();
    const keyedConfig = keyedServiceConfig(config);
    const straight = tokenTransportOptions(options.target, options.insecure, this.token);
    const open = (c: ServiceConfig): grpc.Client => new grpc.Client(options.target, credentials,
      { ...channelOptions(c, limit, options.serverName), ...straight, ...options.channelOptions });
    this.target = options.target;
    const incremental = options.incremental ?? true;
    this.builds = incremental === false ? undefined : new IncrementalBuilds(
      incremental === true ? DEFAULT_MAX_SESSIONS
        : incremental.maxSessions ?? DEFAULT_MAX_SESSIONS);
    this.channel = open(unkeyedServiceConfig(config));
    this.openKeyed = () => open(keyedConfig);
  }

  /** Resolves the session's plan, creating epoch 1 or rotating when a pinned input changed. */
  plan(request: Input<PlanRequest>, options?: CallOptions): Promise<PlanResponse> {
    return this.call(ContextEngineService.plan, PlanRequest, request, options);
  }

  /** The current (`epoch` 0) or a given epoch's plan. Read-only. */
  getPlan(request: Input<GetPlanRequest>, options?: CallOptions): Promise<GetPlanResponse> {
    return this.call(ContextEngineService.getPlan, GetPlanRequest, request, options);
  }

  /**
   * One model request from the pinned plan and the checkpoint. Pure. Resolves to the full
   * response (`buildId` set, `delta` unset) whether or not it travelled as a delta: with
   * `incremental` on, a Build names the session's previous Build as its base and sends only
   * the items past their common prefix; a replica that does not hold that base answers
   * `BUILD_BASE_UNKNOWN` and the Build is sent again whole, once, within the same deadline.
   * A request that names a base itself is sent as it is and its response returned as received.
   */
  build(request: Input<BuildRequest>, options?: CallOptions): Promise<BuildResponse> {
    if (this.builds === undefined) {
      return this.call(ContextEngineService.build, BuildRequest, request, options);
    }
    return this.buildIncremental(this.builds, request, options ?? {});
  }

  /** What incremental Build moved so far (zeros with `incremental: false`). */
  buildStats(): BuildStats {
    return (this.builds ?? new IncrementalBuilds()).stats();
  }

  /** Drops the session's held Build: its next Build is sent whole. */
  forgetSession(tenantId: string, sessionId: string): void {
    this.builds?.forget(tenantId, sessionId);
  }

  /** An explicit new epoch; retried on `UNAVAILABLE` only with an idempotency key. */
  rotate(request: Input<RotateRequest>, options?: CallOptions): Promise<RotateResponse> {
    return this.call(ContextEngineService.rotate, RotateRequest, request, options);
  }

  /** Reports a sent request's actual usage; retried only with an idempotency key. */
  reportUsage(request: Input<ReportUsageRequest>,
              options?: CallOptions): Promise<ReportUsageResponse> {
    return this.call(ContextEngineService.reportUsage, ReportUsageRequest, request, options);
  }

  /**
   * Applies one working-state transition. Pure. Send the model's `context.update_working_state`
   * call as the provider returned it (`transition.toolCall`) and return the response's
   * `toolResult` to the model; a refused call rejects with a {@link ContextEngineError} whose
   * `toolResult` is the text to return instead.
   */
  updateWorkingState(request: Input<UpdateWorkingStateRequest>,
                     options?: CallOptions): Promise<UpdateWorkingStateResponse> {
    return this.call(ContextEngineService.updateWorkingState, UpdateWorkingStateRequest, request,
      options);
  }

  /** The next run's working state from the log's events below the seed sequence. Pure. */
  carryWorkingState(request: Input<CarryWorkingStateRequest>,
                    options?: CallOptions): Promise<CarryWorkingStateResponse> {
    return this.call(ContextEngineService.carryWorkingState, CarryWorkingStateRequest, request,
      options);
  }

  /** Compacts the oldest carried history into a summary; retried only with a key. */
  compact(request: Input<CompactRequest>, options?: CallOptions): Promise<CompactResponse> {
    return this.call(ContextEngineService.compact, CompactRequest, request,
                     { ...options, deadlineMs: options?.deadlineMs ?? this.compactDeadlineMs });
  }

  /**
   * Erases a session: its plans, events, compactions, usage rows and idempotency keys (audited,
   * no content kept). Idempotent (`deleted` is false when there was nothing to erase), so it is
   * retried; replicas stop serving it from their plan caches within `planCacheSeconds`. The
   * client forgets what it held of the session's last Build, and of a Build of the session
   * answered while the erasure runs.
   */
  async deleteSession(request: Input<DeleteSessionRequest>,
                      options?: CallOptions): Promise<DeleteSessionResponse> {
    this.forgetSession(request.tenantId ?? "", request.sessionId ?? "");
    try {
      return await this.call(ContextEngineService.deleteSession, DeleteSessionRequest, request,
        options);
    } finally {  // a Build answered meanwhile ran on what is being erased
      this.forgetSession(request.tenantId ?? "", request.sessionId ?? "");
    }
  }

  /**
   * Waits until the channel is connected, or rejects with a `DEADLINE_EXCEEDED`
   * {@link ContextEngineError} when the deadline passes (a `CANCELLED` one after `close()`).
   */
  waitForReady(deadlineMs = this.deadlineMs): Promise<void> {
    return new Promise((resolve, reject) => {
      if (this.closed) {  // before its deadline is read, as every call after close()
        reject(this.closedError("waitForReady"));
        return;
      }
      // a deadline that is no time rejects (RangeError), as a call's does
      const deadline = Date.now() + checkDeadlineMs(deadlineMs, MAX_WAIT_MS);
      // The channel's own states are watched, not grpc-js's Client.waitForReady: woken by the
      // channel's shutdown, that one asks the closed channel to connect again (and keeps its
      // timer, so the process, alive until the deadline). Here a wake after close() stops.
      const closing = (): void => reject(new ContextEngineError({ code: grpc.status.CANCELLED,
        method: "waitForReady", details: "the client was closed while waiting" }));
      this.pending.add(closing);
      const channel = this.channel.getChannel();
      const check = (err?: Error): void => {
        if (this.closed) return;  // close() rejected it; the closed channel is left alone
        if (err) {
          this.pending.delete(closing);
          reject(new ContextEngineError({ code: grpc.status.DEADLINE_EXCEEDED,
            method: "waitForReady", cause: err, details: "no connection before the deadline " +
              `(the channel is ${grpc.connectivityState[channel.getConnectivityState(false)]})` }));
          return;
        }
        const state = channel.getConnectivityState(true);
        if (state === grpc.connectivityState.READY) {
          this.pending.delete(closing);
          resolve();
          return;
        }
        channel.watchConnectivityState(state, deadline, check);
      };
      check();
    });
  }

  /**
   * Closes the channels. Calls in flight are cancelled: each rejects with a `CANCELLED`
   * {@link ContextEngineError} saying it may have reached the service; a pending
   * `waitForReady` rejects `CANCELLED` too. Every call after it rejects with a `CANCELLED`
   * one without sending anything.
   */
  close(): void {
    this.closed = true;
    const ending = [...this.pending];
    this.pending.clear();
    for (const end of ending) end();
    this.channel.close();
    this.keyedChannel?.close();
  }

  /** What a call made after close() rejects with: the typed error, nothing sent. */
  private closedError(method: string): ContextEngineError {
    return new ContextEngineError({ code: grpc.status.CANCELLED, method,
      details: "the client is closed: nothing was sent" });
  }

  private channelFor(method: string, request: { idempotencyKey?: string }): grpc.Client {
    if (!KEYED_METHODS.includes(method) || !request.idempotencyKey) {
      return this.channel;
    }
    this.keyedChannel ??= this.openKeyed();
    return this.keyedChannel;
  }

  private async buildIncremental(builds: IncrementalBuilds, input: Input<BuildRequest>,
                                 options: CallOptions): Promise<BuildResponse> {
    // before its deadline or the session's last Build is read: as every call after close()
    if (this.closed) throw this.closedError("Build");
    const request = BuildRequest.fromPartial(input);
    if (request.baseBuildId !== "" || request.baseItemsKept !== 0) {
      return this.call(ContextEngineService.build, BuildRequest, request, options);
    }
    // One deadline for the Build, a resend included.
    const deadline = this.deadlineOf(options);
    const tally: BuildTally = { incremental: false, fullResends: 0, requestBytes: 0,
      responseBytes: 0, fullRequestBytes: 0, fullResponseBytes: 0 };
    const attempt = async (prepared: Prepared): Promise<BuildResponse> => {
      tally.requestBytes += prepared.bytes.length;
      const [received, bytes] = await this.sendBuild(prepared.bytes, options, deadline);
      tally.responseBytes += bytes.length;
      const absorbed = builds.absorb(prepared, received, bytes);
      tally.incremental = absorbed.incremental;
      tally.fullRequestBytes = prepared.fullRequestBytes;
      tally.fullResponseBytes = absorbed.fullResponseBytes;
      return absorbed.response;
    };
    const first = builds.prepare(request);
    let response: BuildResponse;
    try {
      response = await attempt(first);
    } catch (err) {
      const resend = first.base !== undefined && (err instanceof DeltaMismatchError ||
        (err instanceof ContextEngineError && err.code === grpc.status.FAILED_PRECONDITION &&
         err.reason === BUILD_BASE_UNKNOWN));
      if (!resend) {
        builds.forget(request.tenantId, request.sessionId);
        throw faulty(err);
      }
      // the base is dropped, no forget counted: the resend is of the first attempt's turn, so
      // a forget since it began (the caller's) still keeps its answer from being held
      builds.drop(request.tenantId, request.sessionId);
      tally.fullResends += 1;
      if (Date.now() >= deadline) {  // nothing is sent past the Build's deadline
        throw new ContextEngineError({ code: grpc.status.DEADLINE_EXCEEDED, method: "Build",
          details: "the Build's deadline passed before it could be sent again whole",
          cause: err });
      }
      // the Build the first attempt sent, its items as copied then: the caller's request is not
      // read again, as the caller may have changed it meanwhile (a reasoning item's buffer)
      const sent: BuildRequest = request.checkpoint === undefined ? request : { ...request,
        checkpoint: { ...request.checkpoint, items: first.items.map((held) => held.item) } };
      try {
        response = await attempt(builds.prepare(sent, true, first.mark));
      } catch (again) {
        builds.forget(request.tenantId, request.sessionId);
        throw faulty(again);
      }
    }
    builds.count(tally);
    return response;
  }

  /** Sends serialized Build bytes; resolves to the response and the bytes it arrived as. */
  private sendBuild(bytes: Uint8Array, options: CallOptions,
                    deadline: number): Promise<[BuildResponse, Buffer]> {
    const { path } = ContextEngineService.build;
    const wire = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    return this.unary<[BuildResponse, Buffer]>(path, "Build", this.channel, () => wire,
      (buf: Buffer) => [BuildResponse.decode(buf), buf], null, options, deadline);
  }

  /** The call's deadline (epoch ms): its own `deadlineMs`, else the client's. */
  private deadlineOf(options: CallOptions): number {
    const ms = checkDeadlineMs(options.deadlineMs ?? this.deadlineMs);
    return ms >= NO_DEADLINE_FROM_MS ? Infinity : Date.now() + ms;
  }

  private call<Req, Res>(definition: grpc.MethodDefinition<Req, Res>, type: Fills<Req>,
                         input: DeepPartial<Req>, options: CallOptions = {}): Promise<Res> {
    const method = definition.path.slice(definition.path.lastIndexOf("/") + 1);
    // a keyed write too: no channel is opened after close()
    if (this.closed) return Promise.reject(this.closedError(method));
    let deadline: number;
    let bytes: Uint8Array;
    let channel: grpc.Client;
    try {
      deadline = this.deadlineOf(options);
      const request = type.fromPartial(input);
      // encoded here, not by grpc-js (which would fail the call INTERNAL, "Request message
      // serialization failure"): a request that cannot be encoded (an int64 that is not a
      // decimal string) rejects with the encoder's error, and nothing is sent
      bytes = type.encode(request, new DecimalWriter()).finish();
      // opened here on the first keyed write: a service config grpc-js refuses rejects the
      // call, not throws out of it
      channel = this.channelFor(method, request as { idempotencyKey?: string });
    } catch (err) {
      return Promise.reject(err);
    }
    const wire = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    return this.unary<Res>(definition.path, method, channel,
      () => wire, definition.responseDeserialize, null, options, deadline);
  }

  private unary<Res>(path: string, method: string, channel: grpc.Client,
                     serialize: (value: never) => Buffer, deserialize: (bytes: Buffer) => Res,
                     request: unknown, options: CallOptions, deadline: number): Promise<Res> {
    return new Promise<Res>((resolve, reject) => {
      const { signal } = options;
      if (signal?.aborted) {
        reject(new ContextEngineError({ code: grpc.status.CANCELLED, method,
          details: "cancelled before the call", cause: signal.reason }));
        return;
      }
      if (this.closed) {  // every path: a call, a Build, the resend of a Build
        reject(this.closedError(method));
        return;
      }
      let call: grpc.ClientUnaryCall;
      let closedDuring = false;
      const cancel = (): void => call.cancel();
      const closing = (): void => {  // grpc-js lets calls in flight run on after close()
        closedDuring = true;
        call.cancel();
      };
      try {
        call = channel.makeUnaryRequest(
          path, serialize as (value: unknown) => Buffer, deserialize, request,
          callMetadata(this.token, options.metadata), { deadline },
          (err: grpc.ServiceError | null, value?: Res) => {
            signal?.removeEventListener("abort", cancel);
            this.pending.delete(closing);
            if (err && closedDuring && !signal?.aborted && err.code === grpc.status.CANCELLED) {
              reject(new ContextEngineError({ code: grpc.status.CANCELLED, method, cause: err,
                details: "the client was closed during the call: it may have reached the service",
              }));
            } else if (err) {
              reject(fromServiceError(err, method));
            } else {
              resolve(value as Res);
            }
          });
      } catch (err) {
        // A request that cannot be encoded, or metadata grpc-js refuses: nothing was sent.
        reject(err);
        return;
      }
      this.pending.add(closing);
      signal?.addEventListener("abort", cancel, { once: true });
    });
  }
}
