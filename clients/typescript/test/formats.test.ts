/**
 * The provider-body helpers (`src/formats.ts`) on responses built here: each accessor returns
 * its format's body and refuses the others naming both formats, a response without a body is
 * a clear error, and Gemini's cached-content plan is parsed. Needs no server.
 */
import assert from "node:assert/strict";
import { describe, test } from "node:test";

import {
  type AnthropicMessagesBody,
  type BedrockConverseBody,
  type BodyFormat,
  BuildResponse,
  type ChatCompletionsBody,
  FORMAT_NAMES,
  type FormatName,
  type GeminiGenerateContentBody,
  GeminiCachedContent,
  GeminiCachedContentBodies,
  type OpenAIResponsesBody,
  ProviderBodyError,
  ProviderFormat,
  anthropicMessagesBody,
  bedrockConverseBody,
  bodyOf,
  chatCompletionsBody,
  geminiBody,
  geminiCachedContent,
  openaiResponsesBody,
  parseProviderFormat,
  providerBody,
  providerFormatName,
} from "../src";

const ACCESSORS: Record<FormatName, (r: BuildResponse) => object> = {
  anthropic_messages: anthropicMessagesBody,
  openai_responses: openaiResponsesBody,
  openai_chat_completions: chatCompletionsBody,
  gemini_generate_content: geminiBody,
  bedrock_converse: bedrockConverseBody,
};

function response(providerFormat: ProviderFormat, body?: unknown,
                  geminiCachedContent?: GeminiCachedContent): BuildResponse {
  return BuildResponse.fromPartial({ providerFormat, geminiCachedContent,
    providerBodyJson: body === undefined ? "" : typeof body === "string" ? body
      : JSON.stringify(body) });
}

describe("provider formats", () => {
  test("short names and enum values map both ways", () => {
    assert.deepEqual(Object.keys(FORMAT_NAMES), Object.keys(ACCESSORS));
    for (const [name, format] of Object.entries(FORMAT_NAMES)) {
      assert.equal(format, `PROVIDER_FORMAT_${name.toUpperCase()}`);
      assert.equal(ProviderFormat[format], format);
      assert.equal(providerFormatName(format), name);
      for (const spelling of [name, format, format.toLowerCase(), ` ${name.toUpperCase()} `]) {
        assert.equal(parseProviderFormat(spelling), format);
      }
    }
    assert.equal(parseProviderFormat("none"), ProviderFormat.PROVIDER_FORMAT_NONE);
    assert.equal(providerFormatName("PROVIDER_FORMAT_UNSPECIFIED"), "unspecified");
    assert.equal(providerFormatName("UNRECOGNIZED"), "unrecognized");
    for (const bad of ["gemini", "", "PROVIDER_FORMAT_", "unrecognized", "toString"]) {
      assert.throws(() => parseProviderFormat(bad),
        (err: unknown) => err instanceof RangeError && /unknown provider format/.test(err.message)
          && err.message.includes("openai_chat_completions"));
    }
  });

  test("each accessor returns its format's body and refuses the others, naming both", () => {
    for (const [name, format] of Object.entries(FORMAT_NAMES) as [FormatName, BodyFormat][]) {
      const resp = response(format, { marker: name });
      assert.deepEqual(providerBody(resp), { marker: name });
      assert.deepEqual(ACCESSORS[name](resp), { marker: name });
      assert.deepEqual(bodyOf(resp, format), { marker: name });
      assert.notEqual(ACCESSORS[name](resp), ACCESSORS[name](resp), "a new object each time");
      for (const [other, accessor] of Object.entries(ACCESSORS)) {
        if (other === name) continue;
        assert.throws(() => accessor(resp), (err: unknown) => {
          assert.ok(err instanceof ProviderBodyError && err instanceof Error);
          assert.equal(err.name, "ProviderBodyError");
          assert.equal(err.expected, FORMAT_NAMES[other as FormatName]);
          assert.equal(err.actual, format);
          const wanted = `${other} (PROVIDER_FORMAT_${other.toUpperCase()})`;
          const held = `${name} (PROVIDER_FORMAT_${name.toUpperCase()})`;
          assert.ok(err.message.includes(wanted) && err.message.includes(held), err.message);
          assert.ok(err.message.indexOf(wanted) < err.message.indexOf(held), err.message);
          return true;
        });
      }
    }
  });

  test("a response without a body is a clear error", () => {
    for (const resp of [BuildResponse.fromPartial({}),
      response(ProviderFormat.PROVIDER_FORMAT_NONE)]) {
      assert.throws(() => providerBody(resp), (err: unknown) =>
        err instanceof ProviderBodyError && /holds no provider body/.test(err.message) &&
        err.expected === undefined && err.actual === resp.providerFormat &&
        err.message.includes("providerFormat"));
      assert.throws(() => chatCompletionsBody(resp), (err: unknown) =>
        err instanceof ProviderBodyError && /no provider body/.test(err.message) &&
        err.message.includes("PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS"));
    }
    assert.throws(() => geminiBody(response("PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT")),
      /no provider body/);
    for (const broken of ["[1, 2]", "{not json", "null"]) {
      assert.throws(() => bedrockConverseBody(response("PROVIDER_FORMAT_BEDROCK_CONVERSE",
        broken)), (err: unknown) => err instanceof ProviderBodyError &&
        /providerBodyJson is not/.test(err.message));
    }
  });

  test("the bodies are typed by format", () => {
    // compile-time: each accessor's declared type has its format's keys
    const anthropic: AnthropicMessagesBody = { model: "m", max_tokens: 1, system: [],
      messages: [] };
    const openai: OpenAIResponsesBody = { model: "m", instructions: "", input: [],
      prompt_cache_key: "k", max_output_tokens: 1, store: false, include: [] };
    const chat: ChatCompletionsBody = { model: "m", messages: [{ role: "user", content: "hi" }],
      prompt_cache_key: "k", max_completion_tokens: 1 };
    const gemini: GeminiGenerateContentBody = { contents: [], systemInstruction: { parts: [] },
      generationConfig: { maxOutputTokens: 1 } };
    const bedrock: BedrockConverseBody = { modelId: "m", system: [], messages: [],
      inferenceConfig: { maxTokens: 1 } };
    const chatBack = chatCompletionsBody(response("PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS",
      chat));
    assert.equal(chatBack.messages[0]?.role, "user");
    const typed: string = bodyOf(response("PROVIDER_FORMAT_BEDROCK_CONVERSE", bedrock),
      "PROVIDER_FORMAT_BEDROCK_CONVERSE").modelId;
    assert.equal(typed, "m");
    assert.ok(anthropic && openai && gemini);
  });

  test("Gemini's cached-content plan is parsed", () => {
    const cached = GeminiCachedContent.fromPartial({
      displayName: "ce-0123456789abcdef-e1", ttl: "300s",
      createBodyJson: JSON.stringify({ model: "models/gemini-2.5-pro", ttl: "300s",
        displayName: "ce-0123456789abcdef-e1",
        systemInstruction: { parts: [{ text: "Be brief." }] } }),
      cachedBodyJson: JSON.stringify({ contents: [{ role: "user", parts: [{ text: "Hi" }] }] }),
      holds: ["systemInstruction"], estimatedTokens: 5000, minCacheableTokens: 4096 });
    const whole = { systemInstruction: { parts: [{ text: "Be brief." }] },
      contents: [{ role: "user", parts: [{ text: "Hi" }] }] };
    const got = geminiCachedContent(response("PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT", whole,
      cached));
    assert.ok(got instanceof GeminiCachedContentBodies);
    assert.equal(got.displayName, "ce-0123456789abcdef-e1");
    assert.equal(got.ttl, "300s");
    assert.deepEqual(got.holds, ["systemInstruction"]);
    assert.equal(got.createBody.displayName, got.displayName);
    assert.equal(got.cacheable, true);
    assert.equal(got.cachedBody.cachedContent, undefined);
    const used = got.cachedBodyFor("cachedContents/abc123");
    assert.deepEqual(used, { ...got.cachedBody, cachedContent: "cachedContents/abc123" });
    used.contents.length = 0; // a copy: the parsed body is untouched
    assert.equal(got.cachedBody.contents.length, 1);
    assert.throws(() => got.cachedBodyFor(""), RangeError);
    const small = geminiCachedContent(response("PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT", whole,
      { ...cached, estimatedTokens: 100 }));
    assert.equal(small.cacheable, false);
    assert.throws(() => geminiCachedContent(response("PROVIDER_FORMAT_BEDROCK_CONVERSE", {},
      cached)), (err: unknown) => err instanceof ProviderBodyError &&
      err.message.includes("bedrock_converse"));
    assert.throws(() => geminiCachedContent(response("PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT",
      whole)), /no geminiCachedContent/);
  });
});

test("bedrockConverseBody gives a replayed redactedContent blob as bytes, ready for the AWS SDK", () => {
  const blob = Buffer.from([0, 1, 255, 7]);
  const body = {
    modelId: "anthropic.claude-sonnet-4-5",
    messages: [
      { role: "user", content: [{ text: "hi" }] },
      { role: "assistant", content: [{ reasoningContent: { redactedContent: blob.toString("base64") } }, { text: "ok" }] },
    ],
  };
  const ready = bedrockConverseBody({
    providerBodyJson: JSON.stringify(body), providerFormat: "PROVIDER_FORMAT_BEDROCK_CONVERSE",
  } as never) as unknown as { messages: { content: Record<string, unknown>[] }[] };
  const block = ready.messages[1].content[0] as { reasoningContent: { redactedContent: Uint8Array } };
  assert.deepEqual(Array.from(block.reasoningContent.redactedContent), [0, 1, 255, 7]);
  assert.deepEqual(ready.messages[0], body.messages[0]);
});

test("bedrockConverseBody decodes no redactedContent but a reasoning block's blob", () => {
  // a key of that name in a tool call's input (the model's arguments) or in a tool's schema is
  // text, kept as it is whether or not it reads as base64
  const blob = Buffer.from([0, 1, 255, 7]);
  const schema = {
    type: "object", properties: { redactedContent: { type: "string" } },
    examples: [{ redactedContent: "abcd" }, { redactedContent: "Name: Jane" }],
  };
  const body = {
    modelId: "anthropic.claude-sonnet-4-5",
    messages: [
      { role: "user", content: [{ text: "Redact it." }] },
      {
        role: "assistant", content: [
          { reasoningContent: { redactedContent: blob.toString("base64") } },
          { toolUse: { toolUseId: "k1", name: "redact", input: { redactedContent: "Name: Jane Doe" } } },
          {
            toolUse: {
              toolUseId: "k2", name: "redact",
              input: { redactedContent: "abcd", nested: [{ redactedContent: "cmVkYWN0ZWQ=" }] },
            },
          },
        ],
      },
      {
        role: "user", content: [
          { toolResult: { toolUseId: "k1", content: [{ json: { redactedContent: "abcd" } }] } },
          { toolResult: { toolUseId: "k2", content: [{ text: "done" }] } },
        ],
      },
    ],
    toolConfig: { tools: [{ toolSpec: { name: "redact", inputSchema: { json: schema } } }] },
  };
  const text = JSON.stringify(body);
  const ready = bedrockConverseBody({
    providerBodyJson: text, providerFormat: "PROVIDER_FORMAT_BEDROCK_CONVERSE",
  } as never) as unknown as { messages: { content: Record<string, unknown>[] }[] };
  const block = ready.messages[1].content[0] as { reasoningContent: { redactedContent: unknown } };
  assert.ok(block.reasoningContent.redactedContent instanceof Uint8Array);
  assert.deepEqual(Array.from(block.reasoningContent.redactedContent as Uint8Array), [0, 1, 255, 7]);
  // everything else is what JSON holds: the blob put back as its text, the bodies are equal
  block.reasoningContent.redactedContent = blob.toString("base64");
  assert.deepStrictEqual(ready, JSON.parse(text));
});

test("bedrockConverseBody keeps a \"__proto__\" key of a tool's input as a key of its own", () => {
  // a copy by assignment set the copy's prototype instead: the key vanished from the body, and
  // an object under it became readable through inheritance
  const text = '{"modelId":"anthropic.claude-sonnet-4-5","messages":[{"role":"assistant","content":' +
    '[{"toolUse":{"toolUseId":"c1","name":"t","input":{"__proto__":{"polluted":1},"q":"x"}}}]}]}';
  const ready = bedrockConverseBody({
    providerBodyJson: text, providerFormat: "PROVIDER_FORMAT_BEDROCK_CONVERSE",
  } as never) as unknown as { messages: { content: { toolUse: { input: object } }[] }[] };
  const input = ready.messages[0].content[0].toolUse.input;
  assert.ok(Object.hasOwn(input, "__proto__"));
  assert.equal(Object.getPrototypeOf(input), Object.prototype);
  assert.equal((input as { polluted?: number }).polluted, undefined);
  assert.equal(JSON.stringify(ready), JSON.stringify(JSON.parse(text)));
});
