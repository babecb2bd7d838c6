// The GPU suite's main: exits 77 (Meson's skip) when no CUDA device is present, else
// runs every test case of the suite's files.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "ops_launchers.hpp"

int main(int argc, char** argv) {
  if (tessera::gpu_test::device_count() == 0) {
    std::printf("no CUDA device: GPU tests skipped\n");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
