// Drives a running tandem server (a model with a tool-capable chat template) with the openai
// client's tools, the Vercel AI SDK (@ai-sdk/openai-compatible) and LangChain (@langchain/openai).
// Exits non-zero on any mismatch. TANDEM_BASE_URL is like http://127.0.0.1:PORT/v1.
import OpenAI from "openai";
import { generateText, streamText, jsonSchema, tool } from "ai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { ChatOpenAI } from "@langchain/openai";
import { AIMessage, HumanMessage, ToolMessage } from "@langchain/core/messages";

const baseURL = process.env.TANDEM_BASE_URL;
if (!baseURL) {
  console.error("set TANDEM_BASE_URL, e.g. http://127.0.0.1:8080/v1");
  process.exit(2);
}
let failures = 0;
function check(cond, what) {
  if (!cond) {
    console.error("FAIL: " + what);
    failures++;
  } else {
    console.log("ok: " + what);
  }
}

const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 30000 });
const model = (await client.models.list()).data[0].id;
const weatherSchema = { type: "object", properties: { city: { type: "string" } }, required: ["city"] };
const tools = [{ type: "function", function: { name: "get_weather", description: "Weather of a city", parameters: weatherSchema } }];

// openai: a multi-turn tool conversation (assistant tool_calls -> role tool -> answer).
const turns = [
  { role: "user", content: "What is the weather in Paris?" },
  { role: "assistant", content: null,
    tool_calls: [{ id: "call_1", type: "function", function: { name: "get_weather", arguments: '{"city":"Paris"}' } }] },
  { role: "tool", tool_call_id: "call_1", content: "21 C, sunny" },
];
const answer = await client.chat.completions.create({ model, messages: turns, tools, max_tokens: 8, temperature: 0 });
const msg = answer.choices[0].message;
check(msg.role === "assistant" && (typeof msg.content === "string" || Array.isArray(msg.tool_calls)),
      `openai: the tool result turn is answered (${JSON.stringify(msg).slice(0, 160)})`);
check(["stop", "length", "tool_calls"].includes(answer.choices[0].finish_reason), "openai: finish_reason");
for (const c of msg.tool_calls ?? [])
  check(c.type === "function" && typeof c.id === "string" && typeof JSON.parse(c.function.arguments) === "object",
        `openai: a parsed tool call has an id and JSON arguments (${JSON.stringify(c)})`);
let streamedAnswer = "";
for await (const chunk of await client.chat.completions.create({ model, messages: turns, tools, max_tokens: 8, temperature: 0, stream: true }))
  for (const ch of chunk.choices) streamedAnswer += ch.delta?.content ?? "";
check(streamedAnswer === (msg.content ?? ""), "openai: the streamed tool-result answer equals the non-streamed one");

// Vercel AI SDK through the OpenAI-compatible provider.
const provider = createOpenAICompatible({ name: "tandem", baseURL, apiKey: "unused" });
const aiModel = provider.chatModel(model);
const gen = await generateText({ model: aiModel, prompt: "Say hi", maxOutputTokens: 8, temperature: 0, maxRetries: 0 });
check(typeof gen.text === "string" && gen.usage.outputTokens > 0, `ai: generateText (${JSON.stringify(gen.text)})`);
const st = streamText({ model: aiModel, prompt: "Say hi", maxOutputTokens: 8, temperature: 0, maxRetries: 0 });
let aiStreamed = "";
for await (const part of st.textStream) aiStreamed += part;
check(aiStreamed === gen.text, "ai: streamText equals generateText");
const aiTools = {
  get_weather: tool({ description: "Weather of a city", inputSchema: jsonSchema(weatherSchema), execute: async () => "21 C, sunny" }),
};
const aiTurns = await generateText({
  model: aiModel, tools: aiTools, maxOutputTokens: 8, temperature: 0, maxRetries: 0,
  messages: [
    { role: "user", content: "What is the weather in Paris?" },
    { role: "assistant", content: [{ type: "tool-call", toolCallId: "call_1", toolName: "get_weather", input: { city: "Paris" } }] },
    { role: "tool", content: [{ type: "tool-result", toolCallId: "call_1", toolName: "get_weather", output: { type: "text", value: "21 C, sunny" } }] },
  ],
});
check(typeof aiTurns.text === "string" && ["stop", "length", "tool-calls"].includes(aiTurns.finishReason),
      `ai: a tool conversation round-trips (${aiTurns.finishReason})`);

// LangChain: invoke, stream, bindTools with a tool history; logprobs through the client.
const lc = new ChatOpenAI({ model, apiKey: "unused", temperature: 0, maxTokens: 8, maxRetries: 0, configuration: { baseURL } });
const lcOut = await lc.invoke("Say hi");
check(typeof lcOut.content === "string", `langchain: invoke (${JSON.stringify(lcOut.content)})`);
let lcStreamed = "";
for await (const chunk of await lc.stream("Say hi")) lcStreamed += chunk.content;
check(lcStreamed === lcOut.content, "langchain: stream equals invoke");
const bound = lc.bindTools(tools);
const lcTurn = await bound.invoke([
  new HumanMessage("What is the weather in Paris?"),
  new AIMessage({ content: "", tool_calls: [{ id: "call_1", name: "get_weather", args: { city: "Paris" } }] }),
  new ToolMessage({ tool_call_id: "call_1", content: "21 C, sunny" }),
]);
check(Array.isArray(lcTurn.tool_calls) && lcTurn.tool_calls.every((c) => typeof c.name === "string" && typeof c.args === "object"),
      `langchain: bindTools answers a tool history and its tool_calls parse (${JSON.stringify(lcTurn.tool_calls)})`);
const lcLp = new ChatOpenAI({ model, apiKey: "unused", temperature: 0, maxTokens: 4, maxRetries: 0, logprobs: true, topLogprobs: 2,
                              configuration: { baseURL } });
const lpOut = await lcLp.invoke("Say hi");
const lpContent = lpOut.response_metadata?.logprobs?.content ?? [];
check(lpContent.length > 0 && lpContent.every((e) => e.top_logprobs[0].token === e.token),
      `langchain: logprobs in response_metadata, greedy = top 1 (${lpContent.length})`);

// Forced tool calls (tool_choice named / required): grammar-constrained, so always one valid call.
const boundedSchema = { type: "object", properties: { city: { type: "string", maxLength: 8 }, days: { type: "integer" } },
                        required: ["city", "days"], additionalProperties: false };
const validArgs = (a) => a !== null && typeof a === "object" && Object.keys(a).length === 2 &&
  typeof a.city === "string" && [...a.city].length <= 8 && Number.isInteger(a.days);
const boundedTools = [{ type: "function", function: { name: "get_weather", description: "Weather of a city", parameters: boundedSchema } },
                      { type: "function", function: { name: "ping", description: "Ping", parameters: { type: "object", properties: {} } } }];
for (const [label, toolChoice] of [["named", { type: "function", function: { name: "get_weather" } }], ["required", "required"]]) {
  const forced = await client.chat.completions.create({ model, messages: [{ role: "user", content: "Weather in Paris?" }],
    tools: boundedTools, tool_choice: toolChoice, max_tokens: 200, temperature: 1, seed: 11 });
  const fc = forced.choices[0];
  const call = fc.message.tool_calls?.[0];
  check(fc.finish_reason === "tool_calls" && fc.message.tool_calls.length === 1 &&
        (call.function.name === "ping" ? label === "required" && JSON.parse(call.function.arguments) !== null
                                       : call.function.name === "get_weather" && validArgs(JSON.parse(call.function.arguments))),
        `openai: tool_choice ${label} gives one schema-valid call (${JSON.stringify(fc.message).slice(0, 200)})`);
}
const lcForced = new ChatOpenAI({ model, apiKey: "unused", temperature: 0, maxTokens: 200, maxRetries: 0, configuration: { baseURL } });
const structured = lcForced.withStructuredOutput(boundedSchema, { name: "get_weather", method: "functionCalling" });
const so = await structured.invoke("Weather in Paris?");
check(validArgs(so), `langchain: withStructuredOutput (function calling) parses a schema-valid object (${JSON.stringify(so)})`);
const boundForced = lcForced.bindTools(boundedTools, { tool_choice: "get_weather" });
const bf = await boundForced.invoke("Weather in Paris?");
check(bf.tool_calls?.length === 1 && bf.tool_calls[0].name === "get_weather" && validArgs(bf.tool_calls[0].args),
      `langchain: bindTools with tool_choice names the call (${JSON.stringify(bf.tool_calls)})`);

if (failures) {
  console.error(`${failures} check(s) failed`);
  process.exit(1);
}
console.log("all client library checks passed");
