// Node.js client for weightserver (protos/weightserver/v1/weights.proto), loaded at run time.
//
//   import { WeightServerClient } from "weightserver-client";
//   const client = new WeightServerClient("localhost:50051");   // token, TLS: $WEIGHTSERVER_* unless given
//   const { version, metadata, tensors } = await client.fetch("policy");
//   for await (const event of client.watch("policy", { since: version })) console.log(event.version.version);
//   client.close();

import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { dirname, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";

const HERE = dirname(fileURLToPath(import.meta.url));

/** Default location of weights.proto: the repository's protos/ folder, beside client/node. */
export const DEFAULT_PROTO_PATH = resolve(HERE, "../../../protos/weightserver/v1/weights.proto");

const LOADER_OPTIONS = { longs: String, enums: String, defaults: true, oneofs: true, keepCase: true };

/** Where the client takes the defaults of the options not given, as the Python client does. */
export const ENVIRONMENT = {
  address: "WEIGHTSERVER_ADDRESS",
  token: "WEIGHTSERVER_TOKEN",
  tlsCa: "WEIGHTSERVER_TLS_CA",
  tlsCert: "WEIGHTSERVER_TLS_CERT",
  tlsKey: "WEIGHTSERVER_TLS_KEY",
};
/** The address when neither the caller nor $WEIGHTSERVER_ADDRESS gives one. */
export const DEFAULT_ADDRESS = "localhost:50051";

/** An error from the server: `code` is the gRPC status code, `errorName` the server's
 * "weightserver-error" trailer (e.g. "VersionEvicted") when it sent one. Also used for
 * failed size / sha256 checks (code DATA_LOSS, errorName "ChecksumMismatch"). */
export class WeightServerError extends Error {
  constructor(message, { code = grpc.status.UNKNOWN, errorName = null, details = null, cause } = {}) {
    super(message, cause === undefined ? undefined : { cause });
    this.name = "WeightServerError";
    this.code = code;
    this.codeName = Object.keys(grpc.status).find((k) => grpc.status[k] === code) ?? String(code);
    this.errorName = errorName;
    this.details = details;
  }
}

function wrapGrpcError(err) {
  if (err instanceof WeightServerError) return err;
  if (err == null || typeof err.code !== "number") return err;
  let errorName = null;
  if (err.metadata && typeof err.metadata.get === "function") {
    const values = err.metadata.get("weightserver-error");
    if (values.length > 0) errorName = String(values[0]);
  }
  const details = err.details ?? err.message;
  const message = `${err.method ?? "rpc"} failed: ${errorName ?? err.code} (${details})`;
  return new WeightServerError(message, { code: err.code, errorName, details, cause: err });
}

// --- safetensors ---------------------------------------------------------------------------

const TYPED_ARRAYS = {
  F64: Float64Array,
  F32: Float32Array,
  I64: BigInt64Array,
  U64: BigUint64Array,
  I32: Int32Array,
  U32: Uint32Array,
  I16: Int16Array,
  U16: Uint16Array,
  I8: Int8Array,
  U8: Uint8Array,
  BOOL: Uint8Array,
};

/** Parses a safetensors file. Returns `{ tensors, metadata }`: `tensors` maps each name to
 * `{ dtype, shape, data }` where `data` is a typed array (F64, F32, I64, U64, I32, U32, I16,
 * U16, I8, U8, BOOL as Uint8Array) over a fresh, aligned ArrayBuffer, or for other dtypes
 * (F16, BF16, F8_*) `{ dtype, shape, bytes }` with the raw little-endian bytes. */
export function parseSafetensors(buffer) {
  const bytes = buffer instanceof Uint8Array ? buffer : new Uint8Array(buffer);
  if (bytes.length < 8) throw new Error("safetensors: file shorter than its 8-byte header length");
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const headerLength = Number(view.getBigUint64(0, true));
  if (8 + headerLength > bytes.length) throw new Error("safetensors: header runs past the end of the file");
  const header = JSON.parse(Buffer.from(bytes.buffer, bytes.byteOffset + 8, headerLength).toString("utf8"));
  const dataStart = 8 + headerLength;
  const tensors = {};
  let metadata = {};
  for (const [name, entry] of Object.entries(header)) {
    if (name === "__metadata__") {
      metadata = entry ?? {};
      continue;
    }
    const [begin, end] = entry.data_offsets;
    if (begin > end || dataStart + end > bytes.length) throw new Error(`safetensors: tensor ${name} out of bounds`);
    // Copy into a fresh ArrayBuffer: the tensor's offset in the file need not be aligned.
    const copy = new Uint8Array(end - begin);
    copy.set(bytes.subarray(dataStart + begin, dataStart + end));
    const shape = entry.shape.map(Number);
    const TypedArray = TYPED_ARRAYS[entry.dtype];
    if (TypedArray) {
      if (copy.byteLength % TypedArray.BYTES_PER_ELEMENT !== 0) {
        throw new Error(`safetensors: tensor ${name} has ${copy.byteLength} bytes, not a multiple of ${entry.dtype}`);
      }
      tensors[name] = { dtype: entry.dtype, shape, data: new TypedArray(copy.buffer) };
    } else {
      tensors[name] = { dtype: entry.dtype, shape, bytes: copy };
    }
  }
  return { tensors, metadata };
}

// --- client --------------------------------------------------------------------------------

function readPem(value) {
  if (value == null) return null;
  if (Buffer.isBuffer(value)) return value;
  if (value instanceof Uint8Array) return Buffer.from(value);
  const text = String(value);
  return text.includes("-----BEGIN") ? Buffer.from(text) : readFileSync(text);
}

/** The value of an environment variable; undefined when it is unset or empty. */
function fromEnvironment(name) {
  const value = process.env[name];
  return value ? value : undefined;
}

/** Channel credentials: TLS when `tls` is true or an object, or when $WEIGHTSERVER_TLS_CA or
 * $WEIGHTSERVER_TLS_CERT is set; plaintext otherwise, and always for `tls: false`. Each of
 * ca, cert and key not given in `tls` comes from its environment variable. */
function channelCredentials(tls) {
  if (tls === false) return grpc.credentials.createInsecure();
  const given = tls !== null && typeof tls === "object" ? tls : {};
  const ca = given.ca ?? fromEnvironment(ENVIRONMENT.tlsCa);
  const cert = given.cert ?? fromEnvironment(ENVIRONMENT.tlsCert);
  const key = given.key ?? fromEnvironment(ENVIRONMENT.tlsKey);
  if ((cert == null) !== (key == null)) {
    throw new TypeError(
      `a client certificate needs its key and vice versa: give tls.cert and tls.key (or $${ENVIRONMENT.tlsCert} and $${ENVIRONMENT.tlsKey})`,
    );
  }
  if (tls == null && ca == null && cert == null) return grpc.credentials.createInsecure();
  return grpc.credentials.createSsl(readPem(ca), readPem(key), readPem(cert));
}

/** Converts a VersionInfo message into plain JS: numbers for versions and sizes. */
function versionInfo(message) {
  return {
    ...message,
    version: Number(message.version),
    byte_size: Number(message.byte_size),
    tensors: (message.tensors ?? []).map((t) => ({
      ...t,
      shape: t.shape.map(Number),
      data_begin: Number(t.data_begin),
      data_end: Number(t.data_end),
    })),
  };
}

export class WeightServerClient {
  /**
   * Options not given default to the environment, as in the Python client (what is given wins).
   * @param {string} [address] "host:port"; default $WEIGHTSERVER_ADDRESS, else localhost:50051
   * @param {object} [options]
   * @param {string} [options.token] bearer token, sent as "authorization: Bearer <token>";
   *   default $WEIGHTSERVER_TOKEN ("" sends none)
   * @param {string} [options.clientId] sent as "weightserver-client-id" metadata
   * @param {boolean|{ca?: Buffer|string, cert?: Buffer|string, key?: Buffer|string}} [options.tls]
   *   TLS (PEM contents or file paths; cert+key for mutual TLS; `true`: the system's roots);
   *   fields not given come from $WEIGHTSERVER_TLS_CA / _CERT / _KEY, and TLS is on when a CA or
   *   certificate is given either way; `false`: plaintext, whatever the environment says
   * @param {string} [options.protoPath] where weights.proto lives
   * @param {object} [options.channelOptions] extra grpc-js channel options
   */
  constructor(address, { token, clientId, tls, protoPath = DEFAULT_PROTO_PATH, channelOptions = {} } = {}) {
    const definition = protoLoader.loadSync(protoPath, LOADER_OPTIONS);
    const pkg = grpc.loadPackageDefinition(definition);
    const Service = pkg.weightserver.v1.WeightService;
    this.address = address || fromEnvironment(ENVIRONMENT.address) || DEFAULT_ADDRESS;
    this._stub = new Service(this.address, channelCredentials(tls), {
      "grpc.max_receive_message_length": 16 * 1024 * 1024,
      ...channelOptions,
    });
    this._token = token ?? fromEnvironment(ENVIRONMENT.token) ?? null;
    this._clientId = clientId ?? null;
  }

  _metadata() {
    const md = new grpc.Metadata();
    if (this._token) md.set("authorization", `Bearer ${this._token}`);
    if (this._clientId) md.set("weightserver-client-id", this._clientId);
    return md;
  }

  _callOptions(timeoutMs) {
    return timeoutMs ? { deadline: new Date(Date.now() + timeoutMs) } : {};
  }

  _unary(method, request, timeoutMs) {
    return new Promise((resolvePromise, reject) => {
      this._stub[method](request, this._metadata(), this._callOptions(timeoutMs), (err, reply) => {
        if (err) reject(wrapGrpcError(err));
        else resolvePromise(reply);
      });
    });
  }

  /** The newest version's description (GetLatest): `{ model, version, byte_size, sha256,
   * metadata, tensors, ... }`. Rejects with code NOT_FOUND if the model has no version. */
  async latest(model, { timeoutMs } = {}) {
    return versionInfo(await this._unary("GetLatest", { model }, timeoutMs));
  }

  /**
   * Fetches a version (latest by default) and parses its tensors.
   * Resolves to `{ version, metadata, tensors, info }`, or null when `newerThan` is given and
   * the server has nothing newer. Checks the byte count and sha256 against the header.
   */
  async fetch(model, { version, newerThan, timeoutMs } = {}) {
    if (version != null && newerThan != null) throw new TypeError("give at most one of version and newerThan");
    const request = { model };
    if (version != null) request.version = String(version);
    if (newerThan != null) request.newer_than = String(newerThan);
    const call = this._stub.Fetch(request, this._metadata(), this._callOptions(timeoutMs));
    let header = null;
    const chunks = [];
    let received = 0;
    try {
      for await (const message of call) {
        switch (message.kind) {
          case "up_to_date":
            return null;
          case "header":
            header = message.header;
            break;
          case "chunk":
            if (header === null) throw new WeightServerError("Fetch: chunk before header", { code: grpc.status.INTERNAL });
            chunks.push(message.chunk);
            received += message.chunk.length;
            break;
          case "payload":
            // Only sent when the request asked for a delta/cast/shm/bulk, which this client never does.
            throw new WeightServerError("Fetch: unexpected payload message", { code: grpc.status.INTERNAL });
          default:
            break;
        }
      }
    } catch (err) {
      call.cancel();
      throw wrapGrpcError(err);
    }
    if (header === null) throw new WeightServerError("Fetch: stream ended without a header", { code: grpc.status.INTERNAL });
    const info = versionInfo(header);
    if (received !== info.byte_size) {
      throw new WeightServerError(
        `Fetch ${model} v${info.version}: received ${received} bytes, header says ${info.byte_size}`,
        { code: grpc.status.DATA_LOSS, errorName: "SizeMismatch" },
      );
    }
    const data = Buffer.concat(chunks, received);
    const digest = createHash("sha256").update(data).digest("hex");
    if (digest !== info.sha256) {
      throw new WeightServerError(
        `Fetch ${model} v${info.version}: sha256 ${digest} does not match header ${info.sha256}`,
        { code: grpc.status.DATA_LOSS, errorName: "ChecksumMismatch" },
      );
    }
    const { tensors } = parseSafetensors(data);
    return { version: info.version, metadata: { ...info.metadata }, tensors, info };
  }

  /**
   * Watches for new versions: an async iterator of `{ version: VersionInfo, gap: boolean }`,
   * starting with the first version after `since` (0: the oldest retained). Never ends on its
   * own; `break` out of the `for await` loop (or call `return()`) to cancel the stream.
   */
  watch(model, { since = 0, timeoutMs } = {}) {
    const call = this._stub.Watch({ model, since: String(since) }, this._metadata(), this._callOptions(timeoutMs));
    const iterator = call[Symbol.asyncIterator]();
    let done = false;
    const finish = () => {
      if (!done) {
        done = true;
        call.cancel();
      }
    };
    return {
      [Symbol.asyncIterator]() {
        return this;
      },
      async next() {
        if (done) return { done: true, value: undefined };
        try {
          const { value, done: ended } = await iterator.next();
          if (ended) {
            done = true;
            return { done: true, value: undefined };
          }
          return { done: false, value: { version: versionInfo(value.version), gap: Boolean(value.gap) } };
        } catch (err) {
          if (done && err?.code === grpc.status.CANCELLED) return { done: true, value: undefined };
          finish();
          throw wrapGrpcError(err);
        }
      },
      async return() {
        finish();
        return { done: true, value: undefined };
      },
      cancel: finish,
    };
  }

  /** Closes the channel. */
  close() {
    this._stub.close();
  }
}

export default WeightServerClient;
