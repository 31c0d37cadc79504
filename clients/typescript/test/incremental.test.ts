/**
 * Incremental Build on the client's side, without a context-engine server: `prepare` (the
 * common prefix of the held items and the request's, the wire request and its exact bytes, the
 * caller's request left alone, a caller's later change of an item it sent noticed), `absorb`
 * (hand-built deltas: message spans that skip base messages from the front, the prefix from
 * the base, UTF-8 byte spans cut next to multi-byte characters, the size checks), and the
 * client's fallbacks against an in-process grpc-js server that answers as the contract says.
 */
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { after, before, beforeEach, describe, test } from "node:test";

import * as grpc from "@grpc/grpc-js";

import {
  BUILD_BASE_UNKNOWN,
  BuildRequest,
  BuildResponse,
  ContextEngineClient,
  ContextEngineError,
  ContextEngineService,
  ConversationItem,
  DeleteSessionResponse,
  DeltaMismatchError,
  type DeepPartial,
  GrpcStatus,
  IncrementalBuilds,
  Message,
  type Span,
  googleRpc,
} from "../src";

// ------------------------------------------------------------------------------ helpers

const utf8 = (text: string): Buffer => Buffer.from(text, "utf8");

function item(n: number, text = `item ${n}`): ConversationItem {
  return ConversationItem.fromPartial({ id: `i${n}`, sequence: String(n + 1), runId: "run-1",
    trust: "TRUST_LEVEL_USER", user: { text } });
}

function request(items: ConversationItem[],
                 extra: DeepPartial<BuildRequest> = {}): BuildRequest {
  return BuildRequest.fromPartial({ tenantId: "t", sessionId: "s", epoch: 2,
    estimatorFactor: 1.25, providerFormat: "PROVIDER_FORMAT_OPENAI_RESPONSES", ...extra,
    checkpoint: { activeRunId: "run-1", items, runtime: { currentDate: "2026-12-01" },
      workingState: { objective: "reach Milan ✓", constraints: ["rail only"] },
      summary: { text: "earlier: ünïcødé", depth: 1, replacedThroughSequence: "3" },
      ...(extra.checkpoint ?? {}) } });
}

function message(n: number, text = `message ${n}`): Message {
  return Message.fromPartial({ row: 10, role: "ROLE_USER", trust: "TRUST_LEVEL_USER",
    itemId: `i${n}`, text });
}

const encode = (r: BuildResponse): Buffer => Buffer.from(BuildResponse.encode(r).finish());

/** What a response looks like once on the wire and read back. */
function received(r: BuildResponse): [BuildResponse, Buffer] {
  const bytes = encode(r);
  return [BuildResponse.decode(bytes), bytes];
}

/** A full response as a server renders one. */
function full(messages: Message[], body: string, extra: DeepPartial<BuildResponse> = {}):
  BuildResponse {
  return BuildResponse.fromPartial({
    request: { prefixBlocks: [{ row: 1, trust: "TRUST_LEVEL_TRUSTED_CONFIGURATION",
      text: "You plan trips. ✈" }],
    tools: [{ name: "web.fetch", description: "Fetch a page", inputSchemaJson: "{}" }],
    messages },
    prefixSha256: "ab".repeat(32), epoch: 2, modelId: "m", sessionKey: "k", prefixTokens: 100,
    bodyTokens: 50, estimatedInputTokens: 150, estimatorFactor: 1.25,
    budget: { totalTokens: 1000 }, cacheBreakpoints: [{ name: "after_system", ttl: "5m" }],
    providerBodyJson: body, providerFormat: "PROVIDER_FORMAT_OPENAI_RESPONSES", buildId: "b1",
    ...extra,
  });
}

/** Holds `response` as the answer to a whole Build of `req`. */
function holding(req: BuildRequest, response: BuildResponse,
                 builds = new IncrementalBuilds()): IncrementalBuilds {
  const prepared = builds.prepare(req);
  assert.equal(prepared.base, undefined);
  builds.absorb(prepared, ...received(response));
  return builds;
}

/** The wire response: `fullResponse` relative to a base, as `delta` says. */
function deltaResponse(fullResponse: BuildResponse, sent: DeepPartial<BuildResponse>,
                       delta: DeepPartial<BuildResponse["delta"]>): BuildResponse {
  return BuildResponse.fromPartial({ ...fullResponse, ...sent, delta: {
    fullResponseBytes: String(encode(fullResponse).length),
    providerBodyBytes: String(utf8(fullResponse.providerBodyJson).length), ...delta } });
}

// ------------------------------------------------------------------------------ prepare

describe("prepare", () => {
  test("without a held Build the request goes whole, asking to be kept as a base", () => {
    const req = request([item(0), item(1)]);
    const prepared = new IncrementalBuilds().prepare(req);
    assert.equal(prepared.base, undefined);
    assert.equal(prepared.kept, 0);
    assert.equal(prepared.wire.keepBase, true);
    assert.deepEqual(Buffer.from(prepared.bytes),
      Buffer.from(BuildRequest.encode({ ...req, keepBase: true }).finish()));
    assert.equal(prepared.fullRequestBytes, BuildRequest.encode(req).finish().length);
  });

  test("appended items: the held ones kept, the new ones sent, bytes exact", () => {
    const big = "ü".repeat(9_000);  // an item past 16 KiB: three-byte length varints
    const first = [item(0), item(1, big), item(2)];
    const builds = holding(request(first), full([message(0)], "{}", { buildId: "b1" }));
    const req = request([...first, item(3, "new ✓"), item(4)]);
    const before = BuildRequest.toJSON(req);
    const prepared = builds.prepare(req);
    assert.equal(prepared.kept, 3);
    assert.equal(prepared.baseBuildId, "b1");
    assert.equal(prepared.wire.baseBuildId, "b1");
    assert.equal(prepared.wire.baseItemsKept, 3);
    assert.equal(prepared.wire.keepBase, false, "a Build naming a base is kept anyway");
    assert.deepEqual(prepared.wire.checkpoint?.items.map((i) => i.id), ["i3", "i4"]);
    // every other checkpoint field, and the request's own, as sent
    assert.deepEqual({ ...prepared.wire.checkpoint, items: [] }, { ...req.checkpoint, items: [] });
    assert.equal(prepared.wire.estimatorFactor, 1.25);
    assert.equal(prepared.wire.providerFormat, "PROVIDER_FORMAT_OPENAI_RESPONSES");
    assert.deepEqual(Buffer.from(prepared.bytes),
      Buffer.from(BuildRequest.encode(prepared.wire).finish()), "the wire bytes are the wire request");
    assert.equal(prepared.fullRequestBytes, BuildRequest.encode(req).finish().length);
    assert.ok(prepared.bytes.length < prepared.fullRequestBytes - 18_000);
    assert.deepEqual(BuildRequest.toJSON(req), before, "the caller's request is unchanged");
    assert.equal(req.checkpoint?.items.length, 5);
    assert.equal(req.baseBuildId, "");
  });

  test("items replaced from a position: kept up to it", () => {
    const first = [item(0), item(1), item(2), item(3)];
    const builds = holding(request(first), full([], "", { buildId: "b1" }));
    const prepared = builds.prepare(request([item(0), item(1), item(2, "a pointer now"),
      item(3)]));
    assert.equal(prepared.kept, 2);
    assert.deepEqual(prepared.wire.checkpoint?.items.map((i) => i.user?.text),
      ["a pointer now", "item 3"]);
    const fewer = builds.prepare(request([item(0)]));
    assert.equal(fewer.kept, 1, "a shorter checkpoint keeps its common prefix");
    assert.deepEqual(fewer.wire.checkpoint?.items, []);
    const none = builds.prepare(request([item(9)]));
    assert.equal(none.kept, 0);
    assert.equal(none.wire.baseBuildId, "b1", "the base is named even when nothing is kept");
    assert.deepEqual(Buffer.from(none.bytes), Buffer.from(BuildRequest.encode(none.wire).finish()));
  });

  test("an item the caller changed in place after sending it is noticed", () => {
    const req = request([item(0), item(1), item(2)]);
    const builds = holding(req, full([], "", { buildId: "b1" }));
    req.checkpoint!.items[1]!.user!.text = "edited in place";  // the objects it saw, changed
    req.checkpoint!.items.push(item(3));
    const prepared = builds.prepare(req);
    assert.equal(prepared.kept, 1, "the held copy is not the caller's object");
    assert.deepEqual(prepared.wire.checkpoint?.items.map((i) => i.id), ["i1", "i2", "i3"]);
    assert.equal(prepared.wire.checkpoint?.items[0]?.user?.text, "edited in place");
  });

  test("a request without a checkpoint names the base and keeps nothing", () => {
    const builds = holding(request([item(0)]), full([], "", { buildId: "b1" }));
    const req = BuildRequest.fromPartial({ tenantId: "t", sessionId: "s" });
    const prepared = builds.prepare(req);
    assert.equal(prepared.kept, 0);
    assert.equal(prepared.wire.checkpoint, undefined);
    assert.deepEqual(Buffer.from(prepared.bytes),
      Buffer.from(BuildRequest.encode(prepared.wire).finish()));
    assert.equal(prepared.fullRequestBytes, BuildRequest.encode(req).finish().length);
  });

  test("sessions are held least recently used first, up to maxSessions; forget drops one", () => {
    const builds = new IncrementalBuilds(2);
    const of = (session: string) => request([item(0)], { sessionId: session });
    holding(of("a"), full([], "", { buildId: "ba" }), builds);
    holding(of("b"), full([], "", { buildId: "bb" }), builds);
    builds.prepare(of("a"));  // a used: b is now the oldest
    holding(of("c"), full([], "", { buildId: "bc" }), builds);
    assert.equal(builds.size, 2);
    assert.ok(builds.holds("t", "a") && builds.holds("t", "c") && !builds.holds("t", "b"));
    assert.equal(builds.prepare(of("b")).base, undefined);
    builds.forget("t", "a");
    assert.equal(builds.prepare(of("a")).base, undefined);
    assert.equal(builds.prepare(request([item(0)], { tenantId: "u", sessionId: "c" })).base,
      undefined, "another tenant's session of the same id is another session");
    // as the Python client: holding no session is incremental: false, not a size
    for (const bad of [0, -1, 1.5, Number.NaN]) {
      assert.throws(() => new IncrementalBuilds(bad), /maxSessions must be an integer of at least 1/);
    }
  });

  test("a session forgotten while one of its Builds is in flight is not held again", () => {
    for (const between of ["forget this session", "forget another session"]) {
      const builds = holding(request([item(0)]), full([], "", { buildId: "b1" }));
      const inFlight = builds.prepare(request([item(0), item(1)]));  // a delta, then...
      const whole = builds.prepare(request([item(0)]), true);  // ...and a whole Build
      builds.forget("t", between === "forget this session" ? "s" : "other");
      builds.absorb(whole, ...received(full([], "", { buildId: "b2" })));
      const answered = full([], "", { buildId: "b3" });
      builds.absorb(inFlight, ...received(deltaResponse(answered, {}, { baseBuildId: "b1" })));
      if (between === "forget this session") {
        assert.equal(builds.holds("t", "s"), false, "a deleted session's Build came back");
      } else {
        assert.equal(builds.prepare(request([item(0), item(1)])).baseBuildId, "b3");
      }
    }
    // a Build prepared after the forget holds its answer
    const builds = holding(request([item(0)]), full([], "", { buildId: "b1" }));
    builds.forget("t", "s");
    holding(request([item(0)]), full([], "", { buildId: "b4" }), builds);
    assert.equal(builds.prepare(request([item(0)])).baseBuildId, "b4");
  });
});

// ------------------------------------------------------------------------------- absorb

describe("absorb", () => {
  // A base body whose JavaScript string indices and UTF-8 byte offsets part early:
  // "é" is 2 bytes, "😀" 4 bytes (2 UTF-16 units), "€" 3 bytes, "日本" 3 bytes each.
  const baseBody = '{"input":["é😀 first","second €uro","third"]}';
  const baseBytes = utf8(baseBody);
  const cut = baseBytes.indexOf(utf8("second"));      // just after "😀 first",
  const resume = baseBytes.indexOf(utf8("€uro"));     // at the first byte of "€"
  const inserted = utf8('second 日本 ');
  const fullBody = Buffer.concat([baseBytes.subarray(0, cut), inserted,
    baseBytes.subarray(resume)]).toString("utf8");
  const bodySpans: DeepPartial<Span>[] = [
    { baseStart: 0, baseCount: cut, newCount: inserted.length },
    { baseStart: resume, baseCount: baseBytes.length - resume, newCount: 0 },
  ];

  const baseMessages = [0, 1, 2, 3, 4].map((n) => message(n, `base ${n} ✓`));
  const base = full(baseMessages, baseBody, { buildId: "b1",
    geminiCachedContent: { displayName: "ce-x-e2", ttl: "300s",
      createBodyJson: '{"model":"g","systemInstruction":"ünï"}', cachedBodyJson: '{"c":"😀"}',
      holds: ["systemInstruction"] } });

  function absorbing(fullResponse: BuildResponse, sent: DeepPartial<BuildResponse>,
                     delta: DeepPartial<BuildResponse["delta"]>) {
    const builds = holding(request([item(0)]), base);
    const prepared = builds.prepare(request([item(0), item(1)]));
    assert.equal(prepared.baseBuildId, "b1");
    const wire = deltaResponse(fullResponse, sent, { baseBuildId: "b1", ...delta });
    return { builds, prepared, wire, absorbed: () => builds.absorb(prepared, ...received(wire)) };
  }

  test("message spans skip base messages from the front; prefix, body and Gemini spans",
    () => {
      const fresh = [message(7, "new 7"), message(8, "new 8 日本")];
      const want = full([baseMessages[2]!, baseMessages[3]!, fresh[0]!, baseMessages[0]!,
        fresh[1]!], fullBody, { buildId: "b2", geminiCachedContent: {
          ...base.geminiCachedContent!, createBodyJson: '{"model":"g","systemInstruction":"ünï"}',
          cachedBodyJson: '{"c":"😀","d":"€"}' } });
      const cachedBase = utf8(base.geminiCachedContent!.cachedBodyJson);
      const { absorbed } = absorbing(want, {
        request: { prefixBlocks: [], tools: [], messages: fresh },
        providerBodyJson: inserted.toString("utf8"),
        geminiCachedContent: { ...want.geminiCachedContent!, createBodyJson: "",
          cachedBodyJson: ',"d":"€"' },
      }, {
        prefixFromBase: true,
        messageSpans: [{ baseStart: 2, baseCount: 2, newCount: 1 },
          { baseStart: 0, baseCount: 1, newCount: 1 }],
        providerBodySpans: bodySpans,
        geminiCreateBodySpans: [{ baseStart: 0,
          baseCount: utf8(base.geminiCachedContent!.createBodyJson).length, newCount: 0 }],
        geminiCachedBodySpans: [{ baseStart: 0, baseCount: cachedBase.length - 1,
          newCount: utf8(',"d":"€"').length }, { baseStart: cachedBase.length - 1,
          baseCount: 1, newCount: 0 }],
      });
      const got = absorbed();
      assert.equal(got.incremental, true);
      assert.equal(got.response.delta, undefined);
      assert.equal(got.response.buildId, "b2", "the build id it was sent with");
      assert.deepEqual(got.response.request?.messages.map((m) => m.itemId),
        ["i2", "i3", "i7", "i0", "i8"]);
      assert.equal(got.response.providerBodyJson, fullBody);
      assert.equal(got.response.providerBodyJson,
        '{"input":["é😀 first","second 日本 €uro","third"]}');
      assert.deepEqual(got.response, want);
      assert.deepEqual(encode(got.response), encode(want), "byte for byte");
      assert.equal(got.fullResponseBytes, encode(want).length);
    });

  test("the next delta reads back against the reconstructed one", () => {
    const fresh = [message(7, "new 7")];
    const want = full([...baseMessages.slice(1), fresh[0]!], fullBody, { buildId: "b2",
      geminiCachedContent: base.geminiCachedContent });
    const step = absorbing(want, { request: { messages: fresh },
      providerBodyJson: inserted.toString("utf8") }, { prefixFromBase: true,
      messageSpans: [{ baseStart: 1, baseCount: 4, newCount: 1 }], providerBodySpans: bodySpans });
    const first = step.absorbed();
    assert.deepEqual(first.response, want);
    first.response.request!.messages[0]!.text = "changed by the caller";  // not the held copy
    first.response.request!.prefixBlocks[0]!.text = "changed too";

    const next = full([...want.request!.messages, message(9, "🙂")],
      `${fullBody.slice(0, -1)},"🙂"]`, { buildId: "b3",
        geminiCachedContent: base.geminiCachedContent });
    const prepared = step.builds.prepare(request([item(0), item(1), item(2)]));
    assert.equal(prepared.baseBuildId, "b2");
    assert.equal(prepared.kept, 2);
    const nextBytes = utf8(next.providerBodyJson);
    const head = utf8(fullBody).length - 1;
    const wire = deltaResponse(next, { request: { messages: [message(9, "🙂")] },
      providerBodyJson: nextBytes.subarray(head).toString("utf8") }, { baseBuildId: "b2",
      prefixFromBase: true, messageSpans: [{ baseStart: 0, baseCount: 5, newCount: 1 }],
      providerBodySpans: [{ baseStart: 0, baseCount: head, newCount: nextBytes.length - head }] });
    const got = step.builds.absorb(prepared, ...received(wire));
    assert.deepEqual(got.response, next);
    assert.deepEqual(encode(got.response), encode(next));
  });

  test("no spans: messages and bodies as sent; the prefix as sent when not from the base",
    () => {
      const want = full([message(5)], '{"whole":"ünï"}', { buildId: "b2", request: {
        prefixBlocks: [{ row: 1, text: "another prefix" }], tools: [],
        messages: [message(5)] } });
      const { absorbed } = absorbing(want, {}, { prefixFromBase: false });
      const got = absorbed();
      assert.deepEqual(got.response, want);
      assert.equal(got.incremental, true);
    });

  test("a size that does not check, or spans that do not fit, is a DeltaMismatchError", () => {
    const want = full([baseMessages[0]!, message(7)], fullBody, { buildId: "b2" });
    const sent = { request: { messages: [message(7)] },
      providerBodyJson: inserted.toString("utf8") };
    const good = { prefixFromBase: true, providerBodySpans: bodySpans,
      messageSpans: [{ baseStart: 0, baseCount: 1, newCount: 1 }] };
    const cases: [string, DeepPartial<BuildResponse["delta"]>, RegExp][] = [
      ["full size", { ...good, fullResponseBytes: "12" }, /full response is \d+ bytes/],
      ["body size", { ...good, providerBodyBytes: "3" }, /provider_body_json is \d+ bytes/],
      ["past the base", { ...good, messageSpans: [{ baseStart: 4, baseCount: 2,
        newCount: 1 }] }, /past the base's 5/],
      ["left over", { ...good, messageSpans: [{ baseStart: 0, baseCount: 1, newCount: 0 }] },
        /1 sent entries left over/],
      ["body past the base", { ...good, providerBodySpans: [{ baseStart: 0,
        baseCount: baseBytes.length + 1, newCount: inserted.length }] }, /past the base's/],
      ["another base", { ...good, baseBuildId: "b0" }, /the Build named "b1"/],
    ];
    for (const [what, delta, message] of cases) {
      const { absorbed } = absorbing(want, sent, delta);
      assert.throws(absorbed, (err: unknown) => err instanceof DeltaMismatchError &&
        message.test(err.message), what);
    }
    // a byte span that cuts a character in two
    const { absorbed } = absorbing(want, sent, { ...good, providerBodySpans: [
      { baseStart: 0, baseCount: baseBytes.indexOf(utf8("😀")) + 1,
        newCount: inserted.length }] });
    assert.throws(absorbed, /not valid UTF-8|provider_body_json is/);
  });

  test("a Build that named a base answered without a delta: the server ignores bases", () => {
    const builds = holding(request([item(0)]), base);
    const prepared = builds.prepare(request([item(0), item(1)]));
    assert.equal(prepared.baseBuildId, "b1");
    assert.throws(() => builds.absorb(prepared, ...received(full([message(1)], "{}",
      { buildId: "" }))), DeltaMismatchError);
    // this Build goes again whole; bases are still named (a replica beside it may keep them)
    const again = builds.prepare(request([item(0), item(1)]), true);
    assert.equal(again.base, undefined);
    assert.equal(again.wire.keepBase, true);
    // and a delta answering a whole Build is refused likewise
    const whole = new IncrementalBuilds().prepare(request([item(0)]));
    assert.throws(() => new IncrementalBuilds().absorb(whole, ...received(deltaResponse(base, {},
      { baseBuildId: "b0" }))), /named no base/);
  });
});

// ----------------------------------------------------------- the client, against a fake

/**
 * An in-process server that answers Build as the contract says, with a rendering of its own:
 * one message per item, a JSON body of their texts. Bases are held per build id; a delta keeps
 * the common prefix of messages and the common head of the body's bytes (on a character
 * boundary).
 */
class FakeEngine {
  readonly server = new grpc.Server();
  address = "";
  bases = new Map<string, { session: string; items: ConversationItem[]; response: BuildResponse }>();
  seen: BuildRequest[] = [];
  ignoresBases = false;
  corruptSize = false;
  /** Answers a whole Build with a delta (a faulty server). */
  deltaForWhole = false;
  refuse: grpc.status | undefined;
  /** Called with each Build request as it arrives (before it is answered). */
  onBuild: ((req: BuildRequest) => void) | undefined;
  /** DeleteSession: told when the erasure begins, answered once `erased` resolves. */
  deleting: { begun: () => void; erased: Promise<void> } | undefined;

  async start(): Promise<void> {
    this.server.addService(ContextEngineService, {
      deleteSession: (_call: grpc.ServerUnaryCall<unknown, DeleteSessionResponse>,
                      cb: grpc.sendUnaryData<DeleteSessionResponse>) => {
        const deleting = this.deleting;
        deleting?.begun();
        void (deleting?.erased ?? Promise.resolve()).then(() =>
          cb(null, DeleteSessionResponse.fromPartial({ deleted: true })));
      },
      build: (call: grpc.ServerUnaryCall<BuildRequest, BuildResponse>,
              cb: grpc.sendUnaryData<BuildResponse>) => {
        try {
          cb(null, this.build(call.request));
        } catch (err) {
          cb(err as grpc.ServiceError);
        }
      },
    } as unknown as grpc.UntypedServiceImplementation);
    const port = await new Promise<number>((resolve, reject) => this.server.bindAsync(
      "127.0.0.1:0", grpc.ServerCredentials.createInsecure(),
      (err, p) => (err ? reject(err) : resolve(p))));
    this.address = `127.0.0.1:${port}`;
  }

  /** The full response to a whole checkpoint. */
  render(req: BuildRequest, items: ConversationItem[], buildId: string): BuildResponse {
    const messages = items.map((it, n) => Message.fromPartial({ row: 10, role: "ROLE_USER",
      itemId: it.id, text: `${n}: ${it.user?.text ?? ""}` }));
    return full(messages, JSON.stringify({ epoch: req.epoch, input: messages.map((m) => m.text),
      factor: req.estimatorFactor ?? 1 }), { buildId });
  }

  build(req: BuildRequest): BuildResponse {
    this.seen.push(req);
    this.onBuild?.(req);
    if (this.refuse !== undefined) {
      throw Object.assign(new Error("refused"), { code: this.refuse, details: "refused" });
    }
    const session = `${req.tenantId}/${req.sessionId}`;
    const named = req.baseBuildId !== "" && !this.ignoresBases;
    const base = named ? this.bases.get(req.baseBuildId) : undefined;
    if (named && (base === undefined || base.session !== session)) {
      const md = new grpc.Metadata();
      md.set("grpc-status-details-bin", Buffer.from(googleRpc.Status.encode(
        googleRpc.Status.fromPartial({ code: GrpcStatus.FAILED_PRECONDITION,
          message: "base unknown", details: [{
            typeUrl: "type.googleapis.com/google.rpc.ErrorInfo",
            value: Buffer.from(googleRpc.ErrorInfo.encode(googleRpc.ErrorInfo.fromPartial({
              reason: BUILD_BASE_UNKNOWN, domain: "context-engine",
              metadata: { base_build_id: req.baseBuildId } })).finish()) }] })).finish()));
      throw Object.assign(new Error("base unknown"),
        { code: GrpcStatus.FAILED_PRECONDITION, details: "base unknown", metadata: md });
    }
    const items = [...(base?.items.slice(0, req.baseItemsKept) ?? []),
      ...(req.checkpoint?.items ?? [])];
    const keep = (req.keepBase || named) && !this.ignoresBases;
    const buildId = keep ? randomBytes(8).toString("hex") : "";
    const whole = this.render(req, items, buildId);
    if (keep) this.bases.set(buildId, { session, items, response: whole });
    if (base === undefined && this.deltaForWhole) {
      return BuildResponse.fromPartial({ ...whole, delta: { baseBuildId: "b0" } });
    }
    if (base === undefined) return whole;

    const old = base.response;
    const oldMessages = old.request!.messages;
    const newMessages = whole.request!.messages;
    let same = 0;
    while (same < Math.min(oldMessages.length, newMessages.length) &&
      Message.encode(oldMessages[same]!).finish().toString() ===
      Message.encode(newMessages[same]!).finish().toString()) same++;
    const oldBody = utf8(old.providerBodyJson);
    const newBody = utf8(whole.providerBodyJson);
    let head = 0;
    while (head < Math.min(oldBody.length, newBody.length) && oldBody[head] === newBody[head]) {
      head++;
    }
    while (head > 0 && (newBody[head]! & 0xc0) === 0x80) head--;  // a character boundary
    return deltaResponse(whole, {
      request: { prefixBlocks: [], tools: [], messages: newMessages.slice(same) },
      providerBodyJson: newBody.subarray(head).toString("utf8"),
    }, { baseBuildId: base === undefined ? "" : req.baseBuildId, prefixFromBase: true,
      messageSpans: [{ baseStart: 0, baseCount: same, newCount: newMessages.length - same }],
      providerBodySpans: [{ baseStart: 0, baseCount: head, newCount: newBody.length - head }],
      ...(this.corruptSize ? { fullResponseBytes: "1" } : {}) });
  }
}

describe("the client's incremental Build", () => {
  const engine = new FakeEngine();
  const opened: ContextEngineClient[] = [];
  let session = "";

  function open(options: Partial<ConstructorParameters<typeof ContextEngineClient>[0]> = {}) {
    const client = new ContextEngineClient({ target: engine.address, insecure: true,
      deadlineMs: 5_000, ...options });
    opened.push(client);
    return client;
  }

  function step(n: number, extra: DeepPartial<BuildRequest> = {}): DeepPartial<BuildRequest> {
    const items = Array.from({ length: n }, (_, i) => item(i, `turn ${i} ${"é".repeat(i)}`));
    return { tenantId: "t", sessionId: session, estimatorFactor: 1, ...extra,
      checkpoint: { activeRunId: "run-1", items } };
  }

  /** What a whole Build answers, build id aside. */
  function whole(req: DeepPartial<BuildRequest>, buildId: string): Buffer {
    const r = BuildRequest.fromPartial(req);
    return encode(engine.render(r, r.checkpoint?.items ?? [], buildId));
  }

  before(() => engine.start());
  after(() => {
    for (const c of opened) c.close();
    engine.server.forceShutdown();
  });
  beforeEach(() => {
    session = `s-${randomBytes(4).toString("hex")}`;
    engine.seen = [];
    engine.ignoresBases = false;
    engine.corruptSize = false;
    engine.refuse = undefined;
    engine.onBuild = undefined;
    engine.deleting = undefined;
  });

  test("each Build after the first sends only new items and returns the full response",
    async () => {
      const client = open();
      for (let n = 1; n <= 6; n++) {
        const got = await client.build(step(n));
        assert.equal(got.delta, undefined);
        assert.match(got.buildId, /^[0-9a-f]{16}$/);
        assert.deepEqual(encode(got), whole(step(n), got.buildId), `step ${n}`);
      }
      assert.deepEqual(engine.seen.map((r) => [r.baseItemsKept, r.checkpoint?.items.length,
        r.keepBase]), [[0, 1, true], [1, 1, false], [2, 1, false], [3, 1, false],
        [4, 1, false], [5, 1, false]]);
      const stats = client.buildStats();
      assert.equal(stats.builds, 6);
      assert.equal(stats.incremental, 5);
      assert.equal(stats.fullResends, 0);
      assert.ok(stats.requestBytes < stats.fullRequestBytes, JSON.stringify(stats));
      assert.ok(stats.responseBytes < stats.fullResponseBytes, JSON.stringify(stats));
      assert.equal(stats.bytesSaved, stats.fullRequestBytes + stats.fullResponseBytes -
        stats.requestBytes - stats.responseBytes);
      assert.ok(stats.bytesSaved > 0);
    });

  test("a base the replica does not hold: the same Build again whole, once, transparently",
    async () => {
      const client = open();
      await client.build(step(2));
      engine.bases.clear();  // evicted, or another replica
      const got = await client.build(step(3));
      assert.deepEqual(encode(got), whole(step(3), got.buildId));
      assert.deepEqual(engine.seen.map((r) => [r.baseBuildId !== "", r.checkpoint?.items.length]),
        [[false, 2], [true, 1], [false, 3]]);
      assert.equal(client.buildStats().fullResends, 1);
      const next = await client.build(step(4));  // the resent Build is the next base
      assert.deepEqual(encode(next), whole(step(4), next.buildId));
      assert.equal(engine.seen.at(-1)?.baseItemsKept, 3);
      assert.equal(client.buildStats().incremental, 1);
    });

  test("a Build sent again whole is the one first sent, though the caller changed its request",
    async () => {
      const client = open();
      await client.build(step(2));
      engine.bases.clear();  // evicted, or another replica
      const opaque = Buffer.from("ORIGINAL");
      const input = step(3);
      input.checkpoint!.items!.push({ id: "r3", sequence: "4", runId: "run-1",
        trust: "TRUST_LEVEL_USER", reasoning: { provider: "anthropic", opaque } });
      engine.onBuild = (req) => {  // the first attempt has arrived: the caller reuses its buffer
        if (req.baseBuildId !== "") opaque.write("MUTATED!");
      };
      await client.build(input);
      const sent = engine.seen.slice(1).map((r) => r.checkpoint!.items.at(-1)!.reasoning!.opaque
        .toString());
      assert.deepEqual(sent, ["ORIGINAL", "ORIGINAL"]);  // the incremental one, then whole
      assert.equal(engine.seen.at(-1)!.checkpoint!.items.length, 4);
      assert.equal(client.buildStats().fullResends, 1);
    });

  test("a delta whose size does not check: sent again whole", async () => {
    const client = open();
    await client.build(step(2));
    engine.corruptSize = true;
    const got = await client.build(step(3));
    engine.corruptSize = false;
    assert.deepEqual(encode(got), whole(step(3), got.buildId));
    assert.deepEqual(engine.seen.map((r) => r.baseBuildId !== ""), [false, true, false]);
    assert.deepEqual([client.buildStats().fullResends, client.buildStats().incremental], [1, 0]);
  });

  test("a server that ignores bases: that Build again whole; a replica keeping bases serves them",
    async () => {
    const client = open();
    engine.ignoresBases = true;
    const first = await client.build(step(1));
    assert.equal(first.buildId, "", "the old server keeps nothing");
    // a server that answered with a build id but ignores bases afterwards
    engine.ignoresBases = false;
    await client.build(step(2));
    engine.ignoresBases = true;
    const got = await client.build(step(3));
    assert.deepEqual(encode(got), whole(step(3), ""));
    await client.build(step(4));
    // a replica that keeps bases (a fleet being upgraded): bases are named to it again
    engine.ignoresBases = false;
    await client.build(step(5));
    await client.build(step(6));
    assert.deepEqual(engine.seen.map((r) => [r.baseBuildId !== "", r.checkpoint?.items.length]),
      [[false, 1], [false, 2], [true, 1], [false, 3], [false, 4], [false, 5], [true, 1]]);
    assert.equal(client.buildStats().fullResends, 1);
  });

  test("a faulty answer is a ContextEngineError (INTERNAL), never a bare mismatch", async () => {
    const client = open();
    engine.deltaForWhole = true;
    try {
      // a whole Build answered with a delta: no resend mends it
      await assert.rejects(client.build(step(1)), (err: unknown) =>
        err instanceof ContextEngineError && err.code === GrpcStatus.INTERNAL &&
        err.method === "Build" && /a delta answers a Build that named no base/.test(err.details) &&
        err.cause instanceof DeltaMismatchError);
      // the whole resend after a mismatch answered with a delta: the same
      engine.deltaForWhole = false;
      await client.build(step(2));
      engine.corruptSize = true;
      engine.deltaForWhole = true;
      await assert.rejects(client.build(step(3)), (err: unknown) =>
        err instanceof ContextEngineError && err.code === GrpcStatus.INTERNAL);
    } finally {
      engine.deltaForWhole = false;
      engine.corruptSize = false;
    }
    assert.deepEqual(engine.seen.map((r) => r.baseBuildId !== ""), [false, false, true, false]);
  });

  test("a per-call deadline that is not a positive, finite number is refused, nothing sent",
    async () => {
      const client = open();
      for (const deadlineMs of [0, -5, Number.NaN, Number.POSITIVE_INFINITY]) {
        for (const call of [() => client.build(step(1), { deadlineMs }),
          () => client.getPlan({ tenantId: "t", sessionId: session }, { deadlineMs })]) {
          await assert.rejects(call(), (err: unknown) => err instanceof RangeError &&
            err.message.startsWith("deadlineMs must be a positive, finite number"));
        }
      }
      assert.deepEqual(engine.seen, []);
      for (const deadlineMs of [0, Number.NaN, Number.POSITIVE_INFINITY]) {
        assert.throws(() => open({ deadlineMs }), RangeError);
        const waited = client.waitForReady(deadlineMs); // a rejection, never a throw
        await assert.rejects(waited, (err: unknown) => err instanceof RangeError &&
          err.message.startsWith("deadlineMs must be a positive, finite number"));
      }
      // waitForReady waits on a Node timer, which fires one past 2^31 - 1 ms after 1 ms; a
      // call's deadline may be longer (grpc-js takes it as none), and such a call is answered
      await assert.rejects(client.waitForReady(2 ** 31), (err: unknown) =>
        err instanceof RangeError && err.message.startsWith("deadlineMs must be at most"));
      assert.deepEqual(engine.seen, []);
      const long = open({ deadlineMs: 2 ** 40 });
      await long.build(step(1));
      assert.equal(engine.seen.length, 1);
    });

  test("other errors propagate and drop the session's base", async () => {
    const client = open();
    await client.build(step(2));
    engine.refuse = GrpcStatus.INVALID_ARGUMENT;
    await assert.rejects(client.build(step(3)), (err: unknown) =>
      (err as { code?: number }).code === GrpcStatus.INVALID_ARGUMENT);
    engine.refuse = undefined;
    await client.build(step(3));
    assert.deepEqual(engine.seen.map((r) => r.baseBuildId !== ""), [false, true, false]);
    assert.equal(client.buildStats().builds, 2, "a failed Build is not counted");
  });

  test("forgetSession and deleteSession drop the base; incremental: false sends whole",
    async () => {
      const client = open();
      await client.build(step(1));
      client.forgetSession("t", session);
      await client.build(step(2));
      await client.deleteSession({ tenantId: "t", sessionId: session }).catch(() => undefined);
      await client.build(step(3));
      assert.deepEqual(engine.seen.map((r) => r.baseBuildId), ["", "", ""]);

      engine.seen = [];
      const plain = open({ incremental: false });
      const got = await plain.build(step(2));
      assert.deepEqual(encode(got), whole(step(2), ""));
      await plain.build(step(3));
      assert.deepEqual(engine.seen.map((r) => [r.baseBuildId, r.keepBase]),
        [["", false], ["", false]]);
      assert.equal(plain.buildStats().builds, 0);
    });

  test("a session forgotten while a Build is sent whole again is not held after it", async () => {
    const client = open();
    await client.build(step(2));
    engine.bases.clear();  // the next Build's base: unknown to the replica
    engine.onBuild = (req) => {  // the caller forgets the session during the first attempt
      if (req.baseBuildId !== "") client.forgetSession("t", session);
    };
    const got = await client.build(step(3));
    engine.onBuild = undefined;
    assert.deepEqual(encode(got), whole(step(3), got.buildId));
    await client.build(step(4));
    assert.deepEqual(engine.seen.map((r) => r.baseBuildId !== ""), [false, true, false, false]);
    assert.equal(client.buildStats().fullResends, 1);
  });

  test("a client closed as a Build is about to be sent again whole: the typed error", async () => {
    const client = open();
    await client.build(step(2));
    engine.bases.clear();  // the next Build's base: unknown to the replica
    // close() between the refusal and the resend (from a microtask of the same tick)
    const builds = (client as unknown as { builds: { drop: (t: string, s: string) => void } })
      .builds;
    const drop = builds.drop.bind(builds);
    builds.drop = (t: string, s: string) => {
      drop(t, s);
      client.close();
    };
    await assert.rejects(client.build(step(3)), (err: unknown) =>
      err instanceof ContextEngineError && err.code === grpc.status.CANCELLED &&
      err.details === "the client is closed: nothing was sent");
    assert.deepEqual(engine.seen.map((r) => r.baseBuildId !== ""), [false, true]);
  });

  test("a Build answered while deleteSession runs is not held after it", async () => {
    const client = open();
    await client.build(step(2));
    let begun!: () => void;
    let erase!: () => void;
    const entered = new Promise<void>((resolve) => { begun = resolve; });
    engine.deleting = { begun, erased: new Promise<void>((resolve) => { erase = resolve; }) };
    const deleting = client.deleteSession({ tenantId: "t", sessionId: session });
    await entered;  // the client forgot the session; the erasure runs
    await client.build(step(3));  // whole, and answered meanwhile
    erase();
    assert.equal((await deleting).deleted, true);
    await client.build(step(4));
    assert.deepEqual(engine.seen.map((r) => r.baseBuildId !== ""), [false, false, false]);
  });

  test("a request naming a base itself goes as it is; its delta comes back as received",
    async () => {
      const client = open();
      const first = await client.build(step(2));
      const got = await client.build({ ...step(3), baseBuildId: first.buildId,
        baseItemsKept: 2, checkpoint: { activeRunId: "run-1", items: [item(2)] } });
      assert.ok(got.delta !== undefined);
      assert.equal(got.delta.baseBuildId, first.buildId);
    });
});
