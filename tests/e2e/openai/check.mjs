// Drives a running tandem server with the official openai npm client. Exits non-zero on any
// mismatch. TANDEM_BASE_URL is like http://127.0.0.1:PORT/v1.
import OpenAI from "openai";

const baseURL = process.env.TANDEM_BASE_URL;
if (!baseURL) {
  console.error("set TANDEM_BASE_URL, e.g. http://127.0.0.1:8080/v1");
  process.exit(2);
}
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 30000 });
let failures = 0;
function check(cond, what) {
  if (!cond) {
    console.error("FAIL: " + what);
    failures++;
  } else {
    console.log("ok: " + what);
  }
}

const models = await client.models.list();
const model = models.data[0]?.id;
check(typeof model === "string" && model.length > 0, `models.list returns a model id (${model})`);

const params = { model, max_tokens: 8, temperature: 0, seed: 1 };

const c = await client.completions.create({ ...params, prompt: "Hello world" });
check(c.object === "text_completion", "completion object");
check(c.id.startsWith("cmpl-"), "completion id");
check(c.choices.length === 1 && typeof c.choices[0].text === "string", "completion text");
check(["stop", "length"].includes(c.choices[0].finish_reason), "completion finish_reason");
check(c.usage && c.usage.total_tokens === c.usage.prompt_tokens + c.usage.completion_tokens, "completion usage");

let streamed = "";
let usage = null;
let finish = null;
const cs = await client.completions.create({ ...params, prompt: "Hello world", stream: true,
                                             stream_options: { include_usage: true } });
for await (const chunk of cs) {
  if (chunk.usage) usage = chunk.usage;
  for (const ch of chunk.choices) {
    streamed += ch.text;
    if (ch.finish_reason) finish = ch.finish_reason;
  }
}
check(streamed === c.choices[0].text, `streamed completion equals the non-streamed one (${JSON.stringify(streamed)})`);
check(finish === c.choices[0].finish_reason, "streamed finish_reason");
check(usage && usage.completion_tokens === c.usage.completion_tokens, "streamed usage");

const messages = [{ role: "system", content: "You are terse." }, { role: "user", content: "Say hi" }];
const chat = await client.chat.completions.create({ ...params, messages });
check(chat.object === "chat.completion", "chat object");
check(chat.choices[0].message.role === "assistant", "chat role");
check(typeof chat.choices[0].message.content === "string", "chat content");

let chatStreamed = "";
const chs = await client.chat.completions.create({ ...params, messages, stream: true });
for await (const chunk of chs) {
  for (const ch of chunk.choices) chatStreamed += ch.delta?.content ?? "";
}
check(chatStreamed === chat.choices[0].message.content, "streamed chat equals the non-streamed one");

// Errors surface as APIError with the status.
try {
  await client.completions.create({ ...params, prompt: "x", temperature: 5 });
  check(false, "temperature 5 is rejected");
} catch (e) {
  check(e instanceof OpenAI.APIError && e.status === 422 && /temperature/.test(e.message), `422 for temperature 5 (${e.message})`);
}

// A parameter Tandem does not honour is refused naming it, never silently ignored.
try {
  await client.completions.create({ ...params, prompt: "x", suffix: "y" });
  check(false, "suffix is refused");
} catch (e) {
  check(e instanceof OpenAI.APIError && e.status === 422 && e.param === "suffix", `422 naming suffix (${e.message})`);
}
const echoed = await client.completions.create({ ...params, prompt: "Hello world", echo: true });
check(echoed.choices[0].text === "Hello world" + c.choices[0].text, `echo prepends the prompt (${JSON.stringify(echoed.choices[0].text)})`);

// logprobs: the same distribution sampling used; at temperature 0 the first top entry is the chosen token.
const lpChat = await client.chat.completions.create({ ...params, messages, logprobs: true, top_logprobs: 3 });
const content = lpChat.choices[0].logprobs?.content ?? [];
check(content.length === lpChat.usage.completion_tokens || lpChat.choices[0].finish_reason === "stop",
      `chat logprobs: one entry per token (${content.length} for ${lpChat.usage.completion_tokens})`);
check(content.length > 0 && content.every((e) => e.top_logprobs.length === 3 && e.top_logprobs[0].token === e.token &&
                                               e.top_logprobs[0].logprob === e.logprob && e.logprob <= 0),
      "chat logprobs: at temperature 0 top_logprobs[0] is the chosen token, with its logprob");
check(content.every((e) => e.top_logprobs.every((t, i) => i === 0 || t.logprob <= e.top_logprobs[i - 1].logprob)),
      "chat logprobs: top_logprobs are most likely first");
check(content.every((e) => !e.token.startsWith("bytes:")) ? content.map((e) => e.token).join("") === lpChat.choices[0].message.content : true,
      "chat logprobs: the tokens spell the content");
let lpStreamed = [];
for await (const chunk of await client.chat.completions.create({ ...params, messages, logprobs: true, top_logprobs: 3, stream: true }))
  for (const ch of chunk.choices) lpStreamed.push(...(ch.logprobs?.content ?? []));
check(JSON.stringify(lpStreamed) === JSON.stringify(content), "chat logprobs: streamed equal the non-streamed ones");
const lpc = await client.completions.create({ ...params, prompt: "Hello world", logprobs: 2 });
const clp = lpc.choices[0].logprobs;
check(clp && clp.tokens.length === lpc.usage.completion_tokens && clp.token_logprobs.length === clp.tokens.length &&
      clp.top_logprobs.every((m, i) => Object.keys(m).length >= 1 && Object.values(m)[0] === clp.token_logprobs[i]) &&
      clp.text_offset[0] === 0, `completions logprobs: tokens, token_logprobs, top_logprobs, text_offset (${JSON.stringify(clp).slice(0, 200)})`);
try {
  await client.chat.completions.create({ ...params, model: "gpt-4o", messages });
  check(false, "a model not served is refused");
} catch (e) {
  check(e instanceof OpenAI.APIError && e.status === 404 && e.code === "model_not_found", `404 model_not_found (${e.message})`);
}
const retrieved = await client.models.retrieve(model);
check(retrieved.id === model, `models.retrieve returns the served model (${retrieved.id})`);

// A logit_bias of -100 on the greedy first token changes it.
const first = await client.completions.create({ ...params, prompt: [1, 10, 20], max_tokens: 1 });
const tok = await fetch(`${baseURL.replace(/\/v1\/?$/, "")}/tokenize`, {
  method: "POST", headers: { "Content-Type": "application/json" },
  body: JSON.stringify({ content: first.choices[0].text, add_special: false }),
}).then((r) => r.json());
// SentencePiece may prefix the text with a space token: the generated token is the last one.
const greedyId = tok.tokens?.[tok.tokens.length - 1];
check(Number.isInteger(greedyId), `the greedy token re-tokenizes (${JSON.stringify(tok)})`);
{
  const biased = await client.completions.create({ ...params, prompt: [1, 10, 20], max_tokens: 1,
                                                   logit_bias: { [greedyId]: -100 } });
  check(biased.choices[0].text !== first.choices[0].text, `logit_bias -100 changes the greedy token (${JSON.stringify(first.choices[0].text)} -> ${JSON.stringify(biased.choices[0].text)})`);
}
const penalized = await client.chat.completions.create({ ...params, messages, max_tokens: 4, presence_penalty: 1.5,
                                                          frequency_penalty: 1, min_p: 0.1 });
check(typeof penalized.choices[0].message.content === "string", "penalties and min_p are accepted");

// Structured output: a json_schema response_format always parses and has the schema's shape.
{
  const schema = { type: "object", additionalProperties: false, required: ["kind", "n"],
                   properties: { kind: { enum: ["a", "b"] }, n: { type: "integer" } } };
  let valid = 0;
  for (let seed = 1; seed <= 5; seed++) {
    const r = await client.chat.completions.create({ model, messages, max_tokens: 200, temperature: 1, seed,
      response_format: { type: "json_schema", json_schema: { name: "x", strict: true, schema } } });
    try {
      const v = JSON.parse(r.choices[0].message.content);
      if (["a", "b"].includes(v.kind) && Number.isInteger(v.n) && Object.keys(v).length === 2) valid++;
    } catch {}
  }
  check(valid === 5, `json_schema outputs parse and validate (${valid} of 5)`);
}

// n = 3: three indexed choices from one prefill (the metrics count one), non-streaming and streaming.
{
  const root = baseURL.replace(/\/v1\/?$/, "");
  const metric = async (name) => {
    const text = await fetch(`${root}/metrics`).then((r) => r.text());
    const m = text.match(new RegExp(`^${name} ([0-9.e+]+)$`, "m"));
    return m ? Number(m[1]) : NaN;
  };
  const admitted0 = await metric("tandem_prefill_admitted_total");
  const forks0 = await metric("tandem_decode_forks_total");
  const n3 = await client.completions.create({ ...params, prompt: "Hello world", n: 3 });
  check(n3.choices.length === 3 && n3.choices.every((ch, i) => ch.index === i && typeof ch.text === "string" &&
                                                            ["stop", "length"].includes(ch.finish_reason)),
        `n=3: choices with indices 0,1,2 and finish reasons (${JSON.stringify(n3.choices.map((ch) => [ch.index, ch.finish_reason]))})`);
  check(n3.choices.every((ch) => ch.text === c.choices[0].text), "n=3 at temperature 0: every choice is the n=1 text");
  check(n3.usage.prompt_tokens === c.usage.prompt_tokens && n3.usage.completion_tokens === 3 * c.usage.completion_tokens,
        `n=3 usage: the prompt once, the completion tokens of all choices (${JSON.stringify(n3.usage)})`);
  check(await metric("tandem_prefill_admitted_total") === admitted0 + 1, "n=3: one prefill (tandem_prefill_admitted_total)");
  check(await metric("tandem_decode_forks_total") === forks0 + 2, "n=3: two forks (tandem_decode_forks_total)");
  const texts = ["", "", ""];
  const finishes = [null, null, null];
  for await (const chunk of await client.chat.completions.create({ ...params, messages, n: 3, stream: true }))
    for (const ch of chunk.choices) {
      texts[ch.index] += ch.delta?.content ?? "";
      if (ch.finish_reason) finishes[ch.index] = ch.finish_reason;
    }
  check(finishes.every((f) => f === "stop" || f === "length"), `n=3 streamed: one finish_reason per index (${JSON.stringify(finishes)})`);
  check(texts.every((t) => t === chat.choices[0].message.content), "n=3 streamed at temperature 0: every choice is the n=1 content");
  try {
    await client.completions.create({ ...params, prompt: "x", n: 100 });
    check(false, "n=100 is refused");
  } catch (e) {
    check(e instanceof OpenAI.APIError && e.status === 422 && e.param === "n" && /limits\.max_choices/.test(e.message),
          `422 naming n and its limit (${e.message})`);
  }
}

if (failures) {
  console.error(`${failures} check(s) failed`);
  process.exit(1);
}
console.log("all openai client checks passed");
