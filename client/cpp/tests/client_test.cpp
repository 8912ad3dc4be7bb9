// ctest executable: checks the C++ client against live servers.
//   weightserver_client_test SECTION [CLI]
// SECTION: basic, environment, token, tls or mtls (one ctest case each); CLI: the path of the
// weightserver-fetch executable. Env: WEIGHTSERVER_ADDRESS (host:port of the plain server) and
// WEIGHTSERVER_EXPECTED_JSON (what was published where; its format is in client/cpp/README.md,
// and tests/system/test_cpp_client.py writes it). A section whose entry the file lacks fails.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

#include "weightserver/client.hpp"

static int failures = 0;
#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) {                                                               \
      std::cerr << __FILE__ << ":" << __LINE__ << ": CHECK failed: " #cond "\n"; \
      ++failures;                                                                \
    }                                                                            \
  } while (0)

static constexpr int kDeadlineExceeded = 4;
static constexpr int kNotFound = 5;
static constexpr int kUnavailable = 14;
static constexpr int kUnauthenticated = 16;

// The gRPC code `call` fails with (Error::code), or -1 when it does not fail.
static int code_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const weightserver::Error& e) {
    return e.code;
  }
  return -1;
}

// A failed handshake shows as UNAVAILABLE, or as DEADLINE_EXCEEDED where the peer waits.
static bool refused(int code) { return code == kUnavailable || code == kDeadlineExceeded; }

// Sets (or, for nullptr, unsets) an environment variable until the end of the scope.
class ScopedEnvironment {
 public:
  ScopedEnvironment(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnvironment() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1);
    else unsetenv(name_.c_str());
  }
  ScopedEnvironment(const ScopedEnvironment&) = delete;
  ScopedEnvironment& operator=(const ScopedEnvironment&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

// The sha256 of version `entry["version"]` of `entry["model"]` as `client` fetches it ("" on failure).
static std::string fetched_sha256(weightserver::Client& client, const nlohmann::json& entry) {
  auto v = client.fetch(entry.at("model").get<std::string>(), entry.at("version").get<uint64_t>());
  return v ? v->sha256 : "";
}

// Runs the CLI with `flags` (plus --model and -o) and checks the file it writes; its exit status
// (the CLI has no deadline of its own: `timeout` ends one that hangs, with a failure).
static int run_cli(const std::string& cli, const nlohmann::json& entry, const std::string& flags,
                   const std::string& out) {
  std::string cmd = "timeout 60 " + cli + " --model " + entry.at("model").get<std::string>() + " -o " + out + " " + flags +
                    " > /dev/null 2>&1";
  int status = std::system(cmd.c_str());
  if (status == 0) {
    std::ifstream f(out, std::ios::binary);
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    CHECK(weightserver::sha256_hex(bytes.data(), bytes.size()) == entry.at("sha256").get<std::string>());
  }
  std::remove(out.c_str());
  return status;
}

static void basic(const nlohmann::json& exp, const std::string& address, const std::string& cli,
                  const std::string& out) {
  const std::string model = exp.at("model");
  const uint64_t version = exp.at("version");
  weightserver::Client client(address);

  // latest()
  auto info = client.latest(model);
  CHECK(info.version == version);
  CHECK(info.sha256 == exp.at("sha256").get<std::string>());

  // fetch latest: values, metadata, digest
  auto v = client.fetch(model);
  CHECK(v.has_value());
  if (v) {
    CHECK(v->version == version);
    CHECK(v->sha256 == exp.at("sha256").get<std::string>());
    CHECK(v->metadata["step"] == exp.at("step").get<std::string>());
    const auto& w = v->tensors.at("w");
    CHECK(w.dtype == "F32");
    CHECK((w.shape == std::vector<uint64_t>{3, 4}));
    CHECK(w.as<float>() == exp.at("w").get<std::vector<float>>());
    const auto& steps = v->tensors.at("steps");
    CHECK(steps.dtype == "I64");
    CHECK(steps.as<int64_t>() == exp.at("steps").get<std::vector<int64_t>>());
    bool threw = false;
    try {
      (void)w.as<int64_t>();
    } catch (const weightserver::Error&) {
      threw = true;
    }
    CHECK(threw);
  }

  // exact version
  auto exact = client.fetch(model, version);
  CHECK(exact && exact->sha256 == exp.at("sha256").get<std::string>());

  // newer_than = latest -> nullopt
  CHECK(!client.fetch(model, 0, version).has_value());

  // multi-chunk model
  const std::string big = exp.at("big_model");
  auto b = client.fetch(big);
  CHECK(b.has_value());
  if (b) {
    CHECK(b->bytes.size() == exp.at("big_size").get<uint64_t>());
    CHECK(b->bytes.size() > 3u * 1024 * 1024);
    CHECK(b->sha256 == exp.at("big_sha256").get<std::string>());
    const auto& t = b->tensors.at("big");
    auto vals = t.as<float>();
    CHECK(vals.size() == exp.at("big_numel").get<size_t>());
    CHECK(!vals.empty() && vals.front() == 0.0f && vals.back() == static_cast<float>(vals.size() - 1));
  }

  // unknown model -> Error with NOT_FOUND
  CHECK(code_of([&] { client.latest("no-such-model"); }) == kNotFound);

  // CLI
  if (!cli.empty()) {
    nlohmann::json entry = {{"model", big}, {"sha256", exp.at("big_sha256")}};
    CHECK(run_cli(cli, entry, "--server " + address, out) == 0);
  }
}

// WEIGHTSERVER_ADDRESS (set by the harness to the plain server) is the default address.
static void environment(const nlohmann::json& exp, const std::string& address, const std::string& cli,
                        const std::string& out) {
  weightserver::Client from_environment;
  CHECK(from_environment.address() == address);
  CHECK(from_environment.latest(exp.at("model").get<std::string>()).version == exp.at("version").get<uint64_t>());
  weightserver::ClientOptions ignore;
  ignore.environment = false;
  CHECK(weightserver::Client("", ignore).address() == weightserver::kDefaultAddress);
  CHECK(weightserver::Client("localhost:1").address() == "localhost:1");  // given wins
  if (!cli.empty()) {
    nlohmann::json entry = {{"model", exp.at("model")}, {"sha256", exp.at("sha256")}};
    CHECK(run_cli(cli, entry, "", out) == 0);                        // --server from the environment
    CHECK(run_cli(cli, entry, "--server localhost:1", out) != 0);    // given wins
  }
}

// A server started with --auth-tokens: a reader token given, from a file, or from the environment.
static void token(const nlohmann::json& entry, const std::string& cli, const std::string& out) {
  const std::string address = entry.at("address"), secret = entry.at("token");
  const std::string model = entry.at("model"), sha256 = entry.at("sha256");
  weightserver::Client anonymous(address);
  CHECK(code_of([&] { anonymous.latest(model); }) == kUnauthenticated);
  weightserver::Client reader(address, {secret});
  CHECK(fetched_sha256(reader, entry) == sha256);
  {
    ScopedEnvironment env("WEIGHTSERVER_TOKEN", secret.c_str());
    weightserver::Client from_environment(address);
    CHECK(fetched_sha256(from_environment, entry) == sha256);
    weightserver::Client wrong(address, {"wrong-token-0123456789"});  // given wins
    CHECK(code_of([&] { wrong.latest(model); }) == kUnauthenticated);
    weightserver::ClientOptions ignore;
    ignore.environment = false;
    weightserver::Client ignoring(address, ignore);
    CHECK(code_of([&] { ignoring.latest(model); }) == kUnauthenticated);
    if (!cli.empty()) CHECK(run_cli(cli, entry, "--server " + address, out) == 0);
  }
  if (!cli.empty()) {
    const std::string token_file = out + ".token";
    std::ofstream(token_file) << secret << "\n";
    CHECK(run_cli(cli, entry, "--server " + address + " --token " + secret, out) == 0);
    CHECK(run_cli(cli, entry, "--server " + address + " --token-file " + token_file, out) == 0);
    CHECK(run_cli(cli, entry, "--server " + address, out) != 0);
    std::remove(token_file.c_str());
  }
}

// A TLS server (`mutual`: one that demands a client certificate from its CA).
static void tls(const nlohmann::json& entry, bool mutual, const std::string& cli, const std::string& out) {
  const std::string address = entry.at("address"), model = entry.at("model"), sha256 = entry.at("sha256");
  const std::string ca = entry.at("ca");
  const std::string server_and_ca = "--server " + address + " --tls-ca " + ca;
  weightserver::ClientOptions quick;
  quick.timeout_seconds = 5;

  weightserver::Client plaintext(address, quick);
  CHECK(refused(code_of([&] { plaintext.latest(model); })));
  weightserver::ClientOptions with_ca = quick;
  with_ca.root_certs_pem = weightserver::read_file(ca);  // a CA alone turns TLS on
  weightserver::Client server_checked(address, with_ca);
  if (!mutual) {
    CHECK(fetched_sha256(server_checked, entry) == sha256);
    ScopedEnvironment env("WEIGHTSERVER_TLS_CA", ca.c_str());
    weightserver::Client from_environment(address, quick);
    CHECK(fetched_sha256(from_environment, entry) == sha256);
    if (!cli.empty()) CHECK(run_cli(cli, entry, "--server " + address, out) == 0);
  } else {
    CHECK(refused(code_of([&] { server_checked.latest(model); })));  // no client certificate
  }
  if (!cli.empty()) {
    CHECK((run_cli(cli, entry, server_and_ca, out) == 0) == !mutual);
  }
  if (!mutual) return;

  const std::string cert = entry.at("cert"), key = entry.at("key");
  weightserver::ClientOptions with_certificate = with_ca;
  with_certificate.cert_chain_pem = weightserver::read_file(cert);
  with_certificate.private_key_pem = weightserver::read_file(key);
  weightserver::Client mutual_client(address, with_certificate);
  CHECK(fetched_sha256(mutual_client, entry) == sha256);
  weightserver::ClientOptions no_key = with_ca;
  no_key.cert_chain_pem = with_certificate.cert_chain_pem;
  CHECK(code_of([&] { weightserver::Client half(address, no_key); }) == 0);  // Error, not an RPC
  {
    ScopedEnvironment env_ca("WEIGHTSERVER_TLS_CA", ca.c_str());
    ScopedEnvironment env_cert("WEIGHTSERVER_TLS_CERT", cert.c_str());
    ScopedEnvironment env_key("WEIGHTSERVER_TLS_KEY", key.c_str());
    weightserver::Client from_environment(address, quick);
    CHECK(fetched_sha256(from_environment, entry) == sha256);
    weightserver::ClientOptions ignore = quick;
    ignore.environment = false;
    weightserver::Client ignoring(address, ignore);
    CHECK(refused(code_of([&] { ignoring.latest(model); })));
    if (!cli.empty()) CHECK(run_cli(cli, entry, "--server " + address, out) == 0);
  }
  if (!cli.empty())
    CHECK(run_cli(cli, entry, server_and_ca + " --tls-cert " + cert + " --tls-key " + key, out) == 0);
}

int main(int argc, char** argv) {
  const char* address = std::getenv("WEIGHTSERVER_ADDRESS");
  const char* expected_path = std::getenv("WEIGHTSERVER_EXPECTED_JSON");
  if (argc < 2 || !address || !expected_path) {
    std::cerr << "usage: weightserver_client_test basic|environment|token|tls|mtls [CLI]; "
                 "set WEIGHTSERVER_ADDRESS and WEIGHTSERVER_EXPECTED_JSON (see client/cpp/README.md)\n";
    return 1;
  }
  const std::string section = argv[1];
  const std::string cli = argc > 2 ? argv[2] : "";
  const std::string out = std::string(expected_path) + "." + section + ".safetensors";
  std::ifstream ef(expected_path);
  nlohmann::json exp = nlohmann::json::parse(ef);
  const std::string key = section == "basic" || section == "environment" ? "model" : section;
  if (!exp.contains(key)) {
    std::cerr << expected_path << " has no \"" << key << "\" entry, which section " << section
              << " needs (see client/cpp/README.md)\n";
    return 1;
  }
  try {
    if (section == "basic") basic(exp, address, cli, out);
    else if (section == "environment") environment(exp, address, cli, out);
    else if (section == "token") token(exp.at("token"), cli, out);
    else if (section == "tls") tls(exp.at("tls"), false, cli, out);
    else if (section == "mtls") tls(exp.at("mtls"), true, cli, out);
    else {
      std::cerr << "unknown section " << section << "\n";
      return 1;
    }
  } catch (const std::exception& e) {
    std::cerr << "unexpected exception: " << e.what() << "\n";
    return 1;
  }
  if (failures) {
    std::cerr << failures << " check(s) failed\n";
    return 1;
  }
  std::cout << section << ": all checks passed\n";
  return 0;
}
