// libFuzzer target: the safetensors reader (io::SafetensorsFile).
//
// Each input is written to a scratch file and opened with SafetensorsFile::open, the
// entry point checkpoints use (the reader maps files; it has no in-memory entry point).
// When the header is accepted, every tensor is read back through every conversion the
// reader offers for its dtype (float, double, bf16 for floating tensors; int64, int32
// for integer ones) and its raw bytes are touched, so the reading path is fuzzed too.
//
// Contract: open and read either succeed or throw tessera::Error. Any other exception,
// a crash, a leak, undefined behaviour or a timeout is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/io/safetensors.hpp"
#include "scratch_file.hpp"

namespace {

/// The file each input is written to.
const fuzz::ScratchFile& scratch() {
  static const fuzz::ScratchFile file("safetensors", ".safetensors");
  return file;
}

/// Folds values into a sink the optimiser cannot drop, so every element is really read.
volatile std::uint64_t sink;

template <class T>
void consume(const std::vector<T>& values) {
  std::uint64_t h = values.size();
  for (const T& v : values) {
    unsigned char bytes[sizeof(T)];
    std::memcpy(bytes, &v, sizeof(T));
    for (unsigned char b : bytes) h = h * 131 + b;
  }
  sink = sink + h;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace tessera::io;
  scratch().write(data, size);
  try {
    const SafetensorsFile file = SafetensorsFile::open(scratch().path());
    sink = sink + file.metadata().size();
    for (const TensorEntry& e : file.tensors()) {
      sink = sink + file.raw(e.name).size();
      // Each read may fail with tessera::Error on its own (an int64 that does not fit
      // int32); the others are still tried.
      auto attempt = [&](auto read) {
        try {
          read();
        } catch (const tessera::Error&) {
        }
      };
      if (is_floating(e.dtype)) {
        attempt([&] { consume(file.read_all<float>(e.name)); });
        attempt([&] { consume(file.read_all<double>(e.name)); });
        attempt([&] { consume(file.read_all<tessera::bf16>(e.name)); });
        // The wrong kind must be refused, never converted.
        attempt([&] {
          (void)file.read_all<std::int64_t>(e.name);
          std::fprintf(stderr, "fuzz_safetensors: floating tensor '%s' was read as int64\n", e.name.c_str());
          std::abort();
        });
      } else {
        attempt([&] { consume(file.read_all<std::int64_t>(e.name)); });
        attempt([&] { consume(file.read_all<std::int32_t>(e.name)); });
        attempt([&] {
          (void)file.read_all<float>(e.name);
          std::fprintf(stderr, "fuzz_safetensors: integer tensor '%s' was read as float\n", e.name.c_str());
          std::abort();
        });
      }
    }
    // A name that is not there is an error, not a crash.
    const char* absent = "\x01 not a tensor name";
    if (!file.contains(absent)) {
      try {
        (void)file.entry(absent);
        std::abort();
      } catch (const tessera::Error&) {
      }
    }
  } catch (const tessera::Error&) {
    // Refused with a message: the expected outcome for most inputs.
  }
  return 0;
}
