#!/usr/bin/env node
/**
 * A multi-turn, tool-using agent session driven through context-engine with a deterministic
 * fake model. Each turn is a run: the runtime admits it with Plan, then loops Build -> model ->
 * tools until the model answers, and reports the provider's usage after every model call.
 *
 * It shows what a runtime sees on every request: the budget table, the pressure record, the
 * cache markers and the prefix hash (the same for every request of an epoch). Along the way a
 * tool returns an oversized page (excerpted, older results become pointers), history outgrows
 * the window (Build says compaction is needed; the runtime compacts and builds again), and the
 * session is routed to a larger model (an explicit rotation: a new epoch and a new prefix).
 * The model records its working state through the engine's own `context.update_working_state`
 * tool: the runtime sends that call to UpdateWorkingState exactly as the provider returned it
 * and gives the model the engine's answer as the call's result.
 *
 *   npm run build && CE_GRPC_ADDR=127.0.0.1:50051 node dist/examples/agent_loop.js
 *   npx context-engine-agent-loop --grpc-addr 127.0.0.1:50051    # where the package is installed
 *
 * The server's address comes from `--grpc-addr` or CE_GRPC_ADDR (default 127.0.0.1:50051); a
 * bearer token (none in dev mode) from CE_TOKEN or, with `--token-stdin`, from one line of
 * standard input. Tokens never go on the command line, where other users of the machine can
 * read them. `--tenant` or CE_TENANT_ID, `--session` or CE_SESSION_ID: default fresh ids.
 * `--tls` connects over TLS with the system roots (plaintext otherwise, as a dev-mode server
 * on loopback expects; a token then goes only to this machine unless `--plaintext`).
 * `--print-body FORMAT` (anthropic_messages, openai_responses,
 * openai_chat_completions, gemini_generate_content, bedrock_converse; default: none) asks every
 * Build for that provider's body and prints the first one as JSON (for Gemini also the body
 * that creates the cached content of the pinned prefix).
 */
import { createHash, randomBytes } from "node:crypto";
import * as readline from "node:readline";
import { parseArgs } from "node:util";

import {
  type BuildResponse,
  type Checkpoint,
  ContextEngineClient,
  ContextEngineError,
  type ConversationItem,
  FORMAT_NAMES,
  type FormatName,
  type Input,
  type ModelSpec,
  type PlanRequest,
  type Summary,
  ToolCall,
  WorkingState,
  bodyOf,
  geminiCachedContent,
  isLoopback,
} from "@context-engine/client";

const SMALL_MODEL: Input<ModelSpec> = {
  modelId: "acme-chat-12k",
  // the reserve is held small so that this small window's body holds history's 8,000-token floor
  capabilities: { contextWindow: 12_000, outputReserve: 1_500, breakpointBudget: 4 },
};
const LARGE_MODEL: Input<ModelSpec> = {
  modelId: "acme-chat-64k",
  capabilities: { contextWindow: 64_000, outputReserve: 8_000, breakpointBudget: 4 },
};

/** The engine's working-state control tool, and the name a provider returns for it. */
const WORKING_STATE_TOOL = "context.update_working_state";
const WORKING_STATE_TOOL_NAMES = new Set([WORKING_STATE_TOOL, "context__update_working_state"]);

const SCHEMA_URL = JSON.stringify({ type: "object", properties: { url: { type: "string" } },
  required: ["url"] });
const SCHEMA_RAIL = JSON.stringify({ type: "object", properties: { from: { type: "string" },
  to: { type: "string" }, date: { type: "string" } }, required: ["from", "to", "date"] });

// ------------------------------------------------------------------------------ the tools

/** Deterministic filler text: the same seed always gives the same words. */
function prose(seed: string, words: number): string {
  const vocabulary = ("platform fare connection seat reservation window aisle quiet coach " +
    "dining car luggage transfer hotel breakfast meeting room conference station tram " +
    "ticket refund delay schedule timetable evening morning return outbound").split(" ");
  const out: string[] = [];
  let state = createHash("sha256").update(seed).digest();
  for (let i = 0; i < words; i++) {
    if (i % 32 === 0) state = createHash("sha256").update(state).digest();
    out.push(vocabulary[state[i % 32]! % vocabulary.length]!);
  }
  return out.join(" ");
}

/** The fake tools: deterministic results, sized like real pages and API answers. */
function runTool(call: ToolCall): { content: string; artifactRef?: string } {
  const args = JSON.parse(call.argumentsJson ?? "{}") as Record<string, string>;
  if (call.name === "rail.search") {
    return { content: `Connections ${args.from} -> ${args.to} on ${args.date}: ` +
      prose(`rail:${args.from}:${args.to}:${args.date}`, 900) };
  }
  if (call.name === "web.fetch") {
    const oversized = (args.url ?? "").includes("hotel-guide");
    const words = oversized ? 12_000 : 1_400;
    return { content: `<html><body><h1>${args.url}</h1><p>` +
      prose(`web:${args.url}`, words) + "</p></body></html>",
    artifactRef: `artifact:web/${createHash("sha256").update(args.url ?? "").digest("hex")
      .slice(0, 8)}` };
  }
  return { content: JSON.stringify({ error: "unknown tool", name: call.name }) };
}

// ------------------------------------------------------------------------------ the model

interface Turn {
  user: string;
  /** Batches of tool calls the model makes, one batch per step (parallel calls share one). */
  batches: { name: string; args: Record<string, unknown> }[][];
  answer: string;
  /** Route the session to the larger model before this turn. */
  routeToLargeModel?: boolean;
}

const TURNS: Turn[] = [
  { user: "I need to be in Milan on 3 December for a 14:00 meeting. Find me a train from Zurich.",
    batches: [[{ name: "rail.search", args: { from: "Zurich HB", to: "Milano Centrale",
      date: "2026-12-03" } }],
    // what the search established, recorded through the engine's control tool (the provider
    // returns the call under its name form); event 3 is the search's result
    [{ name: "context__update_working_state", args: {
      add_facts: [{ statement: "The rail search lists EC 09:33 Zurich HB -> 12:50 Milano " +
        "Centrale", source_event_ids: [3], trust: "external_untrusted" }],
      next_action: "compare hotels near Milano Centrale" } }]],
    answer: "The 09:33 EC from Zurich HB arrives at 12:50, in time for 14:00 (per the rail search)." },
  { user: "Compare two hotels near Milano Centrale.",
    batches: [[{ name: "web.fetch", args: { url: "https://hotels.example/milano/centrale-a" } },
      { name: "web.fetch", args: { url: "https://hotels.example/milano/centrale-b" } }]],
    answer: "Hotel A is two minutes from the station; Hotel B has a meeting room (per their pages)." },
  { user: "Read the city's hotel guide as well.",
    batches: [[{ name: "web.fetch", args: { url: "https://city.example/hotel-guide" } }]],
    answer: "The guide lists both hotels; it recommends booking before 20 November." },
  { user: "And the way back on Friday evening?",
    batches: [[{ name: "rail.search", args: { from: "Milano Centrale", to: "Zurich HB",
      date: "2026-12-05" } }],
    [{ name: "web.fetch", args: { url: "https://rail.example/milano-zurich/evening" } }]],
    answer: "The 18:10 EC reaches Zurich HB at 21:27; the 19:10 one is often delayed." },
  { user: "Check the return fares once more, and the lounge at Centrale.",
    batches: [[{ name: "rail.search", args: { from: "Milano Centrale", to: "Zurich HB",
      date: "2026-12-05" } }, { name: "web.fetch",
      args: { url: "https://rail.example/milano-centrale/lounge" } }]],
    answer: "Return from CHF 45 in second class; the lounge opens at 06:00 (per the station page)." },
  { user: "Summarize the plan so I can forward it.", routeToLargeModel: true,
    batches: [],
    answer: "Out 3 Dec 09:33 Zurich HB -> 12:50 Milano Centrale; back 5 Dec 18:10 -> 21:27." },
];

/**
 * The fake model: reads the request the way a model would (what answered its last calls) and
 * returns the next step of the turn's script. Deterministic.
 */
function fakeModel(built: BuildResponse, turn: Turn, callPrefix: string):
  { calls: ToolCall[] } | { text: string } {
  const answered = new Set(need(built.request, "request").messages
    .filter((m) => m.role === "ROLE_TOOL" && m.callId.startsWith(callPrefix))
    .map((m) => m.callId));
  for (let b = 0; b < turn.batches.length; b++) {
    const ids = turn.batches[b]!.map((_, c) => `${callPrefix}${b}-${c}`);
    if (!ids.every((id) => answered.has(id))) {
      return { calls: turn.batches[b]!.map((call, c) => ToolCall.fromPartial({ callId: ids[c],
        name: call.name, argumentsJson: JSON.stringify(call.args) })) };
    }
  }
  return { text: turn.answer };
}

// ------------------------------------------------------------------------------ printing

/** A message field of a response: proto3 message fields may be absent; these never are. */
function need<T>(value: T | undefined, what: string): T {
  if (value === undefined) throw new Error(`the response has no ${what}`);
  return value;
}

function pad(value: string | number, width: number): string {
  return String(value).padStart(width);
}

function printRequest(label: string, built: BuildResponse): void {
  const b = need(built.budget, "budget");
  const p = need(built.pressure, "pressure");
  console.log(`\n== ${label}`);
  console.log(`epoch ${built.epoch} prefix_sha256 ${built.prefixSha256}`);
  console.log(`model ${built.modelId}  estimated ${built.estimatedInputTokens} of ` +
    `${built.contextWindow - built.outputReserve} tokens (factor ${b.estimatorFactor.toFixed(3)})`);
  console.log(`budget total ${b.totalTokens}  reserve ${b.outputReserve}  margin ${b.marginTokens}` +
    `  prefix ${b.prefixTokens}  body ${b.bodyTokens}/${b.bodyBudget}  history floor ` +
    `${b.historyFloor}`);
  console.log(`  ${"class".padEnd(24)}${pad("cap", 7)}${pad("used", 7)}${pad("items", 7)}` +
    `${pad("yielded", 9)}`);
  for (const c of b.classes) {
    console.log(`  ${c.className.padEnd(24)}${pad(c.cap || "-", 7)}${pad(c.used, 7)}` +
      `${pad(c.items, 7)}${pad(c.yielded, 9)}`);
  }
  const steps = p.steps.map((s) => `${s.step}(${s.units})`).join(" ") || "none";
  console.log(`pressure steps ${steps}  fits ${p.fits}  compaction_needed ${p.compactionNeeded}` +
    (p.compactionNeeded ? `  left_out ${p.leftOutItems} items/${p.leftOutTokens} tokens` : ""));
  const results = need(built.request, "request").messages.filter((m) => m.role === "ROLE_TOOL");
  const excerpts = results.filter((m) => m.text.includes("bytes omitted")).length;
  const pointers = results.filter((m) => m.text.includes("[elided] tool.result")).length;
  console.log(`tool results ${results.length - excerpts - pointers} inline  ${excerpts} excerpted` +
    `  ${pointers} pointers`);
  console.log("breakpoints " + built.cacheBreakpoints.map((m) =>
    `${m.name}(${m.ttl}${m.throughItem ? ` through ${m.throughItem}` : ""})`).join(" "));
}

/**
 * The provider body of a request as JSON (the format's typed accessor checks what Build
 * rendered); for Gemini also the body that creates the cached content of the pinned prefix.
 */
function printBody(label: string, name: FormatName, built: BuildResponse): void {
  console.log(`== provider body ${name} (${label}):`);
  console.log(JSON.stringify(bodyOf(built, FORMAT_NAMES[name]), null, 2));
  if (name === "gemini_generate_content") {
    const cached = geminiCachedContent(built);
    console.log(`== gemini cached content ${cached.displayName} (ttl ${cached.ttl}, holds ` +
      `${cached.holds.join(", ")}; ${cached.estimatedTokens} tokens, minimum ` +
      `${cached.minCacheableTokens}), create body:`);
    console.log(JSON.stringify(cached.createBody, null, 2));
  }
}

// ------------------------------------------------------------------------------ the runtime

/** One line of standard input, without its line break. */
async function readLine(): Promise<string> {
  const lines = readline.createInterface({ input: process.stdin, terminal: false });
  try {
    for await (const line of lines) return line;
    return "";
  } finally {
    lines.close();
  }
}

const USAGE = `usage: context-engine-agent-loop [--grpc-addr HOST:PORT] [--tls | --plaintext]
                                 [--token-stdin]
                                 [--tenant ID] [--session ID] [--print-body FORMAT]

A multi-turn, tool-using agent session against a context-engine server, with a fake model.
  --grpc-addr HOST:PORT  the server (default: CE_GRPC_ADDR, else 127.0.0.1:50051)
  --tls                  TLS with the system roots (default: plaintext, a token only to this
                         machine)
  --plaintext            plaintext even with a token to another machine
  --token-stdin          read the bearer token from one line of standard input (else CE_TOKEN)
  --tenant ID            the tenant (default: CE_TENANT_ID, else a fresh one)
  --session ID           the session (default: CE_SESSION_ID, else a fresh one)
  --print-body FORMAT    print the first Build's provider body: ${Object.keys(FORMAT_NAMES).join(", ")}
`;

/** A bad command line: one line and the exit status 2, no stack trace. */
class UsageError extends Error {}

function parseCommandLine(): ReturnType<typeof parseOptions> {
  try {
    return parseOptions();
  } catch (err) {
    // node's own parse errors (an unknown option, a missing value) carry an ERR_PARSE_ARGS code
    if (err instanceof TypeError && String((err as { code?: unknown }).code)
      .startsWith("ERR_PARSE_ARGS")) throw new UsageError(err.message);
    throw err;
  }
}

function parseOptions() {
  return parseArgs({ options: {
    "grpc-addr": { type: "string" },
    "token-stdin": { type: "boolean", default: false },
    tenant: { type: "string" },
    session: { type: "string" },
    tls: { type: "boolean", default: false },
    plaintext: { type: "boolean", default: false },
    "print-body": { type: "string" },
    help: { type: "boolean", short: "h", default: false },
  } });
}

async function main(): Promise<void> {
  const { values: args } = parseCommandLine();
  if (args.help) {
    process.stdout.write(USAGE);
    return;
  }
  const printBodyOf = args["print-body"];
  if (printBodyOf !== undefined && !Object.hasOwn(FORMAT_NAMES, printBodyOf)) {
    throw new UsageError(`--print-body: unknown provider format ${JSON.stringify(printBodyOf)}: ` +
      `one of ${Object.keys(FORMAT_NAMES).join(", ")}`);
  }
  const bodyFormat = printBodyOf as FormatName | undefined;
  const withFormat = bodyFormat ? { providerFormat: FORMAT_NAMES[bodyFormat] } : {};
  let bodyPrinted = false;
  const target = args["grpc-addr"] || process.env.CE_GRPC_ADDR || "127.0.0.1:50051";
  // A fresh tenant by default: the estimator's correction factor is learned per tenant and
  // model, so a fresh one makes every run of this example print the same tables.
  const tenantId = args.tenant ?? process.env.CE_TENANT_ID ??
    `example-${randomBytes(6).toString("hex")}`;
  const sessionId = args.session ?? process.env.CE_SESSION_ID ??
    `agent-loop-${randomBytes(6).toString("hex")}`;
  const token = args["token-stdin"] ? (await readLine()).trim() : process.env.CE_TOKEN || undefined;
  if (args["token-stdin"] && !token) {
    throw new UsageError("--token-stdin: standard input has no token");
  }
  if (args.tls && args.plaintext) throw new UsageError("--tls and --plaintext exclude each other");
  if (token && !args.tls && !args.plaintext && !isLoopback(target)) {
    throw new UsageError(`the token would travel in plaintext to ${target}, which is not on ` +
      "this machine: pass --tls for TLS, or --plaintext to send it in plaintext deliberately");
  }
  // to this machine, the client sends a token straight, never through a proxy of the environment
  const client = new ContextEngineClient({ target, deadlineMs: 20_000,
    ...(args.tls ? {} : { insecure: true }), ...(token ? { token } : {}) });

  const planRequest: Input<PlanRequest> = {
    tenantId, sessionId,
    agent: { agentId: "travel-desk", version: "4",
      instructions: "You plan business trips. Prefer rail under 500 km, cite fares with " +
        "their source, and never book without the traveller's confirmation.",
      enabledTools: ["rail.search", "web.fetch"] },
    toolCatalog: [
      { name: "rail.search", description: "Search rail connections between two stations.",
        inputSchemaJson: SCHEMA_RAIL, sideEffect: "SIDE_EFFECT_NETWORK_READ" },
      { name: "web.fetch", description: "Fetch a web page. Returns its text.",
        inputSchemaJson: SCHEMA_URL, sideEffect: "SIDE_EFFECT_NETWORK_READ" },
    ],
    model: SMALL_MODEL,
    session: { kind: "SESSION_KIND_INTERACTIVE" },
  };

  const items: Input<ConversationItem>[] = [];
  let summary: Summary | undefined;
  let workingState: WorkingState = WorkingState.fromPartial({
    objective: "Get the traveller to a 14:00 meeting in Milan on 3 December and back",
    constraints: ["rail only", "confirm before booking"],
  });
  let sequence = 0;
  let requests = 0;
  const stats = { requests: 0, compactions: 0, rotations: 0, steps: new Set<string>(),
    epochs: new Map<number, string>(), excerpted: 0, pointers: 0 };

  try {
    for (let t = 0; t < TURNS.length; t++) {
      const turn = TURNS[t]!;
      const runId = `run-${t + 1}`;
      if (turn.routeToLargeModel) {
        const rotated = await client.rotate({ tenantId, sessionId,
          reason: "ROTATION_REASON_MODEL_ROUTED", model: LARGE_MODEL,
          idempotencyKey: `${sessionId}:route:${runId}` });
        stats.rotations++;
        const plan = need(rotated.plan, "plan");
        console.log(`\n>> rotated to epoch ${plan.epoch} (${plan.reason}) ` +
          `model ${plan.modelId} prefix_sha256 ${plan.prefixSha256}`);
      } else {
        const planned = await client.plan({ ...planRequest,
          run: { runId, toolsPinned: false, hasPendingCalls: false } });
        const plan = need(planned.plan, "plan");
        if (planned.created) {
          console.log(`>> planned epoch ${plan.epoch} (${plan.reason}) ` +
            `prefix_sha256 ${plan.prefixSha256} prefix ${plan.prefixTokens} tokens`);
        }
      }
      items.push({ id: `u${t + 1}`, sequence: String(++sequence), runId,
        trust: "TRUST_LEVEL_USER", user: { text: turn.user } });

      for (let step = 1; ; step++) {
        const checkpoint = (): Input<Checkpoint> => ({ activeRunId: runId, items, workingState,
          runtime: { currentDate: "2026-11-29" }, ...(summary ? { summary } : {}) });
        let built = await client.build({ tenantId, sessionId, checkpoint: checkpoint(),
          ...withFormat });
        printRequest(`turn ${t + 1} (${runId}) step ${step}`, built);
        if (bodyFormat && !bodyPrinted) {
          printBody(`turn ${t + 1}, step ${step}`, bodyFormat, built);
          bodyPrinted = true;
        }
        let pressure = need(built.pressure, "pressure");
        for (const s of pressure.steps) stats.steps.add(s.step);
        if (pressure.compactionNeeded && (summary?.depth ?? 0) < 2) {
          // Free twice what was left out, so the next few steps fit without compacting again
          // (a summary merges at most twice: depth 2 is the cap).
          const compacted = await client.compact({ tenantId, sessionId,
            checkpoint: checkpoint(), tokensToFree: 2 * pressure.leftOutTokens,
            reason: "budget_pressure", idempotencyKey: `${sessionId}:compact:${sequence}` });
          stats.compactions++;
          summary = need(compacted.summary, "summary");
          const replaced = new Set(compacted.replacedItemIds);
          for (let i = items.length - 1; i >= 0; i--) {
            if (replaced.has(items[i]!.id ?? "")) items.splice(i, 1);
          }
          console.log(`>> compacted ${compacted.replacedItemIds.length} items into a depth-` +
            `${summary.depth} summary (${compacted.tokensBefore} -> ` +
            `${compacted.tokensAfter} tokens, ${summary.elided.length} elided spans)`);
          built = await client.build({ tenantId, sessionId, checkpoint: checkpoint(),
            ...withFormat });
          printRequest(`turn ${t + 1} (${runId}) step ${step}, rebuilt on the summary`, built);
          pressure = need(built.pressure, "pressure");
          for (const s of pressure.steps) stats.steps.add(s.step);
        } else if (pressure.compactionNeeded) {
          console.log(">> the summary is at depth 2: the cut request is sent as it is " +
            "(a child run would carry on with more room)");
        }
        if (!pressure.fits) throw new Error("Build returned a request that does not fit");
        requests++;
        stats.requests = requests;
        const seen = stats.epochs.get(built.epoch);
        if (seen !== undefined && seen !== built.prefixSha256) {
          throw new Error(`epoch ${built.epoch} changed its prefix: ${seen} -> ${built.prefixSha256}`);
        }
        stats.epochs.set(built.epoch, built.prefixSha256);
        const messages = need(built.request, "request").messages;
        stats.excerpted = Math.max(stats.excerpted, messages.filter((m) =>
          m.role === "ROLE_TOOL" && m.text.includes("bytes omitted")).length);
        stats.pointers = Math.max(stats.pointers, messages.filter((m) =>
          m.role === "ROLE_TOOL" && m.text.includes("[elided] tool.result")).length);

        // The provider's usage: a stand-in that agrees with the estimate and reads the prefix
        // from cache after the first request.
        const cached = step > 1 || t > 0 ? built.prefixTokens : 0;
        await client.reportUsage({ tenantId, sessionId, epoch: built.epoch,
          estimatedInputTokens: built.estimatedInputTokens,
          estimatorFactor: built.estimatorFactor,
          estimatedAttachmentTokens: built.estimatedAttachmentTokens,
          inputTokens: built.estimatedInputTokens, cachedTokens: cached,
          outputTokens: 120, idempotencyKey: `${sessionId}:usage:${requests}` });

        const reply = fakeModel(built, turn, `call-${t + 1}-`);
        if ("text" in reply) {
          // A verbose model: the answer comes with its working notes, which is what makes
          // carried history outgrow the window after a few turns.
          const notes = turn.routeToLargeModel ? "" : "\n\nNotes: " + prose(reply.text, 2_000);
          items.push({ id: `a${t + 1}`, sequence: String(++sequence), runId,
            trust: "TRUST_LEVEL_USER", assistant: { text: reply.text + notes } });
          console.log(`<< assistant: ${reply.text}`);
          break;
        }
        // The log keeps the tools' own names; the calls go out as the provider returned them.
        const own = (name?: string) =>
          (WORKING_STATE_TOOL_NAMES.has(name ?? "") ? WORKING_STATE_TOOL : name);
        const calledAt = String(++sequence);
        items.push({ id: `c${t + 1}-${step}`, sequence: calledAt, runId,
          trust: "TRUST_LEVEL_USER", toolCalls: { calls: reply.calls.map((c) =>
            ({ ...c, name: own(c.name) })) } });
        console.log(`<< tool calls: ${reply.calls.map((c) => `${c.name} ${c.argumentsJson}`)
          .join(", ")}`);
        for (const call of reply.calls) {
          if (WORKING_STATE_TOOL_NAMES.has(call.name ?? "")) {
            // The engine applies the model's call; its answer is the call's result.
            let content: string;
            try {
              const updated = await client.updateWorkingState({ tenantId, sessionId, runId,
                current: workingState, sequence: calledAt, transition: { toolCall: {
                  callId: call.callId, name: call.name, argumentsJson: call.argumentsJson } } });
              workingState = need(updated.state, "state");
              content = updated.toolResult;
            } catch (err) {
              // Refused: the model reads what was wrong and the tool's input schema.
              if (!(err instanceof ContextEngineError) || !err.toolResult) throw err;
              content = err.toolResult;
            }
            const seq = String(++sequence);
            items.push({ id: `r-${call.callId}`, sequence: seq, runId, trust: "TRUST_LEVEL_USER",
              toolResult: { callId: call.callId, toolName: WORKING_STATE_TOOL, content,
                eventId: seq } });
            console.log(`>> working state: ${content}`);
            continue;
          }
          const result = runTool(call);
          const seq = String(++sequence);
          items.push({ id: `r-${call.callId}`, sequence: seq, runId,
            trust: "TRUST_LEVEL_EXTERNAL_UNTRUSTED",
            toolResult: { callId: call.callId, toolName: call.name, content: result.content,
              eventId: seq, ...(result.artifactRef ? { artifactRef: result.artifactRef } : {}) } });
          console.log(`   result ${call.callId}: ${Buffer.byteLength(result.content)} bytes`);
        }
      }
    }
  } catch (err) {
    if (err instanceof ContextEngineError) {
      console.error(`context-engine error ${err.codeName} ${err.reason} ` +
        `${JSON.stringify(err.metadata)}: ${err.details}`);
    }
    throw err;
  } finally {
    client.close();
  }

  console.log("\nRESULT " + JSON.stringify({
    sessionId, requests: stats.requests, compactions: stats.compactions,
    rotations: stats.rotations, pressureSteps: [...stats.steps].sort(),
    maxExcerptedResults: stats.excerpted, maxPointers: stats.pointers,
    epochs: Object.fromEntries(stats.epochs),
  }));
}

main().catch((err: unknown) => {
  if (err instanceof UsageError) {
    console.error(`context-engine-agent-loop: ${err.message} (see --help)`);
    process.exitCode = 2;
    return;
  }
  console.error(err);
  process.exitCode = 1;
});
