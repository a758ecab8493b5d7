// llama.cpp as an independent reference for Tandem (through node-llama-cpp's prebuilt CPU
// binary; nothing is downloaded or built at run time). Two modes, each printing `key values...`
// lines on stdout:
//
//   node greedy.mjs greedy --model FILE --prompt TEXT [--prompt TEXT...] [--tokens 16] [--threads 1] [--top 8]
//   for each prompt p (0, 1, ... in the order given):
//     prompt <p> <ids>              its token ids (BOS first when the model asks for it, as Tandem)
//     greedy <p> <ids>              the greedy next tokens, one forward per token (plain argmax of
//                                   the raw logits; ties go to the lowest id, as Tandem's argmax)
//     top <p> <i> <id:logit>...     the `--top` largest raw logits before generated token i
//
//   node greedy.mjs bench --model FILE [--threads 2] [--prompt 512] [--context 32] [--steps 16]
//   (both modes: [--kv-cache-dtype f32|f16], the KV cache's element type, f32 as Tandem's default)
//     prefill_tokens_per_s <x>  one sequence of `--prompt` random tokens; best of 5 runs
//     decode_tokens_per_s <x>   `--steps` greedy steps of one sequence after `--context` random
//                               tokens; 2 warm-up steps, then 3 repetitions, the best counts
//   (the same shapes `tandem bench model` times, so the two can be put side by side).
import { getLlama, LlamaLogLevel } from "node-llama-cpp";

function parse_args(argv) {
  const mode = argv[0];
  const opts = {};
  for (let i = 1; i < argv.length; i += 2) {
    if (!argv[i].startsWith("--") || i + 1 >= argv.length) usage(`bad argument '${argv[i]}'`);
    const key = argv[i].slice(2);
    if (key === "prompt") (opts.prompts ??= []).push(argv[i + 1]);
    opts[key] = argv[i + 1];
  }
  if ((mode !== "greedy" && mode !== "bench") || !opts.model) usage("a mode and --model FILE are required");
  return { mode, opts };
}

function usage(why) {
  console.error(`greedy.mjs: ${why}\nusage: node greedy.mjs greedy|bench --model FILE [--prompt TEXT|N] ` +
                "[--tokens N] [--threads N] [--top N] [--context N] [--steps N] [--kv-cache-dtype f32|f16]");
  process.exit(2);
}

function int_opt(opts, name, def) {
  const v = opts[name] === undefined ? def : Number(opts[name]);
  if (!Number.isInteger(v) || v < 0) usage(`--${name} must be a non-negative integer, got '${opts[name]}'`);
  return v;
}

const { mode, opts } = parse_args(process.argv.slice(2));
const threads = int_opt(opts, "threads", mode === "bench" ? 2 : 1);
// The KV cache's element type; f32 (llama.cpp's default is f16) as Tandem's default.
const kv_type = { f32: "F32", f16: "F16" }[opts["kv-cache-dtype"] ?? "f32"];
if (!kv_type) usage(`--kv-cache-dtype must be f32 or f16, got '${opts["kv-cache-dtype"]}'`);

// gpu: false and build: "never" with skipDownload: the prebuilt CPU binary of
// @node-llama-cpp/linux-x64 or an error, never a download of llama.cpp's source or a compile.
const llama = await getLlama({
  gpu: false,
  build: "never",
  skipDownload: true,
  usePrebuiltBinaries: true,
  progressLogs: false,
  logLevel: LlamaLogLevel.error,
  maxThreads: threads,
});
const model = await llama.loadModel({ modelPath: opts.model, gpuLayers: 0, useMmap: true });

// Greedy sampling with nothing else in the chain (no top-k/p, no penalties): the logits the
// addon returns are then llama_get_logits_ith's, untouched.
const greedy_options = { temperature: 0, topK: 0, topP: 1, minP: 0 };

async function make_sequence(context_size, batch_size) {
  const ctx = await model.createContext({
    contextSize: context_size,
    batchSize: batch_size,
    sequences: 1,
    threads: { ideal: threads, min: threads },
    flashAttention: false,
    experimentalKvCacheKeyType: kv_type,
    experimentalKvCacheValueType: kv_type,
  });
  return ctx.getSequence();
}

/// One token in; the next token's top raw logits out, as [[id, logit], ...] highest first.
async function step(seq, token, top) {
  const out = await seq.controlledEvaluate([
    [token, { generateNext: { token: true, logits: { filter: { tokens: [], includeTop: top } }, options: greedy_options } }],
  ]);
  const next = out[0]?.next;
  if (!next || !next.logits) throw new Error("llama.cpp returned no logits for the last token");
  return { token: next.token, top: [...next.logits.entries()] };
}

/// Plain argmax over the top logits, the lowest id winning a tie.
function argmax(top) {
  let best = top[0];
  for (const [id, v] of top) if (v > best[1] || (v === best[1] && id < best[0])) best = [id, v];
  return best[0];
}

if (mode === "greedy") {
  if (!opts.prompts) usage("greedy needs --prompt TEXT");
  const n = int_opt(opts, "tokens", 16);
  const top = Math.max(2, int_opt(opts, "top", 8));
  for (const [p, text] of opts.prompts.entries()) {
    const ids = model.tokenize(text, false);
    // Tandem's encode(text, add_bos = true) prepends BOS when the vocabulary asks for it.
    if (model.tokens.bos != null && model.tokens.shouldPrependBosToken) ids.unshift(model.tokens.bos);
    if (ids.length === 0) usage(`prompt ${p} has no tokens`);
    const seq = await make_sequence(ids.length + n + 8, Math.max(ids.length, 1));
    // The prompt but its last token in one batch, then one forward per token, each argmax fed back.
    if (ids.length > 1) await seq.evaluateWithoutGeneratingNewTokens(ids.slice(0, -1));
    let cur = ids[ids.length - 1];
    const out = [];
    const tops = [];
    for (let i = 0; i < n; ++i) {
      const r = await step(seq, cur, top);
      cur = argmax(r.top);
      if (r.token !== cur) throw new Error(`llama.cpp's greedy sampler chose ${r.token}, the argmax is ${cur}`);
      out.push(cur);
      tops.push(r.top);
    }
    await seq.context.dispose();
    console.log(`prompt ${p} ` + ids.join(" "));
    console.log(`greedy ${p} ` + out.join(" "));
    tops.forEach((t, i) => console.log(`top ${p} ${i} ` + t.map(([id, v]) => `${id}:${v}`).join(" ")));
  }
} else {
  const prompt = int_opt(opts, "prompt", 512), context = int_opt(opts, "context", 32);
  const steps = int_opt(opts, "steps", 16);
  if (prompt < 1 || steps < 1) usage("--prompt and --steps must be >= 1");
  const n_vocab = model.fileInfo.metadata?.tokenizer?.ggml?.tokens?.length;
  if (!Number.isInteger(n_vocab) || n_vocab < 4) throw new Error(`${opts.model}: no tokenizer.ggml.tokens array`);
  // A fixed-seed LCG mod 2^32: the same random tokens every run (any ids work; BOS/EOS avoided).
  let s = 1;
  const rand_token = () => {
    s = (Math.imul(s, 1103515245) + 12345) >>> 0;
    return 3 + ((s >>> 8) % (n_vocab - 3));
  };
  const now = () => Number(process.hrtime.bigint()) / 1e9;
  const decode_len = context + 2 + 3 * steps + 1;
  const seq = await make_sequence(Math.max(prompt, decode_len) + 8, Math.max(prompt, context, 1));

  const prompt_ids = Array.from({ length: prompt }, rand_token);
  let best_prefill = Infinity;
  for (let r = 0; r < 5; ++r) {
    await seq.clearHistory();
    const t0 = now();
    await seq.evaluateWithoutGeneratingNewTokens(prompt_ids);
    best_prefill = Math.min(best_prefill, now() - t0);
  }

  await seq.clearHistory();
  if (context > 0) await seq.evaluateWithoutGeneratingNewTokens(Array.from({ length: context }, rand_token));
  let cur = rand_token();
  const run = async (n) => {
    const t0 = now();
    // Only the token: asking for logits makes the addon sort the whole vocabulary every step.
    for (let i = 0; i < n; ++i) {
      const out = await seq.controlledEvaluate([[cur, { generateNext: { token: true, options: greedy_options } }]]);
      cur = out[0].next.token;
    }
    return now() - t0;
  };
  await run(2);
  let best_decode = Infinity;
  for (let r = 0; r < 3; ++r) best_decode = Math.min(best_decode, await run(steps));
  console.log(`prefill_tokens_per_s ${(prompt / best_prefill).toFixed(2)}`);
  console.log(`decode_tokens_per_s ${(steps / best_decode).toFixed(2)}`);
  console.log(`threads ${threads}`);
}
await model.dispose();
await llama.dispose();
