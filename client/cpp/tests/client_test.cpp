// ctest executable: checks the C++ client against a live server.
// Env: WEIGHTSERVER_ADDRESS (host:port), WEIGHTSERVER_EXPECTED_JSON (path of a file written by
// tests/test_cpp_client.py). argv[1]: path of the weightserver-fetch CLI.
#include <cstdio>
#include <cstdlib>
#include <fstream>
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

int main(int argc, char** argv) {
  const char* address = std::getenv("WEIGHTSERVER_ADDRESS");
  const char* expected_path = std::getenv("WEIGHTSERVER_EXPECTED_JSON");
  if (!address || !expected_path) {
    std::cerr << "set WEIGHTSERVER_ADDRESS and WEIGHTSERVER_EXPECTED_JSON\n";
    return 1;
  }
  std::ifstream ef(expected_path);
  nlohmann::json exp = nlohmann::json::parse(ef);
  const std::string model = exp.at("model");
  const uint64_t version = exp.at("version");
  try {
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

    // unknown model -> Error with NOT_FOUND (5)
    bool not_found = false;
    try {
      client.latest("no-such-model");
    } catch (const weightserver::Error& e) {
      not_found = e.code == 5;
    }
    CHECK(not_found);

    // CLI
    if (argc > 1) {
      std::string out = std::string(expected_path) + ".cli.safetensors";
      std::string cmd = std::string(argv[1]) + " --server " + address + " --model " + big + " -o " + out;
      CHECK(std::system(cmd.c_str()) == 0);
      std::ifstream f(out, std::ios::binary);
      std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      CHECK(weightserver::sha256_hex(bytes.data(), bytes.size()) == exp.at("big_sha256").get<std::string>());
      std::remove(out.c_str());
    }
  } catch (const std::exception& e) {
    std::cerr << "unexpected exception: " << e.what() << "\n";
    return 1;
  }
  if (failures) {
    std::cerr << failures << " check(s) failed\n";
    return 1;
  }
  std::cout << "all checks passed\n";
  return 0;
}
