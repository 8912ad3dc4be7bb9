#include <grpcpp/grpcpp.h>

#include <chrono>
#include <fstream>
#include <sstream>

#include "weightserver/client.hpp"
#include "weightserver/v1/weights.grpc.pb.h"

namespace weightserver {

namespace pb = ::weightserver::v1;

struct Client::Impl {
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

Client::Client(const std::string& address, ClientOptions options) : impl_(new Impl) {
  impl_->options = std::move(options);
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (impl_->options.tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = impl_->options.root_certs_pem;
    creds = grpc::SslCredentials(ssl);
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 * 1024 * 1024);
  impl_->channel = grpc::CreateCustomChannel(address, creds, args);
  impl_->stub = pb::WeightService::NewStub(impl_->channel);
}

Client::~Client() = default;

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
