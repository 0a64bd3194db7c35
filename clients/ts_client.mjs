// The TypeScript SDK 1.x client, driven by the tests one JSON line at a time: one legacy (2025-11-25) session
// with the proxy, every request under the SDK's own timeout (10 s unless given).
//
//   node ts_client.mjs URL [HEADERS_JSON] [TIMEOUT_MS]
//   stdin:  {"op": "list"} | {"op": "call", "name": "...", "arguments": {...}, "progress": false, "reset": false}
//   stdout: one JSON line per command: {"result": ..., "elapsedMs": n, "progress": [..]} or {"error": {...}}
import { createInterface } from "node:readline";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const [url, headersJson = "{}", timeoutArg = "10000"] = process.argv.slice(2);
const timeout = Number(timeoutArg);
const transport = new StreamableHTTPClientTransport(new URL(url), {
  requestInit: { headers: JSON.parse(headersJson) },
});
const client = new Client({ name: "ts-sdk-test-client", version: "1.0.0" }, { capabilities: {} });
await client.connect(transport);
process.stdout.write(JSON.stringify({ ready: client.getServerVersion()?.name ?? null }) + "\n");

const lines = createInterface({ input: process.stdin });
for await (const line of lines) {
  if (!line.trim()) continue;
  const command = JSON.parse(line);
  const started = performance.now();
  const progress = [];
  try {
    let result;
    if (command.op === "list") {
      result = await client.listTools(undefined, { timeout });
    } else if (command.op === "call") {
      const options = { timeout, resetTimeoutOnProgress: Boolean(command.reset) };
      if (command.progress) options.onprogress = (note) => progress.push(note);
      result = await client.callTool({ name: command.name, arguments: command.arguments ?? {} }, undefined, options);
    } else {
      throw new Error(`unknown op ${command.op}`);
    }
    const elapsedMs = performance.now() - started;
    process.stdout.write(JSON.stringify({ result, elapsedMs, progress }) + "\n");
  } catch (error) {
    const elapsedMs = performance.now() - started;
    const shown = { message: String(error?.message ?? error), code: error?.code ?? null };
    process.stdout.write(JSON.stringify({ error: shown, elapsedMs, progress }) + "\n");
  }
}
await client.close();
