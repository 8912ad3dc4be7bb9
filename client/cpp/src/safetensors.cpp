#include <openssl/evp.h>

#include <nlohmann/json.hpp>

#include "weightserver/client.hpp"

namespace weightserver {

std::string sha256_hex(const uint8_t* data, size_t size) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  if (!ctx) throw Error("EVP_MD_CTX_new failed");
  bool ok = EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr) == 1 && EVP_DigestUpdate(ctx, data, size) == 1 &&
            EVP_DigestFinal_ex(ctx, md, &len) == 1;
  EVP_MD_CTX_free(ctx);
  if (!ok) throw Error("sha256 computation failed");
  static const char* hex = "0123456789abcdef";
  std::string out;
  out.reserve(len * 2);
  for (unsigned int i = 0; i < len; ++i) {
    out.push_back(hex[md[i] >> 4]);
    out.push_back(hex[md[i] & 0xf]);
  }
  return out;
}

static size_t dtype_size(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  throw Error("unknown safetensors dtype " + d);
}

std::map<std::string, Tensor> parse_safetensors(const std::vector<uint8_t>& bytes) {
  if (bytes.size() < 8) throw Error("safetensors: file shorter than 8 bytes");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n > bytes.size() - 8) throw Error("safetensors: header length out of bounds");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("safetensors: bad header JSON: ") + e.what());
  }
  if (!header.is_object()) throw Error("safetensors: header is not a JSON object");
  const uint8_t* data = bytes.data() + 8 + n;
  const uint64_t data_size = bytes.size() - 8 - n;
  std::map<std::string, Tensor> out;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    try {
      Tensor t;
      t.dtype = entry.at("dtype").get<std::string>();
      t.shape = entry.at("shape").get<std::vector<uint64_t>>();
      auto offs = entry.at("data_offsets").get<std::vector<uint64_t>>();
      if (offs.size() != 2 || offs[0] > offs[1] || offs[1] > data_size)
        throw Error("safetensors: tensor " + name + " has offsets out of bounds");
      t.data = data + offs[0];
      t.size = static_cast<size_t>(offs[1] - offs[0]);
      if (t.numel() * dtype_size(t.dtype) != t.size)
        throw Error("safetensors: tensor " + name + " shape does not match its byte length");
      out.emplace(name, std::move(t));
    } catch (const nlohmann::json::exception& e) {
      throw Error("safetensors: bad entry for " + name + ": " + e.what());
    }
  }
  return out;
}

}  // namespace weightserver
