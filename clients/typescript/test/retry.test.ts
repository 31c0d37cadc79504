/**
 * Client behaviour against an in-process grpc-js server that serves the same contract:
 * which calls are retried on UNAVAILABLE, the bearer token, deadlines, and decoding of
 * `grpc-status-details-bin`. Needs no context-engine server.
 */
import assert from "node:assert/strict";
import { after, before, beforeEach, describe, test } from "node:test";

import * as grpc from "@grpc/grpc-js";

import {
  ContextEngineClient,
  ContextEngineError,
  GrpcStatus,
  loadPackageDefinition,
  resolveProtoDir,
} from "../src";
import { googleRpcRoot } from "../src/proto";

type Handler = (call: grpc.ServerUnaryCall<Record<string, unknown>, unknown>,
                callback: grpc.sendUnaryData<unknown>) => void;

/** A `google.rpc.Status` with one ErrorInfo and one BadRequest, as the service sends it. */
function statusDetails(code: grpc.status, message: string): Buffer {
  const root = googleRpcRoot();
  const Status = root.lookupType("google.rpc.Status");
  const ErrorInfo = root.lookupType("google.rpc.ErrorInfo");
  const BadRequest = root.lookupType("google.rpc.BadRequest");
  const info = ErrorInfo.encode(ErrorInfo.fromObject({ reason: "PREFIX_CLASS_OVER_CAP",
    domain: "context-engine", metadata: { class: "persona", tokens: "900", cap: "800" } })).finish();
  const bad = BadRequest.encode(BadRequest.fromObject({ fieldViolations: [
    { field: "persona.entries[0].text", description: "too long" }] })).finish();
  return Buffer.from(Status.encode(Status.fromObject({ code, message, details: [
    { type_url: "type.googleapis.com/google.rpc.ErrorInfo", value: info },
    { type_url: "type.googleapis.com/google.rpc.BadRequest", value: bad },
  ] })).finish());
}

function unavailable(): grpc.ServiceError {
  return Object.assign(new Error("down"), { code: grpc.status.UNAVAILABLE, details: "down",
    metadata: new grpc.Metadata() });
}

describe("client behaviour", () => {
  const server = new grpc.Server();
  const calls: Record<string, number> = {};
  const auth: string[] = [];
  let failFirst = 0;
  let client: ContextEngineClient;
  let address = "";

  const emptyPlan = { plan: { epoch: 3, prefixSha256: "ab".repeat(32) } };
  const handlers: Record<string, Handler> = {
    GetPlan: (call, cb) => {
      auth.push(String(call.metadata.get("authorization")[0] ?? ""));
      if (calls.GetPlan! <= failFirst) return cb(unavailable());
      cb(null, emptyPlan);
    },
    Rotate: (_call, cb) => {
      if (calls.Rotate! <= failFirst) return cb(unavailable());
      cb(null, { rotated: true, plan: emptyPlan.plan });
    },
    Compact: (_call, cb) => cb(unavailable()),
    Plan: (_call, cb) => {
      const md = new grpc.Metadata();
      md.set("grpc-status-details-bin", statusDetails(grpc.status.FAILED_PRECONDITION,
        "persona over its cap"));
      cb(Object.assign(new Error("persona over its cap"), {
        code: grpc.status.FAILED_PRECONDITION, details: "persona over its cap", metadata: md }));
    },
    Build: () => { /* never answers: the deadline must fire */ },
  };

  before(async () => {
    const definition = loadPackageDefinition(resolveProtoDir());
    const pkg = grpc.loadPackageDefinition(definition) as unknown as {
      context_engine: { v1: { ContextEngine: grpc.ServiceClientConstructor } } };
    const service = pkg.context_engine.v1.ContextEngine.service;
    const impl: grpc.UntypedServiceImplementation = {};
    for (const name of Object.keys(service)) {
      impl[name] = ((call: grpc.ServerUnaryCall<Record<string, unknown>, unknown>,
                     cb: grpc.sendUnaryData<unknown>) => {
        calls[name] = (calls[name] ?? 0) + 1;
        const handler = handlers[name];
        if (handler) handler(call, cb);
        else cb({ code: grpc.status.UNIMPLEMENTED, details: name });
      }) as grpc.handleUnaryCall<unknown, unknown>;
    }
    server.addService(service, impl);
    const port = await new Promise<number>((resolve, reject) => server.bindAsync(
      "127.0.0.1:0", grpc.ServerCredentials.createInsecure(),
      (err, p) => (err ? reject(err) : resolve(p))));
    address = `127.0.0.1:${port}`;
    client = new ContextEngineClient({ target: address, insecure: true, token: "s3cret",
      deadlineMs: 5_000, retry: { maxAttempts: 3, initialBackoffMs: 5, maxBackoffMs: 20 } });
  });

  after(() => {
    client.close();
    server.forceShutdown();
  });

  beforeEach(() => {
    for (const key of Object.keys(calls)) delete calls[key];
    auth.length = 0;
    failFirst = 0;
  });

  test("an idempotent call is retried on UNAVAILABLE and sends the bearer token", async () => {
    failFirst = 2;
    const got = await client.getPlan({ tenantId: "t", sessionId: "s" });
    assert.equal(got.plan.epoch, 3);
    assert.equal(calls.GetPlan, 3);
    assert.deepEqual(auth, ["Bearer s3cret", "Bearer s3cret", "Bearer s3cret"]);
  });

  test("retries are bounded: the last UNAVAILABLE is raised with its attempt count", async () => {
    failFirst = 10;
    await assert.rejects(client.getPlan({ tenantId: "t", sessionId: "s" }), (err: unknown) => {
      assert.ok(err instanceof ContextEngineError);
      assert.equal(err.code, GrpcStatus.UNAVAILABLE);
      assert.equal(err.attempts, 3);
      return true;
    });
    assert.equal(calls.GetPlan, 3);
  });

  test("Rotate without an idempotency key is never retried", async () => {
    failFirst = 1;
    await assert.rejects(client.rotate({ tenantId: "t", sessionId: "s",
      reason: "ROTATION_REASON_OPERATOR", idempotencyKey: "" }), (err: unknown) =>
      err instanceof ContextEngineError && err.code === GrpcStatus.UNAVAILABLE && err.attempts === 1);
    assert.equal(calls.Rotate, 1);
  });

  test("Rotate with an idempotency key is retried", async () => {
    failFirst = 1;
    const got = await client.rotate({ tenantId: "t", sessionId: "s",
      reason: "ROTATION_REASON_OPERATOR", idempotencyKey: "k-1" });
    assert.equal(got.rotated, true);
    assert.equal(calls.Rotate, 2);
  });

  test("Compact with a key stops after the configured attempts", async () => {
    await assert.rejects(client.compact({ tenantId: "t", sessionId: "s", idempotencyKey: "c-1" }),
      (err: unknown) => err instanceof ContextEngineError && err.attempts === 3);
    assert.equal(calls.Compact, 3);
  });

  test("status details decode into reason, domain, metadata and violations", async () => {
    await assert.rejects(client.plan({ tenantId: "t", sessionId: "s" }), (err: unknown) => {
      assert.ok(err instanceof ContextEngineError);
      assert.equal(err.code, GrpcStatus.FAILED_PRECONDITION);
      assert.equal(err.reason, "PREFIX_CLASS_OVER_CAP");
      assert.equal(err.domain, "context-engine");
      assert.deepEqual({ ...err.metadata }, { class: "persona", tokens: "900", cap: "800" });
      assert.deepEqual(err.violations.map((v) => [v.field, v.description]),
        [["persona.entries[0].text", "too long"]]);
      assert.equal(err.attempts, 1, "FAILED_PRECONDITION is never retried");
      return true;
    });
    assert.equal(calls.Plan, 1);
  });

  test("the per-call deadline overrides the client's", async () => {
    const started = Date.now();
    await assert.rejects(client.build({ tenantId: "t", sessionId: "s" }, { deadlineMs: 150 }),
      (err: unknown) => err instanceof ContextEngineError &&
        err.code === GrpcStatus.DEADLINE_EXCEEDED && err.reason === "");
    assert.ok(Date.now() - started < 2_000);
  });
});
