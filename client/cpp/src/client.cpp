#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "weightserver/client.hpp"
#include "weightserver/v1/weights.grpc.pb.h"

namespace weightserver {

namespace pb = ::weightserver::v1;

struct Client::Impl {
  std::string address;
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::WeightService::Stub> stub;

  void prepare(grpc::ClientContext& ctx) const {
    if (!options.token.empty()) ctx.AddMetadata("authorization", "Bearer " + options.token);
    if (options.timeout_seconds > 0)
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(static_cast<int64_t>(options.timeout_seconds * 1000)));
  }
};

static Error rpc_error(const char* what, const grpc::Status& s) {
  return Error(std::string(what) + " failed: " + s.error_message() + " (code " +
                   std::to_string(static_cast<int>(s.error_code())) + ")",
               static_cast<int>(s.error_code()));
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f.is_open()) throw Error("cannot read " + path);
  std::ostringstream contents;
  contents << f.rdbuf();
  if (f.bad()) throw Error("cannot read " + path);
  return contents.str();
}

// The value of an environment variable; "" when it is unset.
static std::string environment_variable(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

// Fills `field`, when empty, with the contents of the file $`name` names, if set.
static void pem_from_environment(std::string& field, const char* name) {
  std::string path = environment_variable(name);
  if (!field.empty() || path.empty()) return;
  try {
    field = read_file(path);
  } catch (const Error&) {
    throw Error(std::string("cannot read $") + name + " (" + path + ")");
  }
}

Client::Client(const std::string& address, ClientOptions options) : impl_(new Impl) {
  ClientOptions& o = impl_->options = std::move(options);
  impl_->address = address;
  if (o.environment) {
    if (impl_->address.empty()) impl_->address = environment_variable("WEIGHTSERVER_ADDRESS");
    if (o.token.empty()) o.token = environment_variable("WEIGHTSERVER_TOKEN");
    pem_from_environment(o.root_certs_pem, "WEIGHTSERVER_TLS_CA");
    pem_from_environment(o.cert_chain_pem, "WEIGHTSERVER_TLS_CERT");
    pem_from_environment(o.private_key_pem, "WEIGHTSERVER_TLS_KEY");
  }
  if (impl_->address.empty()) impl_->address = kDefaultAddress;
  if (o.cert_chain_pem.empty() != o.private_key_pem.empty())
    throw Error("a client certificate needs its key and vice versa (cert_chain_pem and private_key_pem)");
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (o.tls || !o.root_certs_pem.empty() || !o.cert_chain_pem.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = o.root_certs_pem;
    ssl.pem_cert_chain = o.cert_chain_pem;
    ssl.pem_private_key = o.private_key_pem;
    creds = grpc::SslCredentials(ssl);
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 * 1024 * 1024);
  impl_->channel = grpc::CreateCustomChannel(impl_->address, creds, args);
  impl_->stub = pb::WeightService::NewStub(impl_->channel);
}

Client::~Client() = default;

const std::string& Client::address() const { return impl_->address; }

VersionInfo Client::latest(const std::string& model) {
  grpc::ClientContext ctx;
  impl_->prepare(ctx);
  pb::GetLatestRequest req;
  req.set_model(model);
  pb::VersionInfo reply;
  grpc::Status s = impl_->stub->GetLatest(&ctx, req, &reply);
  if (!s.ok()) throw rpc_error("GetLatest", s);
  VersionInfo info;
  info.model = reply.model();
  info.version = reply.version();
  info.byte_size = reply.byte_size();
  info.sha256 = reply.sha256();
  for (const auto& [k, v] : reply.metadata()) info.metadata[k] = v;
  return info;
}

std::optional<Version> Client::fetch(const std::string& model, uint64_t version, uint64_t newer_than) {
  grpc::ClientContext ctx;
  impl_->prepare(ctx);
  pb::FetchRequest req;
  req.set_model(model);
  if (version != 0 && newer_than != 0) throw Error("fetch: set at most one of version and newer_than");
  if (version != 0) req.set_version(version);
  if (newer_than != 0) req.set_newer_than(newer_than);

  auto reader = impl_->stub->Fetch(&ctx, req);
  pb::FetchResponse msg;
  bool have_header = false, up_to_date = false;
  pb::VersionInfo header;
  Version out;
  while (reader->Read(&msg)) {
    switch (msg.kind_case()) {
      case pb::FetchResponse::kHeader:
        if (have_header) throw Error("fetch: second header in stream");
        header = msg.header();
        have_header = true;
        out.bytes.reserve(static_cast<size_t>(header.byte_size()));
        break;
      case pb::FetchResponse::kChunk:
        if (!have_header) throw Error("fetch: chunk before header");
        out.bytes.insert(out.bytes.end(), msg.chunk().begin(), msg.chunk().end());
        if (out.bytes.size() > header.byte_size()) throw Error("fetch: more bytes than the header announced");
        break;
      case pb::FetchResponse::kUpToDate:
        up_to_date = true;
        break;
      case pb::FetchResponse::kPayload:
        throw Error("fetch: unexpected payload message (this client requests none)");
      default:
        break;
    }
  }
  grpc::Status s = reader->Finish();
  if (!s.ok()) throw rpc_error("Fetch", s);
  if (up_to_date) return std::nullopt;
  if (!have_header) throw Error("fetch: stream ended without a header");
  if (out.bytes.size() != header.byte_size())
    throw Error("fetch: got " + std::to_string(out.bytes.size()) + " bytes, header says " +
                std::to_string(header.byte_size()));
  std::string digest = sha256_hex(out.bytes.data(), out.bytes.size());
  if (digest != header.sha256()) throw Error("fetch: sha256 mismatch: got " + digest + ", expected " + header.sha256());
  out.model = header.model();
  out.version = header.version();
  out.sha256 = digest;
  for (const auto& [k, v] : header.metadata()) out.metadata[k] = v;
  out.tensors = parse_safetensors(out.bytes);
  return std::optional<Version>(std::move(out));
}

}  // namespace weightserver
