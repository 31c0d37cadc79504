/**
 * Provider bodies of a `BuildResponse`, parsed and typed.
 *
 * `build` renders the request as one provider's JSON body when asked (`providerFormat` of the
 * request; unset: the model's default format, when the catalog knows the model):
 * `providerBodyJson` is what the runtime sends to the provider as it is, `providerFormat` the
 * format rendered. These helpers parse it and check the format:
 *
 *   const built = await engine.build({ ...request,
 *     providerFormat: "PROVIDER_FORMAT_BEDROCK_CONVERSE" });
 *   await bedrock.send(new ConverseCommand(bedrockConverseBody(built)));
 *
 * Every accessor returns a new object (an interface naming the top-level keys the service
 * renders; nested values are the provider's own JSON) and throws `ProviderBodyError` when the
 * response holds no body, or a body of another format than the accessor's (the message names
 * both).
 */
import type { BuildResponse, GeminiCachedContent } from "./gen/context_engine/v1/context_engine";
import { ProviderFormat } from "./gen/context_engine/v1/context_engine";

/** Any JSON value, as `JSON.parse` returns it. */
export type JsonValue = null | boolean | number | string | JsonValue[] | JsonObject;
/** A JSON object. */
export interface JsonObject {
  [key: string]: JsonValue;
}

/** The formats that have a body. */
export type BodyFormat =
  | typeof ProviderFormat.PROVIDER_FORMAT_ANTHROPIC_MESSAGES
  | typeof ProviderFormat.PROVIDER_FORMAT_OPENAI_RESPONSES
  | typeof ProviderFormat.PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS
  | typeof ProviderFormat.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT
  | typeof ProviderFormat.PROVIDER_FORMAT_BEDROCK_CONVERSE;

/** A format's short name, as the service logs it and the example's `--print-body` takes it. */
export type FormatName =
  | "anthropic_messages"
  | "openai_responses"
  | "openai_chat_completions"
  | "gemini_generate_content"
  | "bedrock_converse";

/** The formats with a body, by their short names, in the enum's order. */
export const FORMAT_NAMES: Readonly<Record<FormatName, BodyFormat>> = Object.freeze({
  anthropic_messages: ProviderFormat.PROVIDER_FORMAT_ANTHROPIC_MESSAGES,
  openai_responses: ProviderFormat.PROVIDER_FORMAT_OPENAI_RESPONSES,
  openai_chat_completions: ProviderFormat.PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS,
  gemini_generate_content: ProviderFormat.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT,
  bedrock_converse: ProviderFormat.PROVIDER_FORMAT_BEDROCK_CONVERSE,
});

const PREFIX = "PROVIDER_FORMAT_";

/**
 * A format from its short name (`"gemini_generate_content"`) or its enum name
 * (`"PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT"`), in any case; `"none"` and `"unspecified"` too.
 * Throws a `RangeError` listing the short names otherwise.
 */
export function parseProviderFormat(name: string): ProviderFormat {
  const key = PREFIX + name.trim().toUpperCase().replace(/^PROVIDER_FORMAT_/, "");
  if (key !== PREFIX && Object.prototype.hasOwnProperty.call(ProviderFormat, key) &&
      key !== "UNRECOGNIZED") {
    return ProviderFormat[key as keyof typeof ProviderFormat];
  }
  throw new RangeError(`unknown provider format ${JSON.stringify(name)}: one of ` +
    `${Object.keys(FORMAT_NAMES).join(", ")} (or none)`);
}

/** The short name of a format: `"gemini_generate_content"`, `"none"`, `"unspecified"`. */
export function providerFormatName(format: ProviderFormat): string {
  return format.replace(/^PROVIDER_FORMAT_/, "").toLowerCase();
}

function described(format: ProviderFormat): string {
  return `${providerFormatName(format)} (${format})`;
}

/**
 * The response holds no provider body (`actual` is `PROVIDER_FORMAT_UNSPECIFIED`), or one of
 * another format than `expected`; or its JSON is not an object.
 */
export class ProviderBodyError extends Error {
  override name = "ProviderBodyError";
  constructor(message: string, readonly expected: ProviderFormat | undefined,
              readonly actual: ProviderFormat) {
    super(message);
  }
}

/** What the helpers read of a `BuildResponse` (a whole one will do). */
export type BodyCarrier = Pick<BuildResponse, "providerFormat" | "providerBodyJson">;

function parseObject(text: string, what: string, expected: ProviderFormat | undefined,
                     actual: ProviderFormat): JsonObject {
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch (err) {
    throw new ProviderBodyError(`${what} is not JSON: ${(err as Error).message}`, expected,
      actual);
  }
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    throw new ProviderBodyError(`${what} is not a JSON object`, expected, actual);
  }
  return value as JsonObject;
}

/**
 * `providerBodyJson` parsed, of whatever format `providerFormat` says. Throws
 * `ProviderBodyError` when the response holds none (the request asked for
 * `PROVIDER_FORMAT_NONE`, or named no format for a model without a default one).
 */
export function providerBody(response: BodyCarrier): JsonObject {
  const actual = response.providerFormat;
  if (!response.providerBodyJson) {
    throw new ProviderBodyError(`the BuildResponse holds no provider body (providerFormat ` +
      `${actual}): set the request's providerFormat to the format to render`, undefined, actual);
  }
  return parseObject(response.providerBodyJson, "providerBodyJson", undefined, actual);
}

// ------------------------------------------------------------------------------ the formats

/**
 * An Anthropic Messages API body (`anthropic.messages.create(body)`): `system` text blocks,
 * `messages` (user and assistant turns; `tool_use` and `tool_result` blocks), `tools`, with
 * `cache_control` at the plan's cache markers.
 */
export interface AnthropicMessagesBody {
  model: string;
  max_tokens: number;
  system: JsonObject[];
  messages: JsonObject[];
  tools?: JsonObject[];
}

/**
 * An OpenAI Responses API body (`openai.responses.create(body)`): `instructions`, `input` items
 * (messages, `function_call`, `function_call_output`), `tools`, `prompt_cache_key` (the session
 * key), stateless (`store` false); `include` asks a model that reasons (o-series, gpt-5 but
 * gpt-5-chat) for its encrypted reasoning back, and is absent for any other (OpenAI refuses it
 * there).
 */
export interface OpenAIResponsesBody {
  model: string;
  instructions: string;
  input: JsonObject[];
  prompt_cache_key: string;
  max_output_tokens: number;
  store: boolean;
  include?: string[];
  tools?: JsonObject[];
}

/**
 * An OpenAI Chat Completions body (`openai.chat.completions.create(body)`; vLLM, Ollama and
 * other compatible servers take it too): `messages` (system, user, assistant with `tool_calls`,
 * a `tool` message answering each call), `tools`, `prompt_cache_key` (the session key),
 * `max_completion_tokens` (the output reserve).
 */
export interface ChatCompletionsBody {
  model: string;
  messages: JsonObject[];
  prompt_cache_key: string;
  max_completion_tokens: number;
  tools?: JsonObject[];
}

/**
 * A Gemini `models/{model}:generateContent` body (REST, camelCase; the model is in the URL,
 * the response's `modelId`): `systemInstruction` (the prefix), `contents` (user and model
 * turns; paired `functionCall` and `functionResponse` parts), `tools` (one
 * `functionDeclarations` list, schemas as `parametersJsonSchema`),
 * `generationConfig.maxOutputTokens` (the output reserve). With explicit caching,
 * `GeminiCachedContentBodies.cachedBodyFor` gives the body to send instead (without what the
 * cached content holds, with `cachedContent`).
 */
export interface GeminiGenerateContentBody {
  contents: JsonObject[];
  generationConfig: JsonObject;
  systemInstruction?: JsonObject;
  tools?: JsonObject[];
  toolConfig?: JsonObject;
  cachedContent?: string;
}

/**
 * An Amazon Bedrock Converse request, the input of `ConverseCommand` (AWS SDK for JavaScript
 * v3) or of boto3's `converse(**body)`: `modelId`, `system` and `messages` (paired `toolUse` and
 * `toolResult` blocks), `toolConfig`, `inferenceConfig` (`maxTokens`: the output reserve),
 * `cachePoint` blocks at the plan's breakpoints within Bedrock's limits.
 */
export interface BedrockConverseBody {
  modelId: string;
  messages: JsonObject[];
  inferenceConfig: JsonObject;
  system?: JsonObject[];
  toolConfig?: JsonObject;
}

/** Each format's body type. */
export interface ProviderBodies {
  PROVIDER_FORMAT_ANTHROPIC_MESSAGES: AnthropicMessagesBody;
  PROVIDER_FORMAT_OPENAI_RESPONSES: OpenAIResponsesBody;
  PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS: ChatCompletionsBody;
  PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT: GeminiGenerateContentBody;
  PROVIDER_FORMAT_BEDROCK_CONVERSE: BedrockConverseBody;
}

/**
 * The response's body of `format`, typed; throws `ProviderBodyError` when the response holds
 * no body or one of another format.
 */
export function bodyOf<F extends BodyFormat>(response: BodyCarrier, format: F):
  ProviderBodies[F] {
  const actual = response.providerFormat;
  if (actual !== format || !response.providerBodyJson) {
    const held = response.providerBodyJson ? `a body of format ${described(actual)}`
      : `no provider body (providerFormat ${actual})`;
    throw new ProviderBodyError(`expected a body of format ${described(format)}, but the ` +
      `BuildResponse holds ${held}: ask build for it with providerFormat: "${format}"`,
    format, actual);
  }
  return parseObject(response.providerBodyJson, "providerBodyJson", format,
    actual) as unknown as ProviderBodies[F];
}

/** The response's Anthropic Messages body; `ProviderBodyError` for another format. */
export function anthropicMessagesBody(response: BodyCarrier): AnthropicMessagesBody {
  return bodyOf(response, ProviderFormat.PROVIDER_FORMAT_ANTHROPIC_MESSAGES);
}

/** The response's OpenAI Responses body; `ProviderBodyError` for another format. */
export function openaiResponsesBody(response: BodyCarrier): OpenAIResponsesBody {
  return bodyOf(response, ProviderFormat.PROVIDER_FORMAT_OPENAI_RESPONSES);
}

/** The response's OpenAI Chat Completions body; `ProviderBodyError` for another format. */
export function chatCompletionsBody(response: BodyCarrier): ChatCompletionsBody {
  return bodyOf(response, ProviderFormat.PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS);
}

/**
 * The response's Gemini generateContent body (the whole request, prefix first, so Gemini's
 * implicit caching applies); `ProviderBodyError` for another format.
 */
export function geminiBody(response: BodyCarrier): GeminiGenerateContentBody {
  return bodyOf(response, ProviderFormat.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT);
}

/**
 * The response's Bedrock Converse body, ready for the AWS SDK: a replayed `redactedContent`
 * blob (`messages[*].content[*].reasoningContent`) is decoded to bytes, and nothing else is;
 * `ProviderBodyError` for another format.
 */
export function bedrockConverseBody(response: BodyCarrier): BedrockConverseBody {
  // A replayed `redactedContent` blob travels in the JSON body as base64 text; the AWS SDKs
  // take bytes and encode blobs themselves, so it is decoded here.
  return blobsAsBytes(bodyOf(response, ProviderFormat.PROVIDER_FORMAT_BEDROCK_CONVERSE));
}

/**
 * The body (parsed just now, so changed in place) with each reasoning block's
 * `redactedContent` decoded: the one blob of a Converse body. A key of that name anywhere else
 * (a tool call's input, a tool's schema) is the model's or the caller's text and stays so.
 * In place, not copied: every other key, "__proto__" too, stays as JSON.parse made it.
 */
function blobsAsBytes<T extends object>(body: T): T {
  const messages = (body as { messages?: unknown }).messages;
  for (const message of Array.isArray(messages) ? messages : []) {
    const content = isObject(message) ? message.content : undefined;
    for (const block of Array.isArray(content) ? content : []) {
      const reasoning = isObject(block) ? block.reasoningContent : undefined;
      if (isObject(reasoning) && typeof reasoning.redactedContent === "string") {
        reasoning.redactedContent = new Uint8Array(Buffer.from(reasoning.redactedContent, "base64"));
      }
    }
  }
  return body;
}

function isObject(value: unknown): value is Record<string, unknown> {
  return value !== null && typeof value === "object" && !Array.isArray(value);
}

/**
 * `BuildResponse.geminiCachedContent` with its bodies parsed: how to cache the pinned prefix
 * with Gemini's explicit context caching.
 *
 * Once per epoch, create the cached content (`cachedContents.create` with `createBody`; look
 * for an existing one by `displayName` first), then send what `cachedBodyFor` returns for the
 * created resource's name instead of the whole body. Below `minCacheableTokens` Gemini refuses
 * to create it (`cacheable` is false): send the whole body and rely on implicit caching.
 */
export class GeminiCachedContentBodies {
  readonly displayName: string;
  readonly ttl: string;
  /** The `cachedContents.create` body: model, displayName, ttl and what it holds. */
  readonly createBody: JsonObject;
  /**
   * The generateContent body without what the cached content holds (`holds`), its
   * `cachedContent` not set yet: see `cachedBodyFor`.
   */
  readonly cachedBody: GeminiGenerateContentBody;
  readonly holds: readonly string[];
  readonly estimatedTokens: number;
  readonly minCacheableTokens: number;

  constructor(cached: GeminiCachedContent, format: ProviderFormat) {
    const expected = ProviderFormat.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT;
    this.displayName = cached.displayName;
    this.ttl = cached.ttl;
    this.createBody = parseObject(cached.createBodyJson, "geminiCachedContent.createBodyJson",
      expected, format);
    this.cachedBody = parseObject(cached.cachedBodyJson, "geminiCachedContent.cachedBodyJson",
      expected, format) as unknown as GeminiGenerateContentBody;
    this.holds = Object.freeze([...cached.holds]);
    this.estimatedTokens = cached.estimatedTokens;
    this.minCacheableTokens = cached.minCacheableTokens;
  }

  /** Whether the content reaches Gemini's minimum for the model. */
  get cacheable(): boolean {
    return this.estimatedTokens >= this.minCacheableTokens;
  }

  /**
   * The generateContent body that uses the created cached content (`cachedContents/...`, the
   * `name` `cachedContents.create` returned): a new object.
   */
  cachedBodyFor(cachedContentName: string): GeminiGenerateContentBody {
    if (!cachedContentName) {
      throw new RangeError("cachedContentName: the name of the created cached content");
    }
    return { ...structuredClone(this.cachedBody), cachedContent: cachedContentName };
  }
}

/**
 * The response's explicit-caching plan for Gemini; `ProviderBodyError` for another format or a
 * response without it.
 */
export function geminiCachedContent(
  response: BodyCarrier & Pick<BuildResponse, "geminiCachedContent">): GeminiCachedContentBodies {
  const expected = ProviderFormat.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT;
  bodyOf(response, expected);
  const cached = response.geminiCachedContent;
  if (cached === undefined || !cached.createBodyJson) {
    throw new ProviderBodyError("the BuildResponse holds a gemini_generate_content body but no " +
      "geminiCachedContent", expected, response.providerFormat);
  }
  return new GeminiCachedContentBodies(cached, response.providerFormat);
}
