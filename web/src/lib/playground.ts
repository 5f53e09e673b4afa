/** The playground's wire work: reading an OpenAI SSE stream, and the same request as curl and Python. */

export interface ChatMessage {
  role: "system" | "user" | "assistant";
  content: string;
}

export interface PlaygroundRequest {
  model: string;
  messages: ChatMessage[];
  max_tokens: number;
  temperature: number;
}

/** Splits a text/event-stream into the `data:` payloads of its events, however the bytes are chunked. */
export class SseReader {
  private buffer = "";

  /** Payloads of the events completed by `chunk` (without the `data: ` prefix; `[DONE]` included). */
  push(chunk: string): string[] {
    this.buffer += chunk.replace(/\r\n?/g, "\n");
    const out: string[] = [];
    let end: number;
    while ((end = this.buffer.indexOf("\n\n")) !== -1) {
      const event = this.buffer.slice(0, end);
      this.buffer = this.buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""));
      if (data.length) out.push(data.join("\n"));
    }
    return out;
  }
}

export interface StreamUsage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
  prompt_tokens_details?: { cached_tokens?: number } | null;
}

/** What one chunk of a chat completion stream adds: text, the response id, the finish reason, usage. */
export interface ChunkDelta {
  id: string | null;
  text: string;
  finish: string | null;
  usage: StreamUsage | null;
}

export function readChunk(payload: string): ChunkDelta | null {
  if (payload === "[DONE]") return null;
  const c = JSON.parse(payload) as {
    id?: string;
    choices?: { delta?: { content?: string | null }; finish_reason?: string | null }[];
    usage?: StreamUsage | null;
    error?: { message?: string };
  };
  if (c.error) throw new Error(c.error.message ?? "The stream reported an error.");
  const choice = c.choices?.[0];
  return { id: c.id ?? null, text: choice?.delta?.content ?? "", finish: choice?.finish_reason ?? null, usage: c.usage ?? null };
}

/** The request body the playground sends (and the snippets show, streaming included). */
export function requestBody(r: PlaygroundRequest): Record<string, unknown> {
  return {
    model: r.model,
    messages: r.messages,
    max_tokens: r.max_tokens,
    temperature: r.temperature,
    stream: true,
    stream_options: { include_usage: true },
  };
}

const shellQuote = (s: string) => `'${s.replace(/'/g, `'\\''`)}'`;

/** The same call with curl; the key is read from $MULTIPLEX_API_KEY, never written into the snippet. */
export function curlSnippet(baseUrl: string, r: PlaygroundRequest): string {
  return [
    `curl ${shellQuote(`${baseUrl}/chat/completions`)} \\`,
    `  -H "Authorization: Bearer $MULTIPLEX_API_KEY" \\`,
    `  -H "Content-Type: application/json" \\`,
    `  -N -d ${shellQuote(JSON.stringify(requestBody(r), null, 2))}`,
  ].join("\n");
}

const pyString = (s: string) => JSON.stringify(s); // a JSON string literal is a valid Python string literal

/** The same call with the OpenAI Python SDK. */
export function pythonSnippet(baseUrl: string, r: PlaygroundRequest): string {
  const messages = r.messages.map((m) => `        {"role": ${pyString(m.role)}, "content": ${pyString(m.content)}},`);
  return [
    "import os",
    "from openai import OpenAI",
    "",
    `client = OpenAI(base_url=${pyString(baseUrl)}, api_key=os.environ["MULTIPLEX_API_KEY"])`,
    "stream = client.chat.completions.create(",
    `    model=${pyString(r.model)},`,
    "    messages=[",
    ...messages,
    "    ],",
    `    max_tokens=${r.max_tokens},`,
    `    temperature=${r.temperature},`,
    "    stream=True,",
    '    stream_options={"include_usage": True},',
    ")",
    "for chunk in stream:",
    "    if chunk.choices and chunk.choices[0].delta.content:",
    '        print(chunk.choices[0].delta.content, end="", flush=True)',
    "    if chunk.usage:",
    "        print(f\"\\n{chunk.usage.prompt_tokens} tokens in, {chunk.usage.completion_tokens} out\")",
  ].join("\n");
}
