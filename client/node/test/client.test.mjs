// Runs against a live server that tests/system/test_node_client.py starts and fills:
//   WEIGHTSERVER_ADDRESS  host:port of that server
//   EXPECTED_JSON         path of a JSON file describing what Python published
// Run: pytest tests/system/test_node_client.py  (or set both variables and run `npm test` here).
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { after, before, describe, test } from "node:test";

import { WeightServerClient, WeightServerError, parseSafetensors } from "../src/index.js";

const ADDRESS = process.env.WEIGHTSERVER_ADDRESS;
const EXPECTED_PATH = process.env.EXPECTED_JSON;
const skip = !ADDRESS || !EXPECTED_PATH ? "needs WEIGHTSERVER_ADDRESS and EXPECTED_JSON (see tests/system/test_node_client.py)" : false;
const GRPC_DEADLINE_EXCEEDED = 4;
const GRPC_NOT_FOUND = 5;
const GRPC_UNAUTHENTICATED = 16;

function sha256(typedArray) {
  return createHash("sha256")
    .update(new Uint8Array(typedArray.buffer, typedArray.byteOffset, typedArray.byteLength))
    .digest("hex");
}

/** Runs `body` with the environment variables `values` set (undefined: unset), then puts the
 * environment back as it was. */
async function withEnvironment(values, body) {
  const saved = Object.fromEntries(Object.keys(values).map((name) => [name, process.env[name]]));
  const put = (entries) => {
    for (const [name, value] of Object.entries(entries)) {
      if (value === undefined) delete process.env[name];
      else process.env[name] = value;
    }
  };
  put(values);
  try {
    return await body();
  } finally {
    put(saved);
  }
}

/** `body(client)` with a client made by `make()`, closed afterwards. */
async function using(make, body) {
  const client = make();
  try {
    return await body(client);
  } finally {
    client.close();
  }
}

function assertTensor(name, actual, expected) {
  assert.ok(actual, `tensor ${name} missing`);
  assert.equal(actual.dtype, expected.dtype, `${name} dtype`);
  assert.deepEqual(actual.shape, expected.shape, `${name} shape`);
  if (expected.hex !== undefined) {
    // F16 / BF16: raw bytes, no typed array.
    assert.equal(actual.data, undefined, `${name} should come as raw bytes`);
    assert.ok(actual.bytes instanceof Uint8Array);
    assert.equal(Buffer.from(actual.bytes).toString("hex"), expected.hex, `${name} bytes`);
    return;
  }
  const data = actual.data;
  assert.equal(data.byteOffset % data.BYTES_PER_ELEMENT, 0);
  if (expected.values !== undefined) {
    const values = Array.from(data, (v) => (typeof v === "bigint" ? v.toString() : v));
    assert.deepEqual(values, expected.values, `${name} values`);
  }
  if (expected.sha256 !== undefined) {
    assert.equal(data.length, expected.numel, `${name} numel`);
    assert.equal(sha256(data), expected.sha256, `${name} bytes sha256`);
    for (const [index, value] of expected.samples) {
      const got = data[index];
      if (typeof got === "bigint") assert.equal(got, BigInt(value), `${name}[${index}]`);
      else assert.equal(got, value, `${name}[${index}]`);
    }
  }
}

describe("weightserver node client", { skip }, () => {
  let expected;
  let client;

  before(() => {
    expected = JSON.parse(readFileSync(EXPECTED_PATH, "utf8"));
    client = new WeightServerClient(ADDRESS, { clientId: "node-test" });
  });
  after(() => client?.close());

  test("latest describes the newest version", async () => {
    const info = await client.latest("policy");
    const want = expected.policy.at(-1);
    assert.equal(info.model, "policy");
    assert.equal(info.version, want.version);
    assert.equal(info.byte_size, want.byte_size);
    assert.equal(info.sha256, want.sha256);
    assert.deepEqual({ ...info.metadata }, want.metadata);
    assert.deepEqual(info.tensors.map((t) => t.name).sort(), Object.keys(want.tensors).sort());
  });

  test("fetch (latest) returns the published values of every dtype", async () => {
    const want = expected.policy.at(-1);
    const result = await client.fetch("policy");
    assert.equal(result.version, want.version);
    assert.deepEqual(result.metadata, want.metadata);
    assert.deepEqual(Object.keys(result.tensors).sort(), Object.keys(want.tensors).sort());
    for (const [name, t] of Object.entries(want.tensors)) assertTensor(name, result.tensors[name], t);
  });

  test("fetch an exact older version", async () => {
    const want = expected.policy[0];
    const result = await client.fetch("policy", { version: want.version });
    assert.equal(result.version, want.version);
    assert.deepEqual(result.metadata, want.metadata);
    for (const [name, t] of Object.entries(want.tensors)) assertTensor(name, result.tensors[name], t);
  });

  test("fetch newerThan: null when up to date, the latest otherwise", async () => {
    const latest = expected.policy.at(-1).version;
    assert.equal(await client.fetch("policy", { newerThan: latest }), null);
    const result = await client.fetch("policy", { newerThan: latest - 1 });
    assert.equal(result.version, latest);
  });

  test("fetch a multi-chunk model (> 3 MiB)", async () => {
    const want = expected.big;
    assert.ok(want.byte_size > 3 * 1024 * 1024);
    const result = await client.fetch("big");
    assert.equal(result.version, want.version);
    assert.equal(result.info.byte_size, want.byte_size);
    assert.equal(result.info.sha256, want.sha256);
    for (const [name, t] of Object.entries(want.tensors)) assertTensor(name, result.tensors[name], t);
  });

  test("errors carry the gRPC code and the weightserver-error name", async () => {
    await assert.rejects(client.fetch("no-such-model"), (err) => {
      assert.ok(err instanceof WeightServerError);
      assert.equal(err.code, GRPC_NOT_FOUND);
      assert.equal(err.errorName, "ModelNotFound");
      return true;
    });
    await assert.rejects(client.latest("no-such-model"), (err) => err.code === GRPC_NOT_FOUND && err.errorName === "ModelNotFound");
  });

  test("watch yields new versions in order and can be broken out of", async () => {
    const model = expected.watch.model;
    const since = (await client.latest(model)).version;
    const seen = [];
    for await (const event of client.watch(model, { since, timeoutMs: 20000 })) {
      assert.equal(event.version.model, model);
      assert.equal(event.gap, false);
      assert.equal(event.version.metadata.step, String(event.version.version));
      seen.push(event.version.version);
      if (seen.length === 2) break;
    }
    assert.deepEqual(seen, [since + 1, since + 2]);
    // The channel still works after cancelling the watch.
    assert.ok((await client.latest(model)).version >= since + 2);
  });

  test("watch of a model with no version waits, so only a deadline ends it", async () => {
    // A misspelled name looks like a model whose first version is still to come (the server
    // waits for it on purpose): no error arrives, the caller's deadline ends the watch.
    const started = Date.now();
    await assert.rejects(
      (async () => {
        for await (const event of client.watch("polciy", { timeoutMs: 500 })) assert.fail(`unexpected event ${event.version.version}`);
      })(),
      (err) => {
        assert.ok(err instanceof WeightServerError);
        assert.equal(err.code, GRPC_DEADLINE_EXCEEDED);
        return true;
      },
    );
    assert.ok(Date.now() - started >= 400, "the watch ended before its deadline");
  });

  test("token: missing is UNAUTHENTICATED, a reader token works", async () => {
    const auth = expected.auth;
    assert.ok(auth, "EXPECTED_JSON has no \"auth\" entry");
    const anonymous = new WeightServerClient(auth.address);
    try {
      await assert.rejects(anonymous.latest("policy"), (err) => {
        assert.equal(err.code, GRPC_UNAUTHENTICATED);
        assert.equal(err.errorName, "AuthenticationRequired");
        return true;
      });
    } finally {
      anonymous.close();
    }
    const reader = new WeightServerClient(auth.address, { token: auth.token, clientId: "node-test" });
    try {
      const result = await reader.fetch("policy");
      assert.equal(result.version, auth.version);
      assert.deepEqual(Array.from(result.tensors.w.data), auth.w);
    } finally {
      reader.close();
    }
  });

  test("mutual TLS with CA, client certificate and key given as paths or PEM buffers", async () => {
    const tls = expected.tls;
    assert.ok(tls, "EXPECTED_JSON has no \"tls\" entry");
    for (const options of [
      { ca: tls.ca, cert: tls.cert, key: tls.key },
      { ca: readFileSync(tls.ca), cert: readFileSync(tls.cert), key: readFileSync(tls.key) },
    ]) {
      const secure = new WeightServerClient(tls.address, { tls: options });
      try {
        const result = await secure.fetch("policy");
        assert.equal(result.version, tls.version);
        assert.deepEqual(Array.from(result.tensors.w.data), tls.w);
      } finally {
        secure.close();
      }
    }
    // Plaintext to a TLS port fails (UNAVAILABLE, or a deadline where the server waits for a handshake).
    const plain = new WeightServerClient(tls.address);
    try {
      await assert.rejects(plain.latest("policy", { timeoutMs: 3000 }), (err) => err instanceof WeightServerError && [4, 14].includes(err.code));
    } finally {
      plain.close();
    }
  });

  test("WEIGHTSERVER_ADDRESS and WEIGHTSERVER_TOKEN are the defaults; what is given wins", async () => {
    const { auth } = expected;
    const plainLatest = expected.policy.at(-1).version;
    assert.notEqual(plainLatest, auth.version, "the two servers must be told apart by their latest version");
    // The harness sets WEIGHTSERVER_ADDRESS to the plain server.
    await using(() => new WeightServerClient(), async (c) => assert.equal((await c.latest("policy")).version, plainLatest));
    await withEnvironment({ WEIGHTSERVER_ADDRESS: auth.address, WEIGHTSERVER_TOKEN: auth.token }, async () => {
      await using(() => new WeightServerClient(), async (c) => {
        assert.equal(c.address, auth.address);
        assert.deepEqual(Array.from((await c.fetch("policy")).tensors.w.data), auth.w);
      });
      await using(() => new WeightServerClient(ADDRESS), async (c) => assert.equal((await c.latest("policy")).version, plainLatest));
      for (const token of ["wrong-token-0123456789", ""]) {
        await using(
          () => new WeightServerClient(undefined, { token }),
          (c) => assert.rejects(c.latest("policy"), (err) => err.code === GRPC_UNAUTHENTICATED),
        );
      }
    });
  });

  test("WEIGHTSERVER_TLS_CA, _CERT and _KEY turn on mutual TLS; tls: false and given files win", async () => {
    const { tls } = expected;
    const files = { WEIGHTSERVER_TLS_CA: tls.ca, WEIGHTSERVER_TLS_CERT: tls.cert, WEIGHTSERVER_TLS_KEY: tls.key };
    await withEnvironment(files, async () => {
      await using(() => new WeightServerClient(tls.address), async (c) => assert.equal((await c.fetch("policy")).version, tls.version));
      await using(
        () => new WeightServerClient(tls.address, { tls: false }),
        (c) => assert.rejects(c.latest("policy", { timeoutMs: 3000 }), (err) => [4, 14].includes(err.code)),
      );
      // A given CA wins over the environment's: one that did not sign the server's certificate fails.
      await using(
        () => new WeightServerClient(tls.address, { tls: { ca: tls.other_ca } }),
        (c) => assert.rejects(c.latest("policy", { timeoutMs: 3000 }), (err) => [4, 14].includes(err.code)),
      );
    });
    // Without the client certificate the server refuses the handshake: the environment carried it.
    await withEnvironment({ WEIGHTSERVER_TLS_CA: tls.ca }, () =>
      using(
        () => new WeightServerClient(tls.address),
        (c) => assert.rejects(c.latest("policy", { timeoutMs: 3000 }), (err) => [4, 14].includes(err.code)),
      ),
    );
    await withEnvironment({ WEIGHTSERVER_TLS_CERT: tls.cert, WEIGHTSERVER_TLS_KEY: undefined }, () =>
      assert.throws(() => new WeightServerClient(tls.address), TypeError),
    );
  });
});

test("parseSafetensors copies unaligned tensors into aligned arrays", () => {
  const header = Buffer.from(
    JSON.stringify({ __metadata__: { a: "b" }, x: { dtype: "U8", shape: [1], data_offsets: [0, 1] }, y: { dtype: "F32", shape: [2], data_offsets: [1, 9] } }),
  );
  const file = Buffer.alloc(8 + header.length + 9);
  file.writeBigUInt64LE(BigInt(header.length), 0);
  header.copy(file, 8);
  file[8 + header.length] = 7;
  file.writeFloatLE(1.5, 8 + header.length + 1);
  file.writeFloatLE(-2, 8 + header.length + 5);
  const { tensors, metadata } = parseSafetensors(file);
  assert.deepEqual(metadata, { a: "b" });
  assert.deepEqual(Array.from(tensors.x.data), [7]);
  assert.deepEqual(Array.from(tensors.y.data), [1.5, -2]);
});

// A stub whose Fetch streams the given messages, to exercise the size and sha256 checks.
function clientStreaming(messages) {
  const client = new WeightServerClient("127.0.0.1:1");
  client._stub.close();
  client._stub = {
    Fetch: () => ({
      async *[Symbol.asyncIterator]() {
        yield* messages;
      },
      cancel() {},
    }),
    close() {},
  };
  return client;
}

test("fetch rejects a wrong byte count or sha256 with DATA_LOSS", async () => {
  const bytes = Buffer.from("0800000000000000" + Buffer.from("{}      ").toString("hex"), "hex");
  const sha = createHash("sha256").update(bytes).digest("hex");
  const header = (byteSize, digest) => ({ kind: "header", header: { model: "m", version: "1", byte_size: String(byteSize), sha256: digest, metadata: {}, tensors: [] } });
  const ok = clientStreaming([header(bytes.length, sha), { kind: "chunk", chunk: bytes }]);
  assert.deepEqual((await ok.fetch("m")).tensors, {});
  for (const [messages, errorName] of [
    [[header(bytes.length + 1, sha), { kind: "chunk", chunk: bytes }], "SizeMismatch"],
    [[header(bytes.length, "0".repeat(64)), { kind: "chunk", chunk: bytes }], "ChecksumMismatch"],
  ]) {
    await assert.rejects(clientStreaming(messages).fetch("m"), (err) => err.code === 15 && err.errorName === errorName);
  }
});
