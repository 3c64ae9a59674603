// A streamed chat completion through the real npm `openai` client, the way anything-llm's
// "Generic OpenAI" provider sends it (stream: true, temperature, max_tokens, no stream_options).
// usage: node npm_openai_stream.cjs BASE_URL MODEL MODE   (MODE: full | hangup, which aborts
// the stream after its third content chunk). Prints one JSON line with what the client saw.
const { OpenAI } = require("openai");

async function main() {
  const [baseURL, model, mode] = process.argv.slice(2);
  const client = new OpenAI({ baseURL, apiKey: "sk-generic-openai", maxRetries: 0, timeout: 20000 });
  const t0 = performance.now();
  const stream = await client.chat.completions.create({
    model,
    stream: true,
    temperature: 0.7,
    max_tokens: 64,
    messages: [
      { role: "system", content: "Given the following conversation, answer briefly." },
      { role: "user", content: "Q: capital of France? A:" },
    ],
  });
  let ttft = null;
  let chunks = 0;
  let text = "";
  let aborted = false;
  for await (const chunk of stream) {
    const delta = chunk.choices?.[0]?.delta?.content;
    if (!delta) continue;
    if (ttft === null) ttft = performance.now() - t0;
    chunks += 1;
    text += delta;
    if (mode === "hangup" && chunks >= 3) {
      stream.controller.abort(); // what a closed browser tab / stopped generation does
      aborted = true;
      break;
    }
  }
  console.log(JSON.stringify({ chunks, text, ttft_ms: ttft, total_ms: performance.now() - t0, aborted }));
}

main().catch((err) => {
  console.error(String((err && err.stack) || err));
  process.exit(1);
});
