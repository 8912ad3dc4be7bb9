// weightserver-fetch [--server HOST:PORT] --model M [--version N] [--token T | --token-file FILE]
//                    [--tls-ca PEM] [--tls-cert PEM --tls-key PEM] -o FILE
// The connection flags are the Python CLI's (`weightserver fetch`), with the same defaults from
// WEIGHTSERVER_ADDRESS, WEIGHTSERVER_TOKEN and WEIGHTSERVER_TLS_CA / _CERT / _KEY.
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

#include "weightserver/client.hpp"

static int usage() {
  std::cerr << "usage: weightserver-fetch [--server HOST:PORT] --model M [--version N]\n"
               "                          [--token T | --token-file FILE] [--tls-ca PEM]\n"
               "                          [--tls-cert PEM --tls-key PEM] -o FILE\n"
               "  --server      default: $WEIGHTSERVER_ADDRESS, else localhost:50051\n"
               "  --token       bearer token (default: $WEIGHTSERVER_TOKEN, if set)\n"
               "  --token-file  read the bearer token from this file\n"
               "  --tls-ca      connect with TLS, trusting this CA (default: $WEIGHTSERVER_TLS_CA;\n"
               "                plaintext if neither)\n"
               "  --tls-cert    client certificate, for mutual TLS (default: $WEIGHTSERVER_TLS_CERT)\n"
               "  --tls-key     private key of --tls-cert (default: $WEIGHTSERVER_TLS_KEY)\n";
  return 2;
}

// `text` without the whitespace around it (a token file ends with a newline).
static std::string trimmed(const std::string& text) {
  const char* space = " \t\r\n";
  size_t begin = text.find_first_not_of(space);
  if (begin == std::string::npos) return "";
  return text.substr(begin, text.find_last_not_of(space) - begin + 1);
}

int main(int argc, char** argv) {
  std::string server, model, output, token, token_file, tls_ca, tls_cert, tls_key;
  uint64_t version = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") return usage();
    std::string* target = nullptr;
    std::string version_text;
    if (a == "--server") target = &server;
    else if (a == "--model") target = &model;
    else if (a == "-o" || a == "--output") target = &output;
    else if (a == "--token") target = &token;
    else if (a == "--token-file") target = &token_file;
    else if (a == "--tls-ca") target = &tls_ca;
    else if (a == "--tls-cert") target = &tls_cert;
    else if (a == "--tls-key") target = &tls_key;
    else if (a == "--version") target = &version_text;
    else {
      std::cerr << "unknown argument: " << a << "\n";
      return usage();
    }
    if (i + 1 >= argc) return usage();
    *target = argv[++i];
    if (target == &version_text) version = std::strtoull(version_text.c_str(), nullptr, 10);
  }
  if (model.empty() || output.empty()) return usage();
  if (!token.empty() && !token_file.empty()) {
    std::cerr << "weightserver-fetch: give --token or --token-file, not both\n";
    return 2;
  }
  try {
    weightserver::ClientOptions opts;
    opts.token = token_file.empty() ? token : trimmed(weightserver::read_file(token_file));
    if (!tls_ca.empty()) opts.root_certs_pem = weightserver::read_file(tls_ca);
    if (!tls_cert.empty()) opts.cert_chain_pem = weightserver::read_file(tls_cert);
    if (!tls_key.empty()) opts.private_key_pem = weightserver::read_file(tls_key);
    weightserver::Client client(server, opts);
    auto v = client.fetch(model, version);
    if (!v) throw weightserver::Error("no version returned");
    std::ofstream f(output, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(v->bytes.data()), static_cast<std::streamsize>(v->bytes.size()));
    f.close();
    if (!f) throw weightserver::Error("cannot write " + output);
    std::cout << "version " << v->version << "\nsha256 " << v->sha256 << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "weightserver-fetch: " << e.what() << "\n";
    return 1;
  }
}
