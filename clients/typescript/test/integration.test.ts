/**
 * Against a real context-engine server at `CE_GRPC_ADDR` (e.g. `127.0.0.1:50051`, dev mode):
 * Plan -> GetPlan -> Build -> Rotate -> Compact -> Build on the summary, with the fixed inputs
 * of `test/fixtures/session.json` (proto3 JSON, read with the generated `fromJSON`). Writes the
 * `prefix_sha256` values and ids as JSON to `CE_RESULT_FILE` when set, so another client can
 * compare them.
 */
import assert from "node:assert/strict";
import { createHash, randomBytes } from "node:crypto";
import * as fs from "node:fs";
import * as path from "node:path";
import { after, before, describe, test } from "node:test";

import {
  type BodyFormat,
  BuildResponse,
  Checkpoint,
  ContextEngineClient,
  ContextEngineError,
  FORMAT_NAMES,
  type FormatName,
  GetPlanResponse,
  GrpcStatus,
  PACKAGE_ROOT,
  PlanRequest,
  ProviderBodyError,
  anthropicMessagesBody,
  bedrockConverseBody,
  bodyOf,
  chatCompletionsBody,
  geminiBody,
  geminiCachedContent,
  openaiResponsesBody,
  providerBody,
  providerFormatName,
} from "../src";

const json = JSON.parse(fs.readFileSync(
  path.join(PACKAGE_ROOT, "test", "fixtures", "session.json"), "utf8")) as
  { plan: unknown; checkpoint: unknown; compactThroughSequence: string };
const fixture = {
  plan: PlanRequest.fromJSON(json.plan),
  checkpoint: Checkpoint.fromJSON(json.checkpoint),
  compactThroughSequence: json.compactThroughSequence,
};

const HEX64 = /^[0-9a-f]{64}$/;

/** Each format's accessor, and the top-level keys its body has for the fixture's checkpoint. */
const FORMATS: Record<FormatName, { body: (r: Parameters<typeof providerBody>[0]) => object;
  keys: string[]; pairs: [string, string] }> = {
  anthropic_messages: { body: anthropicMessagesBody, pairs: ['"tool_use"', '"tool_result"'],
    keys: ["model", "max_tokens", "system", "messages", "tools"] },
  openai_responses: { body: openaiResponsesBody,
    pairs: ['"function_call"', '"function_call_output"'],
    keys: ["model", "instructions", "input", "prompt_cache_key", "tools"] },
  openai_chat_completions: { body: chatCompletionsBody, pairs: ['"tool_calls"', '"tool"'],
    keys: ["model", "messages", "tools"] },
  gemini_generate_content: { body: geminiBody,
    pairs: ['"functionCall"', '"functionResponse"'],
    keys: ["contents", "systemInstruction", "tools", "generationConfig"] },
  bedrock_converse: { body: bedrockConverseBody, pairs: ['"toolUse"', '"toolResult"'],
    keys: ["modelId", "system", "messages", "toolConfig", "inferenceConfig"] },
};
const target = process.env.CE_GRPC_ADDR ?? "";
const tenantId = process.env.CE_TENANT_ID ?? `ts-tenant-${randomBytes(6).toString("hex")}`;
const sessionId = `ts-session-${randomBytes(6).toString("hex")}`;

// Without a server to talk to the suite is skipped, saying why (the Python suite, which
// starts one, fails on any skip).
describe("context-engine over gRPC", { skip: target ? false :
  "set CE_GRPC_ADDR to a running context-engine server (make run), e.g. 127.0.0.1:50051" }, () => {
  let client: ContextEngineClient;
  const result: Record<string, unknown> = { tenantId, sessionId };

  before(async () => {
    assert.ok(target, "CE_GRPC_ADDR must name a running context-engine server (host:port)");
    client = new ContextEngineClient({ target, insecure: true, deadlineMs: 20_000 });
    await client.waitForReady(10_000);
  });

  after(() => {
    client?.close();
    const file = process.env.CE_RESULT_FILE;
    if (file) fs.writeFileSync(file, JSON.stringify(result, null, 2));
  });

  test("Plan, GetPlan, Build, Rotate, Compact keep one prefix per epoch", async () => {
    const planned = await client.plan({ ...fixture.plan, tenantId, sessionId });
    const plan = planned.plan;
    assert.ok(plan);
    assert.equal(planned.created, true);
    assert.equal(plan.epoch, 1);
    assert.match(plan.prefixSha256, HEX64);
    assert.equal(plan.reason, "session_opened");
    assert.deepEqual(plan.toolNames,
      ["context.update_working_state", "rail.search", "tool.call", "web.fetch"]);
    assert.deepEqual(plan.deferredToolNames, ["clock.now"]);
    assert.ok(plan.prefixBlocks.length >= 3 && plan.prefixTokens > 0);
    assert.ok(plan.createdAt instanceof Date && plan.createdAt.getTime() > 0,
      "a google.protobuf.Timestamp arrives as a Date");
    result.plan = { epoch: plan.epoch, prefixSha256: plan.prefixSha256 };

    const again = await client.plan({ ...fixture.plan, tenantId, sessionId });
    assert.equal(again.created, false);
    assert.equal(again.plan?.prefixSha256, plan.prefixSha256);

    const got = await client.getPlan({ tenantId, sessionId });
    assert.equal(got.plan?.epoch, 1);
    assert.equal(got.plan?.prefixSha256, plan.prefixSha256);

    const built = await client.build({ tenantId, sessionId, checkpoint: fixture.checkpoint });
    assert.equal(built.prefixSha256, plan.prefixSha256);
    assert.equal(built.epoch, 1);
    assert.ok(built.budget && built.pressure && built.request);
    assert.ok(built.budget.bodyBudget > 0 && built.pressure.fits);
    assert.deepEqual(built.cacheBreakpoints.slice(0, 2).map((b) => b.name),
      ["after_system", "after_tools"]);
    const toolMessage = built.request.messages.find((m) => m.role === "ROLE_TOOL");
    assert.ok(toolMessage, "the rail.search result is a tool message");
    assert.equal(toolMessage.callId, "call-1");
    assert.match(toolMessage.text, /^<untrusted /, "an untrusted result renders in its envelope");
    result.build = { epoch: built.epoch, prefixSha256: built.prefixSha256,
      estimatedInputTokens: built.estimatedInputTokens };

    const key = `rotate-${sessionId}`;
    const rotated = await client.rotate({ tenantId, sessionId,
      reason: "ROTATION_REASON_OPERATOR", idempotencyKey: key });
    assert.equal(rotated.rotated, true);
    assert.ok(rotated.plan);
    assert.equal(rotated.plan.epoch, 2);
    assert.equal(rotated.plan.reason, "operator");
    assert.match(rotated.plan.prefixSha256, HEX64);
    const retried = await client.rotate({ tenantId, sessionId,
      reason: "ROTATION_REASON_OPERATOR", idempotencyKey: key });
    assert.equal(retried.rotated, false, "a retried key rotates once");
    assert.equal(retried.plan?.epoch, 2);
    result.rotate = { epoch: rotated.plan.epoch, prefixSha256: rotated.plan.prefixSha256 };

    const compacted = await client.compact({ tenantId, sessionId, checkpoint: fixture.checkpoint,
      replaceThroughSequence: fixture.compactThroughSequence, reason: "budget_pressure",
      idempotencyKey: `compact-${sessionId}` });
    assert.equal(compacted.compacted, true);
    assert.ok(compacted.summary);
    assert.deepEqual(compacted.replacedItemIds, ["u1", "c1", "r1", "a1"]);
    assert.equal(compacted.summary.depth, 1);
    assert.equal(compacted.summary.replacedThroughSequence, "4");
    assert.deepEqual(compacted.summary.constraints, ["rail only", "confirm before booking"]);
    assert.deepEqual(compacted.summary.elided.map((e) => [e.itemId, e.eventId]), [["r1", "3"]]);

    const onSummary = await client.build({ tenantId, sessionId,
      checkpoint: { ...fixture.checkpoint, summary: compacted.summary } });
    assert.equal(onSummary.epoch, 2);
    assert.equal(onSummary.prefixSha256, rotated.plan.prefixSha256);
    assert.ok(onSummary.request);
    const rows = onSummary.request.messages.map((m) => [m.row, m.itemId]);
    assert.ok(rows.some(([row]) => row === 9), "the summary renders at row 9");
    assert.ok(!rows.some(([, id]) => ["u1", "c1", "r1", "a1"].includes(id as string)));
    result.compact = { epoch: onSummary.epoch, prefixSha256: onSummary.prefixSha256,
      summaryDepth: compacted.summary.depth, replacedItemIds: compacted.replacedItemIds };
  });

  test("an unknown session is a ContextEngineError NOT_FOUND with its reason", async () => {
    const missing = `ts-missing-${randomBytes(6).toString("hex")}`;
    await assert.rejects(client.getPlan({ tenantId, sessionId: missing }), (err: unknown) => {
      assert.ok(err instanceof ContextEngineError, `not a ContextEngineError: ${String(err)}`);
      assert.equal(err.code, GrpcStatus.NOT_FOUND);
      assert.equal(err.codeName, "NOT_FOUND");
      assert.equal(err.reason, "SESSION_NOT_FOUND");
      assert.equal(err.domain, "context-engine");
      assert.equal(err.attempts, 1, "NOT_FOUND is never retried");
      assert.ok(Object.values(err.metadata).includes(missing),
        `the metadata names the session: ${JSON.stringify(err.metadata)}`);
      result.notFound = { code: err.codeName, reason: err.reason, domain: err.domain };
      return true;
    });
  });

  test("the model's working-state call goes in raw and its tool result comes back", async () => {
    const request = (argumentsJson: string) => ({ tenantId, sessionId, runId: "run-ws",
      sequence: "7", current: { constraints: ["rail only"] }, transition: { toolCall: {
        callId: "toolu_01", name: "context__update_working_state", argumentsJson } } });
    const applied = await client.updateWorkingState(request(JSON.stringify({
      // the tool's own field names: the arguments are the model's JSON, not a message
      objective: "Reach Milan by 14:00",
      upsert_tasks: [{ id: "t1", title: "find a train", state: "open" }] })));
    assert.equal(applied.state?.objective, "Reach Milan by 14:00");
    assert.deepEqual(applied.state?.constraints, ["rail only"]);
    assert.equal(applied.change?.transition, "update");
    assert.match(applied.toolResult,
      /^Working state updated: objective set; 1 task updated\. The block is \d+ of 1,000/);

    // The model cannot remove a constraint: the field does not exist, and it is told so (the
    // name it wrote is not repeated to it: the schema after the errors names the fields).
    await assert.rejects(client.updateWorkingState(request(
      JSON.stringify({ remove_constraints: ["rail only"] }))), (err: unknown) => {
      assert.ok(err instanceof ContextEngineError);
      assert.equal(err.code, GrpcStatus.INVALID_ARGUMENT);
      assert.deepEqual(err.violations.map((v) => v.field),
        ["transition.tool_call.arguments_json"]);
      assert.match(err.toolResult, /- arguments: holds an argument that is not a field of this tool\n/);
      assert.ok(!err.toolResult.split("\n").slice(0, -1).join("\n").includes("remove_constraints"));
      const schema = JSON.parse(err.toolResult.slice(err.toolResult.lastIndexOf("\n") + 1)) as
        { additionalProperties: boolean };
      assert.equal(schema.additionalProperties, false);
      assert.equal(err.otherDetails.length, 0, "the LocalizedMessage is read, not left over");
      return true;
    });
    // The user can.
    const removed = await client.updateWorkingState({ tenantId, sessionId, runId: "run-ws",
      sequence: "8", current: { constraints: ["rail only"] },
      transition: { removeConstraint: { constraint: "rail only", userEventId: "8" } } });
    assert.deepEqual(removed.state?.constraints, []);
    assert.equal(removed.change?.transition, "remove_constraint");
    assert.equal(removed.toolResult, "");
  });

  test("every provider format comes back typed, and a mismatch names both", async () => {
    const session = `${sessionId}-formats`;
    const plan = (await client.plan({ ...fixture.plan, tenantId, sessionId: session })).plan;
    assert.ok(plan);
    const formats: Record<string, unknown> = {};
    for (const [name, format] of Object.entries(FORMAT_NAMES) as [FormatName, BodyFormat][]) {
      const built = await client.build({ tenantId, sessionId: session,
        checkpoint: fixture.checkpoint, providerFormat: format });
      assert.equal(built.providerFormat, format, `${name}: ${built.providerFormat}`);
      const body = FORMATS[name].body(built);
      assert.deepEqual(body, providerBody(built));
      assert.deepEqual(body, bodyOf(built, format));
      const keys = Object.keys(body);
      for (const key of FORMATS[name].keys) assert.ok(keys.includes(key), `${name}: ${key}`);
      const text = JSON.stringify(body);
      for (const marker of FORMATS[name].pairs) {
        assert.ok(text.includes(marker), `${name}: ${marker}`);
      }
      for (const [other, { body: accessor }] of Object.entries(FORMATS)) {
        if (other === name) continue;
        assert.throws(() => accessor(built), (err: unknown) =>
          err instanceof ProviderBodyError && err.actual === format &&
          err.expected === FORMAT_NAMES[other as FormatName] &&
          err.message.includes(`${other} (`) && err.message.includes(`${name} (`));
      }
      const entry: Record<string, unknown> = { providerFormat: built.providerFormat,
        keys: keys.sort() };
      if (name === "gemini_generate_content") {
        const cached = geminiCachedContent(built);
        // the session's own: no other tenant or session with the same prefix finds it
        const tag = createHash("sha256").update(`${built.sessionKey}:${built.prefixSha256}`)
          .digest("hex").slice(0, 16);
        assert.equal(cached.displayName, `ce-${tag}-e${built.epoch}`);
        assert.match(cached.ttl, /^\d+s$/);
        assert.equal(cached.createBody.displayName, cached.displayName);
        assert.ok(cached.holds.length > 0);
        for (const held of cached.holds) {
          assert.ok(held in cached.createBody && !(held in cached.cachedBody), held);
        }
        assert.equal(cached.cachedBodyFor("cachedContents/x1").cachedContent,
          "cachedContents/x1");
        entry.cachedContent = { displayName: cached.displayName, holds: cached.holds,
          createKeys: Object.keys(cached.createBody).sort(), sessionKey: built.sessionKey,
          prefixSha256: built.prefixSha256 };
      } else {
        assert.equal(built.geminiCachedContent, undefined);
      }
      formats[name] = entry;
    }
    // no format named: the model's default, which the plan tells; NONE: no body
    const byDefault = await client.build({ tenantId, sessionId: session,
      checkpoint: fixture.checkpoint });
    assert.equal(byDefault.providerFormat, plan.defaultProviderFormat);
    assert.ok(Object.values(FORMAT_NAMES).includes(byDefault.providerFormat as BodyFormat));
    assert.ok(Object.keys(providerBody(byDefault)).length > 0);
    const none = await client.build({ tenantId, sessionId: session,
      checkpoint: fixture.checkpoint, providerFormat: "PROVIDER_FORMAT_NONE" });
    assert.equal(none.providerBodyJson, "");
    assert.throws(() => providerBody(none), /holds no provider body/);
    result.formats = { ...formats, default: providerFormatName(byDefault.providerFormat) };
  });

  test("malformed input lists its field violations", async () => {
    await assert.rejects(client.build({ tenantId, sessionId, checkpoint: {
      activeRunId: "run-1",
      items: [
        { id: "x1", sequence: "1", runId: "run-1", trust: "TRUST_LEVEL_USER", user: { text: "a" } },
        { id: "x1", sequence: "2", runId: "run-1", trust: "TRUST_LEVEL_USER", user: { text: "b" } },
      ] } }), (err: unknown) => {
      assert.ok(err instanceof ContextEngineError);
      assert.equal(err.code, GrpcStatus.INVALID_ARGUMENT);
      assert.equal(err.reason, "INVALID_ARGUMENT");
      assert.ok(err.violations.length > 0, "BadRequest field violations are parsed");
      return true;
    });
  });

  test("a request naming baseItemsKept alone is sent as it is: the service refuses it",
    async () => {
      const session = `${sessionId}-kept-alone`;
      await client.plan({ ...fixture.plan, tenantId, sessionId: session });
      await assert.rejects(client.build({ tenantId, sessionId: session,
        checkpoint: fixture.checkpoint, baseItemsKept: 2 }), (err: unknown) => {
        assert.ok(err instanceof ContextEngineError, String(err));
        assert.equal(err.code, GrpcStatus.INVALID_ARGUMENT);
        assert.deepEqual(err.violations.map((v) => [v.field, v.description]),
          [["base_items_kept", "is set without base_build_id"]]);
        return true;
      });
    });

  test("a refusal whose message holds non-ASCII, % and URI-reserved text keeps its reason",
    async () => {
      // grpc-js reads grpc-message with decodeURI: the service's own message (here quoting
      // the base named) must read back equal to the status's, or its detail would be dropped
      // as contradicting the call's
      const named = "base-é%41%2F#;/?:@&=+$,—✓";
      await assert.rejects(client.build({ tenantId, sessionId: `${sessionId}-named`,
        checkpoint: fixture.checkpoint, baseBuildId: named, baseItemsKept: 1 }),
      (err: unknown) => {
        assert.ok(err instanceof ContextEngineError, String(err));
        assert.equal(err.code, GrpcStatus.FAILED_PRECONDITION);
        assert.equal(err.reason, "BUILD_BASE_UNKNOWN");
        assert.equal(err.metadata.base_build_id, named);
        assert.equal(err.status?.message, err.details);
        assert.ok(err.details.includes(named), err.details);
        return true;
      });
    });

  test("maxMessageBytes bounds what the client receives", async () => {
    const session = `${sessionId}-limit`;
    await client.plan({ ...fixture.plan, tenantId, sessionId: session });
    const got = await client.getPlan({ tenantId, sessionId: session });
    // the response's size by the protobuf encoder, not by the channel
    const size = GetPlanResponse.encode(got).finish().length;
    assert.ok(size > 200, `a plan of ${size} bytes`);
    const small = new ContextEngineClient({ target, insecure: true, maxMessageBytes: size - 1 });
    const enough = new ContextEngineClient({ target, insecure: true, maxMessageBytes: size + 64 });
    try {
      await assert.rejects(small.getPlan({ tenantId, sessionId: session }), (err: unknown) =>
        err instanceof ContextEngineError && err.code === GrpcStatus.RESOURCE_EXHAUSTED &&
        err.reason === "");
      assert.deepEqual(await enough.getPlan({ tenantId, sessionId: session }), got);
    } finally {
      small.close();
      enough.close();
    }
  });

  test("DeleteSession erases a session: it is NOT_FOUND afterwards, and erasing again is a no-op",
    async () => {
      const session = `${sessionId}-erased`;
      await client.plan({ ...fixture.plan, tenantId, sessionId: session });
      const erased = await client.deleteSession({ tenantId, sessionId: session });
      assert.equal(erased.deleted, true);
      assert.equal(erased.plans, "1");
      assert.ok(Number(erased.events) >= 1);
      assert.ok(erased.planCacheSeconds > 0);
      assert.ok(erased.deletedAt instanceof Date);
      await assert.rejects(client.getPlan({ tenantId, sessionId: session }), (err: unknown) =>
        err instanceof ContextEngineError && err.reason === "SESSION_NOT_FOUND");
      const again = await client.deleteSession({ tenantId, sessionId: session });
      assert.equal(again.deleted, false);
      assert.equal(again.plans, "0");
      result.deleteSession = { deleted: erased.deleted, again: again.deleted };
    });

  test("incremental Build: each response equals a whole Build's; an erased base falls back",
    async () => {
      const session = `${sessionId}-incremental`;
      const incremental = new ContextEngineClient({ target, insecure: true, deadlineMs: 20_000 });
      const whole = new ContextEngineClient({ target, insecure: true, deadlineMs: 20_000,
        incremental: false });
      try {
        await client.plan({ ...fixture.plan, tenantId, sessionId: session });
        const items = [...fixture.checkpoint.items];
        let sequence = 5;
        const turn = (n: number) => {
          const run = `run-${n}`;
          items.push(Checkpoint.fromJSON({ items: [{ id: `turn-q${n}`,
            sequence: String(++sequence), runId: run, trust: "TRUST_LEVEL_USER",
            user: { text: `Question ${n}: and the day after? ünïcødé 日本 😀 ${"x".repeat(n)}` } },
          ] }).items[0]!);
          items.push(Checkpoint.fromJSON({ items: [{ id: `turn-a${n}`,
            sequence: String(++sequence), runId: run, trust: "TRUST_LEVEL_USER",
            assistant: { text: `Answer ${n}: EC ${300 + n} leaves at 09:${10 + n} (€${n}).` } },
          ] }).items[0]!);
          return run;
        };
        const same = async (run: string, step: string, format?: BodyFormat) => {
          const request = { tenantId, sessionId: session, estimatorFactor: 1,
            ...(format === undefined ? {} : { providerFormat: format }),
            checkpoint: { ...fixture.checkpoint, activeRunId: run, items } };
          const got = await incremental.build(request);
          const want = await whole.build(request);
          assert.equal(got.delta, undefined, step);
          assert.match(got.buildId, /^.+$/, `${step}: the Build was kept as a base`);
          assert.equal(want.buildId, "", `${step}: a whole Build that did not ask is not kept`);
          assert.deepEqual(BuildResponse.encode({ ...got, buildId: "" }).finish(),
            BuildResponse.encode(want).finish(), `${step}: byte for byte`);
          return got;
        };
        for (let n = 1; n <= 10; n++) {
          const run = turn(n);
          await same(run, `turn ${n}`,
            n % 3 === 0 ? "PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT" : undefined);
          if (n === 6) {  // a result rewritten in place: the items change from its position
            items[2] = Checkpoint.fromJSON({ items: [{ id: "r1", sequence: "3", runId: "run-0",
              trust: "TRUST_LEVEL_EXTERNAL_UNTRUSTED", toolResult: { callId: "call-1",
                toolName: "rail.search", eventId: "3", content: "[pointer] artifact:rail/3" } }],
            }).items[0]!;
            await same(run, "rewritten result");
          }
        }
        const before = incremental.buildStats();
        assert.equal(before.builds, 11);
        assert.equal(before.incremental, 10, JSON.stringify(before));
        assert.equal(before.fullResends, 0);
        assert.ok(before.bytesSaved > 0 && before.requestBytes < before.fullRequestBytes &&
          before.responseBytes < before.fullResponseBytes, JSON.stringify(before));

        // Erased and planned again (by another client): the replica no longer holds the base
        // this client names; it answers BUILD_BASE_UNKNOWN and the client resends whole.
        await whole.deleteSession({ tenantId, sessionId: session });
        await whole.plan({ ...fixture.plan, tenantId, sessionId: session });
        await same(turn(11), "after the erasure");
        const after = incremental.buildStats();
        assert.equal(after.fullResends, 1, JSON.stringify(after));
        assert.equal(after.incremental, before.incremental);
        await same(turn(12), "the resent Build is the next base");
        assert.equal(incremental.buildStats().incremental, before.incremental + 1);
        result.incremental = incremental.buildStats();
      } finally {
        incremental.close();
        whole.close();
      }
    });
});
