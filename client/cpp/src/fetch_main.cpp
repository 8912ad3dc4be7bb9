// weightserver-fetch --server HOST:PORT --model M [--version N] [--token T] -o FILE
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

#include "weightserver/client.hpp"

static int usage() {
  std::cerr << "usage: weightserver-fetch --server HOST:PORT --model M [--version N] [--token T] -o FILE\n";
  return 2;
}

int main(int argc, char** argv) {
  std::string server, model, output, token;
  uint64_t version = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    const char* v = nullptr;
    if (a == "-h" || a == "--help") return usage();
    if (a == "--server" || a == "--model" || a == "--version" || a == "-o" || a == "--output" || a == "--token") {
      v = next();
      if (!v) return usage();
    } else {
      std::cerr << "unknown argument: " << a << "\n";
      return usage();
    }
    if (a == "--server") server = v;
    else if (a == "--model") model = v;
    else if (a == "--version") version = std::strtoull(v, nullptr, 10);
    else if (a == "--token") token = v;
    else output = v;
  }
  if (server.empty() || model.empty() || output.empty()) return usage();
  try {
    weightserver::ClientOptions opts;
    opts.token = token;
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
