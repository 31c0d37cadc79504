/**
 * Client behaviour against an in-process grpc-js server that serves the generated service
 * definition: which calls grpc-js retries on UNAVAILABLE under the packaged service config
 * (and under a caller's), the bearer token and per-call metadata, deadlines, cancellation and
 * decoding of `grpc-status-details-bin` with the generated google.rpc types. Needs no
 * context-engine server.
 */
import assert from "node:assert/strict";
import * as fs from "node:fs";
import * as net from "node:net";
import * as path from "node:path";
import { after, before, beforeEach, describe, test } from "node:test";

import * as grpc from "@grpc/grpc-js";

import {
  type CarryWorkingStateRequest,
  CarryWorkingStateResponse,
  ContextEngineClient,
  ContextEngineError,
  ContextEngineService,
  DeleteSessionResponse,
  GetPlanResponse,
  GrpcStatus,
  KEYED_METHODS,
  Metadata,
  PACKAGE_ROOT,
  PROTO_DIR,
  RotateResponse,
  SERVICE,
  type ServiceConfig,
  googleRpc,
  isLoopback,
  keyedServiceConfig,
  packagedServiceConfig,
  parseStatusDetails,
  retryPolicyOf,
  tokenTransportOptions,
  unkeyedServiceConfig,
} from "../src";

const POLICY = retryPolicyOf(packagedServiceConfig())!;
const CODE = grpc.status;

/** A `google.rpc.Status` as the service sends it, built with the generated types. */
function statusDetails(code: grpc.status, message: string): Buffer {
  const pack = (type: string, value: Uint8Array) =>
    googleRpc.Any.fromPartial({ typeUrl: `type.googleapis.com/${type}`,
      value: Buffer.from(value) });
  return Buffer.from(googleRpc.Status.encode(googleRpc.Status.fromPartial({ code, message,
    details: [
      pack("google.rpc.ErrorInfo", googleRpc.ErrorInfo.encode(googleRpc.ErrorInfo.fromPartial({
        reason: "PREFIX_CLASS_OVER_CAP", domain: "context-engine",
        metadata: { class: "persona", tokens: "900", cap: "800" } })).finish()),
      pack("google.rpc.BadRequest", googleRpc.BadRequest.encode(googleRpc.BadRequest.fromPartial({
        fieldViolations: [{ field: "persona.entries[0].text", description: "too long" }] }))
        .finish()),
      pack("google.rpc.LocalizedMessage", googleRpc.LocalizedMessage.encode(
        googleRpc.LocalizedMessage.fromPartial({ locale: "en-US", message: "shorten it" }))
        .finish()),
      pack("google.rpc.RetryInfo", googleRpc.RetryInfo.encode(googleRpc.RetryInfo.fromPartial({
        retryDelay: { seconds: "1", nanos: 500_000_000 } })).finish()),
      pack("google.rpc.DebugInfo", googleRpc.DebugInfo.encode(googleRpc.DebugInfo.fromPartial({
        detail: "not read by the client" })).finish()),
    ] })).finish());
}

function failure(code: grpc.status, details = codeNameOf(code),
                 metadata = new grpc.Metadata()): grpc.ServerErrorResponse {
  return Object.assign(new Error(details), { code, details, metadata });
}

function codeNameOf(code: grpc.status): string {
  return grpc.status[code] ?? String(code);
}

type Handler = (call: grpc.ServerUnaryCall<unknown, unknown>,
                callback: grpc.sendUnaryData<unknown>) => void;

describe("client behaviour", () => {
  const server = new grpc.Server();
  /** Calls per RPC (the attempts the server saw). */
  const calls: Record<string, number> = {};
  /** Every attempt's request metadata, per RPC. */
  const seen: Record<string, grpc.Metadata[]> = {};
  /** The last attempt's time left until its deadline (ms), per RPC, as the server sees it. */
  const left: Record<string, number> = {};
  /** Attempts answered UNAVAILABLE before the next succeeds. */
  let failFirst = 0;
  let failWith: grpc.status = CODE.UNAVAILABLE;
  /** A `grpc-status-details-bin` trailer updateWorkingState fails with, as it is. */
  let trailer: Buffer | undefined;
  /** The grpc-message updateWorkingState fails with (default: the code's name). */
  let failMessage: string | undefined;
  let address = "";
  let client: ContextEngineClient;
  const opened: ContextEngineClient[] = [];

  const plan = { epoch: 3, prefixSha256: "ab".repeat(32) };
  const handlers: Record<string, Handler> = {
    getPlan: (_call, cb) => {
      if (calls.getPlan! <= failFirst) return cb(failure(failWith));
      cb(null, GetPlanResponse.fromPartial({ plan }));
    },
    rotate: (_call, cb) => {
      if (calls.rotate! <= failFirst) return cb(failure(failWith));
      cb(null, RotateResponse.fromPartial({ rotated: true, plan }));
    },
    compact: (_call, cb) => cb(failure(CODE.UNAVAILABLE)),
    deleteSession: (_call, cb) => {
      if (calls.deleteSession! <= failFirst) return cb(failure(failWith));
      cb(null, DeleteSessionResponse.fromPartial({ deleted: true, planCacheSeconds: 60 }));
    },
    reportUsage: (_call, cb) => cb(failure(CODE.UNAVAILABLE)),
    plan: (_call, cb) => {
      const md = new grpc.Metadata();
      md.set("grpc-status-details-bin", statusDetails(CODE.FAILED_PRECONDITION,
        "persona over its cap"));
      cb(failure(CODE.FAILED_PRECONDITION, "persona over its cap", md));
    },
    build: () => { /* never answers: the deadline must fire */ },
    updateWorkingState: (_call, cb) => {
      const md = new grpc.Metadata();
      if (trailer !== undefined) md.set("grpc-status-details-bin", trailer);
      cb(failure(failWith, failMessage ?? codeNameOf(failWith), md));
    },
    carryWorkingState: (call, cb) => {
      carried.push((call.request as CarryWorkingStateRequest).seedEventSequence);
      cb(null, CarryWorkingStateResponse.fromPartial({}));
    },
  };
  /** The seed sequence of each CarryWorkingState the server decoded. */
  const carried: string[] = [];

  function open(options: Partial<ConstructorParameters<typeof ContextEngineClient>[0]> = {}) {
    const made = new ContextEngineClient({ target: address, insecure: true, token: "s3cret",
      deadlineMs: 5_000, ...options });
    opened.push(made);
    return made;
  }

  function previousAttempts(rpc: string): string[] {
    return (seen[rpc] ?? []).map((md) => String(md.get("grpc-previous-rpc-attempts")[0] ?? ""));
  }

  before(async () => {
    const impl: grpc.UntypedServiceImplementation = {};
    for (const name of Object.keys(ContextEngineService)) {
      impl[name] = ((call: grpc.ServerUnaryCall<unknown, unknown>,
                     cb: grpc.sendUnaryData<unknown>) => {
        calls[name] = (calls[name] ?? 0) + 1;
        (seen[name] ??= []).push(call.metadata);
        const deadline = call.getDeadline();
        left[name] = (deadline instanceof Date ? deadline.getTime() : Number(deadline))
          - Date.now();
        const handler = handlers[name];
        if (handler) handler(call, cb);
        else cb(failure(CODE.UNIMPLEMENTED, name));
      }) as grpc.handleUnaryCall<unknown, unknown>;
    }
    server.addService(ContextEngineService, impl);
    const port = await new Promise<number>((resolve, reject) => server.bindAsync(
      "127.0.0.1:0", grpc.ServerCredentials.createInsecure(),
      (err, p) => (err ? reject(err) : resolve(p))));
    address = `127.0.0.1:${port}`;
    client = open();
  });

  after(() => {
    for (const c of opened) c.close();
    server.forceShutdown();
  });

  beforeEach(() => {
    for (const key of Object.keys(calls)) delete calls[key];
    for (const key of Object.keys(seen)) delete seen[key];
    failFirst = 0;
    failWith = CODE.UNAVAILABLE;
    trailer = undefined;
    failMessage = undefined;
  });

  test("the packaged service config is the repository's retry_service_config.json", () => {
    const shared = path.resolve(PACKAGE_ROOT, "..", "retry_service_config.json");
    assert.deepEqual(packagedServiceConfig(), JSON.parse(fs.readFileSync(shared, "utf8")));
    assert.equal(POLICY.maxAttempts, 4);
    assert.deepEqual(POLICY.retryableStatusCodes, ["UNAVAILABLE"]);
    assert.ok(fs.existsSync(path.join(PROTO_DIR, "context_engine", "v1", "context_engine.proto")),
      "the contract is copied into the package");
  });

  test("the keyed channel's config adds the writes under the same retry policy", () => {
    const config = packagedServiceConfig();
    const keyed = keyedServiceConfig(config);
    const retried = (c: ServiceConfig) => (c.methodConfig ?? [])
      .filter((m) => m.retryPolicy !== undefined)
      .flatMap((m) => m.name.map((n) => n.method)).sort();
    assert.deepEqual(retried(config),
      ["Build", "CarryWorkingState", "DeleteSession", "GetPlan", "Plan", "UpdateWorkingState"]);
    assert.deepEqual(retried(keyed), [...retried(config), ...KEYED_METHODS].sort());
    for (const entry of keyed.methodConfig ?? []) assert.deepEqual(entry.retryPolicy, POLICY);
    assert.ok((keyed.methodConfig ?? []).every((m) => m.name.every((n) => n.service === SERVICE)));
    assert.deepEqual(keyed.loadBalancingConfig, config.loadBalancingConfig);
    assert.deepEqual(keyedServiceConfig({}), {}, "a config that retries nothing stays so");
  });

  test("a keyed write named with a hedging policy is hedged on the keyed channel, not refused",
    async () => {
      // the entry took the retry policy beside its hedging policy, which grpc-js refuses: every
      // keyed write threw synchronously, the client's keyed channel never opened
      const hedging = { maxAttempts: 2, hedgingDelay: "0s", nonFatalStatusCodes: [] };
      const config: ServiceConfig = { methodConfig: [
        { name: [{ service: SERVICE }], retryPolicy: POLICY },
        { name: [{ service: SERVICE, method: "Rotate" }], hedgingPolicy: hedging }] };
      const keyed = keyedServiceConfig(config);
      const rotate = (keyed.methodConfig ?? []).filter((m) =>
        m.name.some((n) => n.method === "Rotate"));
      assert.deepEqual(rotate, [{ name: [{ service: SERVICE, method: "Rotate" }],
        hedgingPolicy: hedging }]);
      const hedged = open({ serviceConfig: config });
      let made: Promise<unknown> | undefined;
      assert.doesNotThrow(() => {
        made = hedged.rotate({ tenantId: "t", sessionId: "s", idempotencyKey: "k-hedged" });
      });
      await made;
    });

  test("a keyed channel that cannot open rejects the keyed write, never throws out of it",
    async () => {
      const failing = open();
      (failing as unknown as { openKeyed: () => never }).openKeyed = () => {
        throw new Error("no keyed channel");
      };
      let made: Promise<unknown> | undefined;
      assert.doesNotThrow(() => {
        made = failing.rotate({ tenantId: "t", sessionId: "s", idempotencyKey: "k-none" });
      });
      await assert.rejects(made!, /no keyed channel/);
    });

  test("grpc-js retries an idempotent call on UNAVAILABLE; every attempt sends the token",
    async () => {
      failFirst = 2;
      const got = await client.getPlan({ tenantId: "t", sessionId: "s" });
      assert.equal(got.plan?.epoch, 3);
      assert.equal(calls.getPlan, 3);
      assert.deepEqual(seen.getPlan!.map((md) => md.get("authorization")[0]),
        ["Bearer s3cret", "Bearer s3cret", "Bearer s3cret"]);
      // grpc-js numbers its retries: this header comes from its retry machinery, not ours
      assert.deepEqual(previousAttempts("getPlan"), ["", "1", "2"]);
    });

  test("retries stop at the policy's maxAttempts; the error counts the attempts", async () => {
    failFirst = 100;
    await assert.rejects(client.getPlan({ tenantId: "t", sessionId: "s" }), (err: unknown) => {
      assert.ok(err instanceof ContextEngineError);
      assert.equal(err.code, GrpcStatus.UNAVAILABLE);
      assert.equal(err.attempts, POLICY.maxAttempts);
      return true;
    });
    assert.equal(calls.getPlan, POLICY.maxAttempts);
  });

  test("codes other than UNAVAILABLE are never retried", async () => {
    failFirst = 100;
    for (const code of [CODE.FAILED_PRECONDITION, CODE.INVALID_ARGUMENT, CODE.NOT_FOUND,
      CODE.RESOURCE_EXHAUSTED, CODE.INTERNAL, CODE.PERMISSION_DENIED, CODE.CANCELLED]) {
      failWith = code;
      calls.getPlan = 0;
      await assert.rejects(client.getPlan({ tenantId: "t", sessionId: "s" }), (err: unknown) =>
        err instanceof ContextEngineError && err.code === code && err.attempts === 1);
      assert.equal(calls.getPlan, 1, codeNameOf(code));
    }
  });

  test("Rotate without an idempotency key is never retried", async () => {
    failFirst = 1;
    await assert.rejects(client.rotate({ tenantId: "t", sessionId: "s",
      reason: "ROTATION_REASON_OPERATOR" }), (err: unknown) =>
      err instanceof ContextEngineError && err.code === GrpcStatus.UNAVAILABLE &&
      err.attempts === 1);
    assert.equal(calls.rotate, 1);
  });

  test("Rotate with an idempotency key is retried", async () => {
    failFirst = 1;
    const got = await client.rotate({ tenantId: "t", sessionId: "s",
      reason: "ROTATION_REASON_OPERATOR", idempotencyKey: "k-1" });
    assert.equal(got.rotated, true);
    assert.equal(calls.rotate, 2);
    assert.deepEqual(previousAttempts("rotate"), ["", "1"]);
  });

  test("DeleteSession is idempotent: retried without a key", async () => {
    failFirst = 2;
    const got = await client.deleteSession({ tenantId: "t", sessionId: "s" });
    assert.equal(got.deleted, true);
    assert.equal(got.planCacheSeconds, 60);
    assert.equal(calls.deleteSession, 3);
  });

  test("Compact and ReportUsage with a key stop at the policy's attempts", async () => {
    await assert.rejects(client.compact({ tenantId: "t", sessionId: "s", idempotencyKey: "c-1" }),
      (err: unknown) => err instanceof ContextEngineError && err.attempts === POLICY.maxAttempts);
    assert.equal(calls.compact, POLICY.maxAttempts);
    await assert.rejects(client.reportUsage({ tenantId: "t", sessionId: "s" }),
      (err: unknown) => err instanceof ContextEngineError && err.attempts === 1);
    assert.equal(calls.reportUsage, 1, "without a key: one attempt");
  });

  test("a caller's service config replaces the packaged one", async () => {
    const config = packagedServiceConfig();
    config.methodConfig![0]!.retryPolicy!.maxAttempts = 2;
    const two = open({ serviceConfig: JSON.stringify(config) });
    failFirst = 100;
    await assert.rejects(two.getPlan({ tenantId: "t", sessionId: "s" }),
      (err: unknown) => err instanceof ContextEngineError && err.attempts === 2);
    assert.equal(calls.getPlan, 2);
    await assert.rejects(two.rotate({ tenantId: "t", sessionId: "s", idempotencyKey: "k" }),
      (err: unknown) => err instanceof ContextEngineError && err.attempts === 2);
    assert.equal(calls.rotate, 2);

    const none = open({ serviceConfig: { loadBalancingConfig: [{ round_robin: {} }] } });
    calls.getPlan = 0;
    await assert.rejects(none.getPlan({ tenantId: "t", sessionId: "s" }),
      (err: unknown) => err instanceof ContextEngineError && err.attempts === 1);
    assert.equal(calls.getPlan, 1, "a config without a retry policy retries nothing");
  });

  test("a service-wide retry policy never retries a write sent without its key", async () => {
    const policy = retryPolicyOf(packagedServiceConfig())!;
    for (const name of [{ service: SERVICE }, {}]) {
      const wide = open({ serviceConfig: { methodConfig: [{ name: [name], retryPolicy: policy,
        timeout: "20s" }] } });
      failFirst = 2;
      calls.rotate = 0;
      await assert.rejects(wide.rotate({ tenantId: "t", sessionId: "s" }),
        (err: unknown) => err instanceof ContextEngineError && err.attempts === 1);
      assert.equal(calls.rotate, 1, JSON.stringify(name));
      calls.rotate = 0;
      await wide.rotate({ tenantId: "t", sessionId: "s", idempotencyKey: "k" });
      assert.equal(calls.rotate, 3, "with its key, retried on the keyed channel");
      calls.getPlan = 0;
      await wide.getPlan({ tenantId: "t", sessionId: "s" });
      assert.equal(calls.getPlan, 3, "everything else as configured");
    }
    // grpc-js hedges too: a hedging policy sent one Rotate three times
    const hedged = open({ serviceConfig: { methodConfig: [{ name: [{ service: SERVICE }],
      hedgingPolicy: { maxAttempts: 3, hedgingDelay: "0s", nonFatalStatusCodes: ["UNAVAILABLE"] },
    }] } });
    failFirst = 5;
    calls.rotate = 0;
    await assert.rejects(hedged.rotate({ tenantId: "t", sessionId: "s" }));
    await new Promise((resolve) => setTimeout(resolve, 200));  // any hedged copy arrives
    assert.equal(calls.rotate, 1, "a write without its key is sent once, not hedged");
    assert.deepEqual(unkeyedServiceConfig({ methodConfig: [{ name: [{ service: SERVICE }],
      retryPolicy: policy, timeout: "20s" }] }).methodConfig![1],
    { name: ["Compact", "ReportUsage", "Rotate"].map((method) => ({ service: SERVICE, method })),
      timeout: "20s" });
    // and on the keyed channel too, under the policy (they were named there with the policy
    // alone: a keyed write lost the entry's deadline and size limits)
    assert.deepEqual(keyedServiceConfig({ methodConfig: [{ name: [{ service: SERVICE }],
      retryPolicy: policy, timeout: "20s" }] }).methodConfig![1],
    { name: ["Compact", "ReportUsage", "Rotate"].map((method) => ({ service: SERVICE, method })),
      timeout: "20s", retryPolicy: policy });
  });

  test("after close() every call, a keyed write and a Build too, rejects CANCELLED and opens no channel", async () => {
    const closed = open();
    closed.close();
    const plain = await closed.getPlan({ tenantId: "t", sessionId: "s" }).then(
      () => assert.fail("answered after close()"), (err: unknown) => err);
    const keyed = await closed.rotate({ tenantId: "t", sessionId: "s",
      reason: "ROTATION_REASON_OPERATOR", idempotencyKey: "k-closed" }).then(
      () => assert.fail("answered after close()"), (err: unknown) => err);
    // the closed client's error comes first, before a bad deadline's, as for any call
    const build = await closed.build({ tenantId: "t", sessionId: "s" }, { deadlineMs: -1 }).then(
      () => assert.fail("answered after close()"), (err: unknown) => err);
    for (const [err, method] of [[plain, "GetPlan"], [keyed, "Rotate"], [build, "Build"]]) {
      assert.ok(err instanceof ContextEngineError, `${String(method)}: ${String(err)}`);
      assert.equal(err.code, GrpcStatus.CANCELLED);
      assert.equal(err.method, method);
      assert.equal(err.details, "the client is closed: nothing was sent");
      assert.equal(err.reason, "");
    }
    assert.equal((closed as unknown as { keyedChannel?: unknown }).keyedChannel, undefined,
      "no keyed channel was opened");
    assert.equal(calls.rotate, undefined, "nothing reached the server");
    assert.equal(calls.getPlan, undefined);
    assert.equal(calls.build, undefined);
  });

  test("waitForReady rejects with the typed error: after close(), and at its deadline",
    async () => {
      const closed = open();
      closed.close();
      await assert.rejects(closed.waitForReady(-1), (err: unknown) =>
        err instanceof ContextEngineError && err.code === GrpcStatus.CANCELLED &&
        err.method === "waitForReady" && err.details === "the client is closed: nothing was sent");
      const nowhere = new ContextEngineClient({ target: "127.0.0.1:1", insecure: true });
      try {
        await assert.rejects(nowhere.waitForReady(200), (err: unknown) =>
          err instanceof ContextEngineError && err.code === GrpcStatus.DEADLINE_EXCEEDED &&
          err.method === "waitForReady" && err.cause instanceof Error &&
          /^no connection before the deadline \(the channel is [A-Z_]+\)$/.test(err.details));
      } finally {
        nowhere.close();
      }
    });

  test("close() cancels the calls in flight and a pending waitForReady, typed", async () => {
    const DURING = "the client was closed during the call: it may have reached the service";
    const closing = open();
    const whole = open({ incremental: false });
    // build never answers: both are in flight (the incremental path and the plain one)
    const incremental = closing.build({ tenantId: "t", sessionId: "s-closed" });
    const plain = whole.build({ tenantId: "t", sessionId: "s-closed" });
    const controller = new AbortController();
    const aborted = whole.build({ tenantId: "t", sessionId: "s-aborted" },
      { signal: controller.signal });
    const nowhere = new ContextEngineClient({ target: "10.255.255.1:50051", insecure: true });
    const waiting = nowhere.waitForReady(3_000);
    await new Promise((r) => setTimeout(r, 100));
    const started = Date.now();
    controller.abort();  // the caller's own cancellation stays the caller's
    closing.close();
    whole.close();
    nowhere.close();
    for (const [pending, name] of [[incremental, "incremental"], [plain, "plain"]] as const) {
      await assert.rejects(pending, (err: unknown) =>
        err instanceof ContextEngineError && err.code === GrpcStatus.CANCELLED &&
        err.method === "Build" && err.details === DURING, name);
    }
    await assert.rejects(aborted, (err: unknown) =>
      err instanceof ContextEngineError && err.code === GrpcStatus.CANCELLED &&
      err.details !== DURING);
    await assert.rejects(waiting, (err: unknown) =>
      err instanceof ContextEngineError && err.code === GrpcStatus.CANCELLED &&
      err.method === "waitForReady" && err.details === "the client was closed while waiting");
    assert.ok(Date.now() - started < 1_000, "ended by close(), not by a deadline");
    // and the closed channel stays shut: the wait does not make it connect again
    await new Promise((r) => setTimeout(r, 300));
    const shut = (nowhere as unknown as { channel: grpc.Client }).channel.getChannel();
    assert.equal(shut.getConnectivityState(false), grpc.connectivityState.SHUTDOWN);
  });

  test("a reason that is the code's own name (malformed input's) is said once", () => {
    const info = googleRpc.ErrorInfo.encode(googleRpc.ErrorInfo.fromPartial({
      reason: "INVALID_ARGUMENT", domain: "context-engine" })).finish();
    const bin = googleRpc.Status.encode(googleRpc.Status.fromPartial({
      code: CODE.INVALID_ARGUMENT, message: "checkpoint.items[0].trust: unknown",
      details: [googleRpc.Any.fromPartial({ typeUrl: "type.googleapis.com/google.rpc.ErrorInfo",
        value: Buffer.from(info) })] })).finish();
    const err = new ContextEngineError({ code: CODE.INVALID_ARGUMENT, method: "Build",
      details: "checkpoint.items[0].trust: unknown", parsed: parseStatusDetails(bin) });
    assert.equal(err.reason, "INVALID_ARGUMENT");
    assert.equal(err.message, "Build: INVALID_ARGUMENT: checkpoint.items[0].trust: unknown");
    const other = new ContextEngineError({ code: CODE.NOT_FOUND, method: "GetPlan",
      details: "no such session", parsed: parseStatusDetails(googleRpc.Status.encode(
        googleRpc.Status.fromPartial({ code: CODE.NOT_FOUND, details: [googleRpc.Any.fromPartial({
          typeUrl: "type.googleapis.com/google.rpc.ErrorInfo",
          value: Buffer.from(googleRpc.ErrorInfo.encode(googleRpc.ErrorInfo.fromPartial({
            reason: "SESSION_NOT_FOUND" })).finish()) })] })).finish()) });
    assert.equal(other.message, "GetPlan: NOT_FOUND SESSION_NOT_FOUND: no such session");
  });

  test("status details decode into reason, domain, metadata, violations, tool result, delay",
    async () => {
      await assert.rejects(client.plan({ tenantId: "t", sessionId: "s" }), (err: unknown) => {
        assert.ok(err instanceof ContextEngineError);
        assert.equal(err.code, GrpcStatus.FAILED_PRECONDITION);
        assert.equal(err.codeName, "FAILED_PRECONDITION");
        assert.equal(err.method, "Plan");
        assert.equal(err.details, "persona over its cap");
        assert.equal(err.reason, "PREFIX_CLASS_OVER_CAP");
        assert.equal(err.domain, "context-engine");
        assert.deepEqual({ ...err.metadata }, { class: "persona", tokens: "900", cap: "800" });
        assert.deepEqual(err.violations.map((v) => [v.field, v.description]),
          [["persona.entries[0].text", "too long"]]);
        assert.equal(err.toolResult, "shorten it");
        assert.equal(err.retryDelayMs, 1_500);
        assert.equal(err.status?.code, GrpcStatus.FAILED_PRECONDITION);
        assert.deepEqual(err.otherDetails.map((d) => d.typeUrl),
          ["type.googleapis.com/google.rpc.DebugInfo"]);
        assert.equal(googleRpc.DebugInfo.decode(err.otherDetails[0]!.value).detail,
          "not read by the client");
        assert.equal(err.attempts, 1, "FAILED_PRECONDITION is never retried");
        assert.match(err.message, /^Plan: FAILED_PRECONDITION PREFIX_CLASS_OVER_CAP: /);
        return true;
      });
      assert.equal(calls.plan, 1);
    });

  test("a status whose code or message contradicts the call's is not read: the call's stand",
    async () => {
      // a proxy answered NOT_FOUND over the service's FAILED_PRECONDITION trailer: the
      // detail's reason, metadata, violations, tool result and delay belong to another status
      // (grpc's own libraries refuse such a status), and a caller branching on the reason
      // would act on a failure that is not the one reported
      // (the call's message is the status's: only the code tells them apart)
      failWith = CODE.NOT_FOUND;
      failMessage = "persona over its cap";
      trailer = statusDetails(CODE.FAILED_PRECONDITION, "persona over its cap");
      await assert.rejects(client.updateWorkingState({ tenantId: "t", sessionId: "s" }),
        (err: unknown) => {
          assert.ok(err instanceof ContextEngineError);
          assert.equal(err.code, GrpcStatus.NOT_FOUND);
          assert.equal(err.details, "persona over its cap", "the call's grpc-message");
          assert.equal(err.message, "UpdateWorkingState: NOT_FOUND: persona over its cap");
          assert.deepEqual([err.reason, err.domain, { ...err.metadata }, err.violations.length,
            err.toolResult, err.retryDelayMs, err.status, err.otherDetails.length],
          ["", "", {}, 0, "", undefined, undefined, 0]);
          assert.deepEqual(err.trailers.get("grpc-status-details-bin"), [trailer],
            "the trailer is still there, as it came");
          return true;
        });
      // the same trailer under its own code and message is read whole
      failWith = CODE.FAILED_PRECONDITION;
      await assert.rejects(client.updateWorkingState({ tenantId: "t", sessionId: "s" }),
        (err: unknown) => err instanceof ContextEngineError &&
          err.code === GrpcStatus.FAILED_PRECONDITION && err.reason === "PREFIX_CLASS_OVER_CAP" &&
          err.details === "persona over its cap");
      // under its own code but another message (the grpc-message a proxy rewrote, or a
      // status another failure left): not read either, as grpc's rpc_status.from_call and the
      // Python client refuse it; the call's code and message stand
      failMessage = "upstream answered 412";
      await assert.rejects(client.updateWorkingState({ tenantId: "t", sessionId: "s" }),
        (err: unknown) => {
          assert.ok(err instanceof ContextEngineError);
          assert.equal(err.code, GrpcStatus.FAILED_PRECONDITION);
          assert.equal(err.details, "upstream answered 412", "grpc-message, not the detail's");
          assert.deepEqual([err.reason, err.domain, { ...err.metadata }, err.violations.length,
            err.toolResult, err.retryDelayMs, err.status, err.otherDetails.length],
          ["", "", {}, 0, "", undefined, undefined, 0]);
          assert.deepEqual(err.trailers.get("grpc-status-details-bin"), [trailer]);
          return true;
        });
      // and a trailer that is not a google.rpc.Status leaves the call's code and message
      failWith = CODE.UNAVAILABLE;
      failMessage = undefined;
      trailer = Buffer.from([0xff, 0xff, 0xff]);
      await assert.rejects(client.updateWorkingState({ tenantId: "t", sessionId: "s" }),
        (err: unknown) => err instanceof ContextEngineError &&
          err.code === GrpcStatus.UNAVAILABLE && err.details === "UNAVAILABLE" &&
          err.reason === "" && err.status === undefined);
    });

  test("per-call metadata, as a record or a Metadata, reaches the server", async () => {
    await client.getPlan({ tenantId: "t", sessionId: "s" }, { metadata: {
      traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
      "x-request-id": "req-1", "x-trace-bin": Buffer.from([1, 2, 3]), "x-multi": ["a", "b"] } });
    const md = new Metadata();
    md.set("x-request-id", "req-2");
    md.set("authorization", "Bearer per-call");
    await client.getPlan({ tenantId: "t", sessionId: "s" }, { metadata: md });
    const [first, second] = seen.getPlan!;
    assert.equal(first!.get("traceparent")[0],
      "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
    assert.equal(first!.get("x-request-id")[0], "req-1");
    assert.deepEqual(first!.get("x-trace-bin")[0], Buffer.from([1, 2, 3]));
    assert.deepEqual(first!.get("x-multi"), ["a, b"], "repeated values travel as one header");
    assert.equal(first!.get("authorization")[0], "Bearer s3cret");
    assert.equal(second!.get("x-request-id")[0], "req-2");
    assert.equal(second!.get("authorization")[0], "Bearer per-call", "a call's key wins");
  });

  test("a metadata key grpc-js would send wrong is a TypeError before the call", async () => {
    // an HTTP/2 connection header made grpc-js drop the shared connection and retry the call
    // until its deadline, spinning a core; gRPC's own keys and pseudo-headers were dropped or
    // forwarded as they came
    seen.getPlan = [];
    for (const key of ["connection", "Keep-Alive", "transfer-encoding", "upgrade", "te",
      "proxy-connection", "host", "content-type", ":authority", "grpc-status", "x id"]) {
      await assert.rejects(client.getPlan({ tenantId: "t", sessionId: "s" },
        { metadata: { [key]: "x" } }), (err: unknown) => err instanceof TypeError &&
          /call metadata key/.test(err.message), key);
    }
    assert.equal(seen.getPlan.length, 0, "nothing was sent");
    await client.getPlan({ tenantId: "t", sessionId: "s" }, { metadata: { "x-ok": "1" } });
    assert.equal(seen.getPlan.length, 1);
  });

  test("the per-call deadline overrides the client's", async () => {
    const started = Date.now();
    await assert.rejects(client.build({ tenantId: "t", sessionId: "s" }, { deadlineMs: 150 }),
      (err: unknown) => err instanceof ContextEngineError &&
        err.code === GrpcStatus.DEADLINE_EXCEEDED && err.reason === "");
    assert.ok(Date.now() - started < 2_000);
  });

  test("compact waits on a summarizer: its default deadline is 60 s", async () => {
    // the fake answers compact UNAVAILABLE: what matters is the deadline it was sent with
    const attempt = (c: ContextEngineClient, options?: { deadlineMs: number }) =>
      c.compact({ tenantId: "t", sessionId: "s" }, options).catch(() => undefined);
    await attempt(client);
    assert.ok(left.compact! > 55_000 && left.compact! <= 60_000, String(left.compact));
    await attempt(client, { deadlineMs: 2_000 });
    assert.ok(left.compact! <= 2_000, "a call's own deadline wins");
    await attempt(open({ compactDeadlineMs: 120_000 }));
    assert.ok(left.compact! > 115_000 && left.compact! <= 120_000, String(left.compact));
    await client.getPlan({ tenantId: "t", sessionId: "s" });
    assert.ok(left.getPlan! <= 5_000, "every other call keeps the client's deadline");
    assert.throws(() => open({ compactDeadlineMs: 0 }), RangeError);
  });

  test("the deadline bounds the retries too", async () => {
    const config = packagedServiceConfig();
    config.methodConfig![0]!.retryPolicy!.initialBackoff = "30s";
    config.methodConfig![0]!.retryPolicy!.maxBackoff = "30s";
    const slow = open({ serviceConfig: config, deadlineMs: 300 });
    failFirst = 100;
    const started = Date.now();
    await assert.rejects(slow.updateWorkingState({ tenantId: "t", sessionId: "s" }),
      (err: unknown) => err instanceof ContextEngineError &&
        err.code === GrpcStatus.DEADLINE_EXCEEDED);
    assert.ok(Date.now() - started < 5_000, "the call ended at its deadline, not after backoff");
  });

  test("a request that cannot be encoded rejects with the encoder's error, nothing sent",
    async () => {
      // grpc-js, left to encode it, answered INTERNAL "Request message serialization failure",
      // a ContextEngineError that blames the service for the caller's own request
      const whole = open({ incremental: false });
      const sends: [string, () => Promise<unknown>][] = [
        ["carryWorkingState", () => client.carryWorkingState({ tenantId: "t", sessionId: "s",
          seedEventSequence: "abc" })],
        ["build", () => whole.build({ tenantId: "t", sessionId: "s", checkpoint: { items: [
          { id: "u1", sequence: "abc", user: { text: "hi" } }] } })],
        ["compact", () => client.compact({ tenantId: "t", sessionId: "s", reason: "r",
          idempotencyKey: "k", replaceThroughSequence: "abc" })],  // the keyed channel
        ["build", () => client.build({ tenantId: "t", sessionId: "s", checkpoint: { items: [
          { id: "u1", sequence: "abc", user: { text: "hi" } }] } })],
      ];
      for (const [rpc, send] of sends) {
        await assert.rejects(send(), (err: unknown) => err instanceof SyntaxError &&
          !(err instanceof ContextEngineError) && /abc/.test(err.message), rpc);
        assert.equal(calls[rpc], undefined, `${rpc}: nothing reached the server`);
      }
    });

  test("an int64 is a decimal string: any other form rejects, and nothing is sent", async () => {
    // BigInt() read "" as 0, " 3" and "+3" as 3, "0x10" as 16, and they were sent so; the
    // Python client takes only an int
    const whole = open({ incremental: false });
    const item = (sequence: string) => ({ tenantId: "t", sessionId: "s", checkpoint: { items: [
      { id: "u1", sequence, user: { text: "hi" } }] } });
    const attached = (textChars: string) => ({ tenantId: "t", sessionId: "s", checkpoint: {
      items: [{ id: "u1", sequence: "1", user: { text: "hi", attachments: [
        { name: "notes.txt", ref: "file-1", textChars }] } }] } });
    for (const bad of ["", " 3", "3 ", "+3", "0x10", "0o7", "0b1", "1e3", "1_000", "\n3"]) {
      const sends: [string, () => Promise<unknown>][] = [
        ["carryWorkingState", () => client.carryWorkingState({ tenantId: "t", sessionId: "s",
          seedEventSequence: bad })],
        ["build", () => client.build(item(bad))],  // incremental: encoded item by item
        ["build", () => whole.build(item(bad))],
        ["compact", () => client.compact({ tenantId: "t", sessionId: "s", reason: "r",
          idempotencyKey: "k", checkpoint: { summary: { sourceEventIds: ["1", bad] } } })],
        // a uint64 (Attachment.text_chars), whole and item by item
        ["build", () => whole.build(attached(bad))],
        ["build", () => client.build(attached(bad))],
      ];
      for (const [rpc, send] of sends) {
        await assert.rejects(send(), (err: unknown) => err instanceof SyntaxError &&
          err.message.includes(JSON.stringify(bad)), `${rpc} ${JSON.stringify(bad)}`);
        assert.equal(calls[rpc], undefined, `${rpc} ${JSON.stringify(bad)}: nothing was sent`);
      }
    }
    // a number (JavaScript, parsed JSON) past 2^53 - 1 may be rounded already: refused too
    for (const bad of [2 ** 53, -(2 ** 53), 1e21, 1.5]) {
      await assert.rejects(client.carryWorkingState({ tenantId: "t", sessionId: "s",
        seedEventSequence: bad as unknown as string }), RangeError, String(bad));
    }
    assert.equal(calls.carryWorkingState, undefined);
    // decimal strings and safe integers go as they are, to the last digit
    carried.length = 0;
    const good: [unknown, string][] = [["12", "12"], ["-3", "-3"], ["007", "7"],
      ["9223372036854775807", "9223372036854775807"], ["9007199254740993", "9007199254740993"],
      ["-9223372036854775808", "-9223372036854775808"], [2 ** 53 - 1, "9007199254740991"]];
    for (const [given] of good) {
      await client.carryWorkingState({ tenantId: "t", sessionId: "s",
        seedEventSequence: given as string });
    }
    assert.deepEqual(carried, good.map(([, sent]) => sent));
  });

  test("an aborted signal cancels the call", async () => {
    const controller = new AbortController();
    const pending = client.build({ tenantId: "t", sessionId: "s" }, { signal: controller.signal });
    setTimeout(() => controller.abort(), 50);
    await assert.rejects(pending, (err: unknown) =>
      err instanceof ContextEngineError && err.code === GrpcStatus.CANCELLED);
    await assert.rejects(client.getPlan({ tenantId: "t", sessionId: "s" },
      { signal: AbortSignal.abort() }), (err: unknown) =>
      err instanceof ContextEngineError && err.code === GrpcStatus.CANCELLED);
  });

  test("a deadline 10^8 hours or more away is sent as none, not thrown out of reach", async () => {
    // grpc-js threw inside its own promise chain, and the process died of it
    const far = open({ deadlineMs: 1e15 });
    assert.equal((await far.getPlan({ tenantId: "t", sessionId: "s" })).plan?.epoch, 3);
    assert.equal((await client.getPlan({ tenantId: "t", sessionId: "s" },
      { deadlineMs: 4e14 })).plan?.epoch, 3);
    assert.ok(!(left.getPlan! < 1e9), "a deadline that far reaches the server as none");
  });

  test("a token must be one line of printable ASCII", () => {
    // a header value grpc-js sends: a tab, a BOM or an accent passed construction and failed
    // every call with a plain Error holding the token
    for (const token of ["a\nb", "a\rb", "", "s3\tcret", "\ufeffs3cret", "t\u00f6ken", "s3\u0000"]) {
      assert.throws(() => new ContextEngineClient({ target: address, insecure: true, token }),
        (err: unknown) => err instanceof Error && /one non-empty line/.test(err.message) &&
          !err.message.includes(token || "\u0001"), JSON.stringify(token));
    }
  });

  test("a plaintext token to this machine goes straight, not through the environment's proxy",
    async () => {
      // a proxy that takes connections and never answers: a call through it cannot succeed
      const proxied: net.Socket[] = [];
      const proxy = net.createServer((socket) => { proxied.push(socket); });
      await new Promise<void>((resolve) => proxy.listen(0, "127.0.0.1", resolve));
      const at = `http://127.0.0.1:${(proxy.address() as net.AddressInfo).port}`;
      const saved = { grpc_proxy: process.env.grpc_proxy, no_proxy: process.env.no_proxy,
        no_grpc_proxy: process.env.no_grpc_proxy };
      process.env.grpc_proxy = at;
      delete process.env.no_proxy;
      delete process.env.no_grpc_proxy;
      try {
        const withToken = open();
        assert.equal((await withToken.getPlan({ tenantId: "t", sessionId: "s" })).plan?.epoch, 3);
        assert.equal(proxied.length, 0);
        // the same channel without a token does go through the proxy: the test can fail
        const withoutToken = open({ token: undefined, deadlineMs: 1_000 });
        await assert.rejects(withoutToken.getPlan({ tenantId: "t", sessionId: "s" }));
        assert.ok(proxied.length > 0);
      } finally {
        for (const [key, value] of Object.entries(saved)) {
          if (value === undefined) delete process.env[key];
          else process.env[key] = value;
        }
        for (const socket of proxied) socket.destroy();
        proxy.close();
      }
    });
});

describe("which targets are this machine", () => {
  test("loopback addresses, localhost and Unix sockets, as Node reads them", () => {
    for (const target of ["127.0.0.1:50051", "127.255.0.9:1", "localhost:50051",
      "LOCALHOST:1", "[::1]:50051", "dns:///localhost:50051", "dns:127.0.0.1:1",
      "ipv4:127.0.0.1:1,127.0.0.2:2", "ipv6:[::1]:1", "unix:/tmp/ce.sock",
      "unix-abstract:ce"]) {
      assert.equal(isLoopback(target), true, target);
    }
    for (const target of ["10.255.255.1:50051", "ce.internal:50051", "127.999.0.1:50051",
      "[::1%lo]:50051", "ipv4:127.0.0.1:1,10.0.0.1:2", "dns:///", "", "0.0.0.0:50051",
      "[::]:50051"]) {
      assert.equal(isLoopback(target), false, target);
    }
  });

  test("a token in plaintext to this machine turns the proxy off; nothing else does", () => {
    const off = { "grpc.enable_http_proxy": 0 };
    assert.deepEqual(tokenTransportOptions("127.0.0.1:1", true, "t"), off);
    assert.deepEqual(tokenTransportOptions("127.0.0.1:1", true, undefined), {});
    assert.deepEqual(tokenTransportOptions("127.0.0.1:1", false, "t"), {});
    // to another machine, plaintext is the caller's deliberate choice (a sidecar's hop)
    assert.deepEqual(tokenTransportOptions("10.0.0.1:1", true, "t"), {});
  });
});
