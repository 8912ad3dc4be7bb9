// C++ client for the weightserver gRPC service (protos/weightserver/v1/weights.proto).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace weightserver {

// Raised on RPC failures, malformed safetensors data and digest/size mismatches.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what, int grpc_code = 0) : std::runtime_error(what), code(grpc_code) {}
  int code;  // grpc::StatusCode, 0 when not an RPC error
};

// Read-only view of one tensor inside a Version's bytes.
struct Tensor {
  std::string dtype;              // safetensors dtype name: F32, I64, ...
  std::vector<uint64_t> shape;    // empty for a 0-d tensor
  const uint8_t* data = nullptr;  // first byte (inside Version::bytes)
  size_t size = 0;                // byte length

  size_t numel() const {
    size_t n = 1;
    for (auto d : shape) n *= static_cast<size_t>(d);
    return n;
  }

  // Typed view of the elements; throws Error if T does not match dtype.
  // safetensors data is little-endian; this client assumes a little-endian host.
  template <typename T>
  std::vector<T> as() const {
    check_dtype<T>();
    std::vector<T> out(size / sizeof(T));
    if (size) std::memcpy(out.data(), data, size);
    return out;
  }

  // Zero-copy pointer to the elements (may be unaligned for T on exotic files; safetensors
  // writers align data so this is fine in practice). Throws Error if T does not match dtype.
  template <typename T>
  const T* ptr() const {
    check_dtype<T>();
    return reinterpret_cast<const T*>(data);
  }

 private:
  template <typename T>
  void check_dtype() const {
    const char* want = dtype_of<T>();
    if (dtype != want) throw Error("tensor has dtype " + dtype + ", not " + want);
  }
  template <typename T>
  static const char* dtype_of() {
    if constexpr (std::is_same_v<T, double>) return "F64";
    else if constexpr (std::is_same_v<T, float>) return "F32";
    else if constexpr (std::is_same_v<T, int64_t>) return "I64";
    else if constexpr (std::is_same_v<T, int32_t>) return "I32";
    else if constexpr (std::is_same_v<T, int16_t>) return "I16";
    else if constexpr (std::is_same_v<T, int8_t>) return "I8";
    else if constexpr (std::is_same_v<T, uint64_t>) return "U64";
    else if constexpr (std::is_same_v<T, uint32_t>) return "U32";
    else if constexpr (std::is_same_v<T, uint16_t>) return "U16";
    else if constexpr (std::is_same_v<T, uint8_t>) return "U8";
    else if constexpr (std::is_same_v<T, bool>) return "BOOL";
    else static_assert(sizeof(T) == 0, "unsupported element type");
  }
};

// One fetched, verified version.
struct Version {
  std::string model;
  uint64_t version = 0;
  std::map<std::string, std::string> metadata;
  std::string sha256;                    // lowercase hex, verified against bytes
  std::vector<uint8_t> bytes;            // the safetensors file
  std::map<std::string, Tensor> tensors; // views into `bytes`

  Version() = default;
  Version(const Version&) = delete;      // tensors point into bytes
  Version& operator=(const Version&) = delete;
  Version(Version&&) = default;          // vector move keeps the buffer
  Version& operator=(Version&&) = default;
};

// Description of a version without its bytes.
struct VersionInfo {
  std::string model;
  uint64_t version = 0;
  uint64_t byte_size = 0;
  std::string sha256;
  std::map<std::string, std::string> metadata;
};

// The server address when neither the caller nor $WEIGHTSERVER_ADDRESS gives one.
inline constexpr const char* kDefaultAddress = "localhost:50051";

// How a Client connects. Empty fields take their defaults from the environment when the
// client is made, as in the Python client (what is given wins): `token` from
// $WEIGHTSERVER_TOKEN, and the PEM fields from the files named by $WEIGHTSERVER_TLS_CA,
// $WEIGHTSERVER_TLS_CERT and $WEIGHTSERVER_TLS_KEY. `environment = false` ignores them all.
// TLS is on when `tls` is set or a CA or client certificate is there (given or from the
// environment); a client certificate needs its key and vice versa (Error otherwise).
struct ClientOptions {
  std::string token;            // sent as "authorization: Bearer <token>"
  bool tls = false;             // use TLS even with no CA or certificate (the system's roots)
  std::string root_certs_pem;   // PEM CA bundle for TLS ("" = system roots)
  double timeout_seconds = 0;   // per call deadline; 0 = none
  std::string cert_chain_pem;   // PEM client certificate, for servers that demand mutual TLS
  std::string private_key_pem;  // PEM private key of cert_chain_pem
  bool environment = true;      // fill empty fields (and an empty address) from WEIGHTSERVER_*
};

// The contents of a file, e.g. a PEM certificate; throws Error when it cannot be read.
std::string read_file(const std::string& path);

// Parses a safetensors file; tensor views point into `bytes`. Throws Error when malformed.
std::map<std::string, Tensor> parse_safetensors(const std::vector<uint8_t>& bytes);

// Lowercase hex sha256 of `size` bytes (OpenSSL EVP).
std::string sha256_hex(const uint8_t* data, size_t size);

class Client {
 public:
  // `address` "host:port"; "" = $WEIGHTSERVER_ADDRESS (unless options.environment is false),
  // else kDefaultAddress.
  explicit Client(const std::string& address = "", ClientOptions options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // The address the client connects to.
  const std::string& address() const;

  // Describes the newest version of `model`.
  VersionInfo latest(const std::string& model);

  // Fetches `version` (0: latest) of `model`; with newer_than > 0 returns nullopt when the
  // server has nothing newer. Verifies size and sha256; throws Error on mismatch.
  std::optional<Version> fetch(const std::string& model, uint64_t version = 0, uint64_t newer_than = 0);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightserver
