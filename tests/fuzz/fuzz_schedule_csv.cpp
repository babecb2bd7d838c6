// libFuzzer target: the pipeline schedule reader (parallel::parse_schedule_csv, PyTorch's
// CSV of actions) and what runs an order it accepts.
//
// When the text parses, the order is written back (format_csv) and must read back to the
// same lists and placement, and it is lowered to transfers (lower) and held to NCCL's
// rules (check_program): the lowering is meant to be free of deadlocks for every order
// the reader accepts, not only for the named schedules, so this fuzzes that claim too.
//
// Contract: parsing either succeeds or throws tessera::Error; an accepted order writes
// back, lowers and checks without an error. Any other exception, a crash, a leak,
// undefined behaviour, a timeout, or a broken invariant above (reported on stderr, then
// abort) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>

#include "tessera/core/error.hpp"
#include "tessera/parallel/pipeline_program.hpp"
#include "tessera/parallel/schedule_csv.hpp"

namespace {

[[noreturn]] void finding(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_schedule_csv: %s: %s\n", what, detail.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace tessera::parallel;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  ScheduleTable table;
  try {
    table = parse_schedule_csv(text, "fuzz.csv");
  } catch (const tessera::Error&) {
    return 0;  // refused with a message: the contract
  }
  const Schedule& s = table.order;
  std::string written;
  try {
    written = format_csv(s);
    const ScheduleTable back = parse_schedule_csv(written, "written.csv");
    if (back.order.per_rank != s.per_rank || back.order.placement() != s.placement() ||
        back.order.stages_per_rank != s.stages_per_rank || back.order.microbatches != s.microbatches)
      finding("an accepted order does not read back to itself", written);
    check_program(lower(s));
  } catch (const tessera::Error& e) {
    finding(e.what(), written);
  }
  return 0;
}
