// A Node.js client of a live maskwire worker: loads the .proto files at run time with
// @grpc/proto-loader (no generated code) and calls Worker.GetModelInfo and Worker.Generate with
// constraints, checking the outputs.
//
//   MASKWIRE_WORKER=127.0.0.1:50052 \
//   MASKWIRE_GOOGLEAPIS_PROTOS=<dir holding google/rpc/status.proto> \
//   node --test
//
// Without MASKWIRE_WORKER every test is skipped. tests/integration/cli/test_node_client.py runs
// this file against a worker it starts.
import assert from "node:assert/strict";
import path from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";

const here = path.dirname(fileURLToPath(import.meta.url));
const protoRoot = path.resolve(here, "../../protos");
const worker = process.env.MASKWIRE_WORKER;
const googleapis = process.env.MASKWIRE_GOOGLEAPIS_PROTOS;
const skip = worker ? false : "set MASKWIRE_WORKER=HOST:PORT to run against a live worker";
const DEADLINE_MS = 300_000;

function loadClient() {
  const includeDirs = [protoRoot];
  if (googleapis) includeDirs.push(googleapis);
  // grammar.proto imports google/rpc/status.proto: loading both proves the whole contract loads.
  const files = ["maskwire/v1/worker.proto"];
  if (googleapis) files.push("maskwire/v1/grammar.proto");
  const definition = protoLoader.loadSync(files, {
    includeDirs,
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  const pkg = grpc.loadPackageDefinition(definition).maskwire.v1;
  return new pkg.Worker(worker, grpc.credentials.createInsecure());
}

function deadline() {
  return new Date(Date.now() + DEADLINE_MS);
}

function getModelInfo(client) {
  return new Promise((resolve, reject) => {
    client.GetModelInfo({}, { deadline: deadline() }, (err, info) =>
      err ? reject(err) : resolve(info),
    );
  });
}

// Runs one Generate call; resolves with the concatenated text, token ids and the last message.
function generate(client, request) {
  return new Promise((resolve, reject) => {
    const call = client.Generate(request, { deadline: deadline() });
    let text = "";
    const tokenIds = [];
    let last = null;
    call.on("data", (msg) => {
      text += msg.text;
      tokenIds.push(...msg.token_ids);
      if (msg.finish_reason !== "FINISH_REASON_UNSPECIFIED") last = msg;
    });
    call.on("error", reject);
    call.on("end", () => resolve({ text, tokenIds, last }));
  });
}

test("GetModelInfo describes the served model", { skip }, async () => {
  const client = loadClient();
  try {
    const info = await getModelInfo(client);
    assert.ok(info.model.length > 0);
    assert.ok(info.vocab_size > 0);
    assert.ok(info.structured_outputs);
  } finally {
    client.close();
  }
});

test("Generate with a choice constraint returns one of the choices", { skip }, async () => {
  const client = loadClient();
  try {
    const choices = ["yes", "no"];
    const { text, tokenIds, last } = await generate(client, {
      text: "Is Paris the capital of France? Answer yes or no.\nAnswer: ",
      sampling: { temperature: 0, max_tokens: 8 },
      constraint: { choice: { choices } },
    });
    assert.ok(choices.includes(text), `unexpected output ${JSON.stringify(text)}`);
    assert.ok(tokenIds.length > 0);
    assert.equal(last.finish_reason, "FINISH_REASON_STOP");
    assert.equal(last.usage.completion_tokens, tokenIds.length);
  } finally {
    client.close();
  }
});

test("Generate with a JSON schema returns valid JSON", { skip }, async () => {
  const client = loadClient();
  try {
    const schema = {
      type: "object",
      properties: {
        city: { type: "string", maxLength: 30 },
        country: { type: "string", maxLength: 30 },
        visited: { type: "boolean" },
      },
      required: ["city", "country", "visited"],
      additionalProperties: false,
    };
    const { text, last } = await generate(client, {
      text: "Describe Paris as JSON with its city name, country and whether you visited it.\n",
      sampling: { temperature: 0, max_tokens: 64 },
      constraint: { json_schema: JSON.stringify(schema) },
    });
    assert.equal(last.finish_reason, "FINISH_REASON_STOP", `output: ${text}`);
    const value = JSON.parse(text);
    assert.deepEqual(Object.keys(value).sort(), ["city", "country", "visited"]);
    assert.equal(typeof value.city, "string");
    assert.ok(value.city.length <= 30);
    assert.equal(typeof value.country, "string");
    assert.equal(typeof value.visited, "boolean");
  } finally {
    client.close();
  }
});

test("an invalid schema fails with INVALID_ARGUMENT and rich details", { skip }, async () => {
  const client = loadClient();
  try {
    await assert.rejects(
      generate(client, {
        text: "x",
        sampling: { max_tokens: 4 },
        constraint: { json_schema: '{"type": "object", "properties": {"a": {"type": 5}}}' },
      }),
      (err) => {
        assert.equal(err.code, grpc.status.INVALID_ARGUMENT);
        // google.rpc.Status with BadRequest details travels in this trailer.
        assert.ok(err.metadata.get("grpc-status-details-bin").length > 0);
        return true;
      },
    );
  } finally {
    client.close();
  }
});
