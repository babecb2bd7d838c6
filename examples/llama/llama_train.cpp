// llama-train: trains a Llama model from a TOML config, torchtitan style.
//
//   llama-train --config examples/configs/debug_model.toml [--section.key value ...]
//   mpirun -np 4 llama-train --config ...            (four processes: CPU, or one GPU each)
//   torchrun --nproc-per-node 8 --no-python llama-train --config ...   (one process per GPU)
//   llama-train --thread-ranks 4 --config ...        (four ranks in one process)
//
// The ranks are laid out by [parallelism] (pipeline_parallel_degree x
// data_parallel_replicate_degree x data_parallel_shard_degree x tensor_parallel_degree,
// -1 taking what is left): FSDP, HSDP or DDP follows from the degrees, tensor
// parallelism splits each block over tensor_parallel_degree neighbouring ranks, pipeline
// parallelism cuts the model into stages run by pipeline_parallel_schedule over
// microbatches of pipeline_parallel_microbatch_size sequences, and
// [activation_checkpoint] picks the checkpoint mode. Rank 0 writes the files and the
// metrics; every rank reads its own slice of each global batch (the tensor-parallel and
// pipeline ranks of a slice read the same).
//
// Writes <dump_folder>/config.toml (the effective config), <dump_folder>/metrics.jsonl
// (one JSON object per step), <dump_folder>/model.safetensors (the final model) and,
// with [checkpoint] enable, <dump_folder>/<folder>/step-N/model.safetensors every
// `interval` steps; <dump_folder>/tokenizer.model when the tokenizer has a file; with
// checkpoint.last_save_in_hf, <dump_folder>/hf (a Hugging Face Llama directory); then
// prints text sampled from the trained model. checkpoint.initial_load_path may name a
// Hugging Face Llama directory to start from: its config.json then defines the model.
//
// training.device picks the backend: the CPU (fp32 arithmetic; bf16 parameter values
// with mixed_precision_param = "bfloat16"), or, in a build with CUDA, one GPU per
// process: nn::Transformer<bf16, Cuda> with mixed_precision_param = "bfloat16" (bf16
// activations and parameters, fp32 gradients and AdamW state), <float, Cuda> with
// "float32". "auto" takes the GPU when one is visible. Several processes on GPUs (torchrun,
// mpirun, srun) train one GPU each, comm::choose_device's (the local rank modulo the
// visible devices), over the NCCL engine: its id shared through a TcpStore at
// MASTER_ADDR:MASTER_PORT where those are set, else by MPI broadcast under mpirun;
// [comm] bounds the start and each collective (docs/running.md). The rank itself is
// train_run.hpp's run_rank, instantiated here for the CPU and in llama_train_cuda.cpp
// for CUDA. On the GPU, training.attention picks cuDNN's fused attention or
// tessera's own kernels (backend/cuda/attention_choice.hpp); the start-up line says which.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/comm/flight_recorder.hpp"
#include "tessera/comm/launch.hpp"
#include "tessera/comm/mesh.hpp"
#include "tessera/comm/thread.hpp"
#if TESSERA_WITH_MPI
#include "tessera/comm/mpi.hpp"
#endif
#include "tessera/backend/cuda/attention_choice.hpp"
#include "tessera/data/tokenizers.hpp"
#include "tessera/instances.hpp"
#include "tessera/io/tokenizer.hpp"
#include "tessera/plan/cpu.hpp"
#include "tessera/train/config.hpp"
#include "tessera/train/metrics.hpp"
#include "step_trace.hpp"
#include "train_run.hpp"
#if TESSERA_WITH_CUDA
#include "train_cuda.hpp"
#endif
#if TESSERA_WITH_NCCL
#include "tessera/backend/cuda/memory.hpp"
#include "tessera/comm/nccl.hpp"
#endif

using namespace tessera;
using llama_train::RunInputs;

namespace {

// Every choice is read at run time from the config, through the Plan.
using CpuModel = llama_train::DynamicModel<float, Cpu>;

/// comm.train_timeout_seconds, for the engines' waits.
std::chrono::milliseconds train_timeout(const train::JobConfig& c) {
  return std::chrono::seconds(c.comm.train_timeout_seconds);
}

#if TESSERA_WITH_NCCL
/// The world of a multi-process launch on GPUs: one NCCL rank per process on `device`.
/// The id goes through a TcpStore at MASTER_ADDR:MASTER_PORT when they are set
/// (torchrun; srun with them), else by MPI broadcast (mpirun, srun with MPI). The
/// collectives are ordered against the CUDA backend's compute stream on `device`.
comm::Communicator nccl_world(const comm::Launch& launch, int device, const train::JobConfig& c) {
  comm::NcclOptions options;
  options.init_timeout = std::chrono::seconds(c.comm.init_timeout_seconds);
  options.timeout = train_timeout(c);
  {
    const cuda::detail::DeviceScope on(device);
    options.compute = cuda::compute_stream();
  }
  options.share_device = c.comm.share_gpu;
  // The watchdog's failure (a collective past the timeout, NCCL's asynchronous error)
  // ends the process from its own thread: the flight recorder is written first.
  options.on_failure = [](const std::string& message) {
    comm::FlightRecorder::dump_all(message);
    std::fprintf(stderr, "\ntessera: error: %s\n", message.c_str());
    std::fflush(stderr);
    std::_Exit(1);
  };
  if (launch.has_master() || launch.kind == comm::LaunchKind::torchrun)
    return comm::Communicator(comm::nccl_from_torchrun(launch, options));
#if TESSERA_WITH_MPI
  // MPI checks the world size against the launch (mpi_world) and carries the id.
  comm::Communicator mpi = comm::mpi_world(launch);
  return comm::Communicator(comm::nccl_from_broadcast(
      launch.rank, launch.world_size, device,
      [&](std::span<std::uint8_t> id) { mpi.broadcast(id, 0); }, options));
#else
  fail("launch: ", comm::describe_rank(launch), " of ", launch.world_size, " (", comm::name_of(launch.launcher),
       "): the NCCL id needs MASTER_ADDR and MASTER_PORT (rank 0's host and a free port), or a build with MPI "
       "(install libopenmpi-dev and rebuild) to broadcast it");
#endif
}
#endif

void usage() {
  std::printf(
      "usage: llama-train [--thread-ranks N] [--sample-tokens N] [--config FILE.toml] [--section.key value ...]\n\n"
      "Trains a Llama model on the CPU or on GPUs (training.device). Every config key can be overridden\n"
      "on the command line. Under mpirun or srun every process is a rank; on GPUs (torchrun, mpirun, srun)\n"
      "each process trains one GPU over NCCL. --thread-ranks N runs N ranks in this process (on the CPU,\n"
      "or sharing one GPU). --sample-tokens N: the text sampled from the trained model at the end, N\n"
      "tokens (default 300; 0: none). With several ranks rank 0 samples on the CPU from a float32 copy\n"
      "of the whole model (4 bytes a parameter of host memory, a forward on the CPU a token); by default\n"
      "none is drawn from a copy over 8 GiB (a model over 2.1B parameters): llama-generate samples the\n"
      "saved model.\n\n%s",
      train::config_help().c_str());
}

/// Picks the ranks: mpirun/srun processes, --thread-ranks N in this process, or one.
int run(std::vector<std::string> args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      usage();
      return 0;
    }
  // `flag N` or `flag=N`, at most once, taken out of args: N from `least` to 9999, or
  // `fallback` where the flag is not given.
  const auto take_count = [&args](const std::string& flag, int least, int fallback, const char* what) {
    int count = -1;  // not given
    for (std::size_t i = 0; i < args.size();) {
      const bool joined = args[i].rfind(flag + "=", 0) == 0;
      if (args[i] != flag && !joined) {
        ++i;
        continue;
      }
      TESSERA_CHECK(count < 0, flag, ": given twice");
      const std::string v = joined ? args[i].substr(flag.size() + 1) : i + 1 < args.size() ? args[i + 1] : "";
      const bool number = !v.empty() && v.size() <= 4 && v.find_first_not_of("0123456789") == std::string::npos;
      TESSERA_CHECK(number && std::stoi(v) >= least, flag, " '", v, "': expected a number of ", what, " from ", least,
                    " to 9999");
      count = std::stoi(v);
      const std::size_t n = joined || i + 1 >= args.size() ? 1 : 2;
      args.erase(args.begin() + static_cast<std::ptrdiff_t>(i), args.begin() + static_cast<std::ptrdiff_t>(i + n));
    }
    return count < 0 ? fallback : count;
  };
  const int thread_ranks = take_count("--thread-ranks", 1, 1, "ranks");
  const int sample_tokens = take_count("--sample-tokens", 0, -1, "tokens");  // -1: the default
  train::JobConfig c = train::load_config("", args);
  train::check_supported(c);
  if (c.job.print_config) std::printf("%s\n", train::to_toml(c).c_str());
  const comm::Launch launch = comm::detect_launch();
  TESSERA_CHECK(thread_ranks == 1 || launch.world_size == 1, "--thread-ranks ", thread_ranks, " under ",
                launch.kind == comm::LaunchKind::mpi ? "an MPI" : "a torchrun-style", " launch of ",
                launch.world_size, " processes: use one or the other");

  const std::unique_ptr<io::Tokenizer> tok = data::make_tokenizer(c.model.tokenizer);
  RunInputs in;
  in.config = &c;
  in.sample_tokens = sample_tokens;
  in.config_toml = train::to_toml(c);
  in.tokenizer = tok.get();
  in.save_tokenizer_file = [&c](const std::string& path) { return data::save_tokenizer_file(c.model.tokenizer, path); };
  llama_train::checked_model_args(c, *tok);  // the inputs every rank reads, before the slow parts

  const std::string& device = c.training.device;
#if TESSERA_WITH_CUDA
  // A process of a multi-process launch takes its own GPU before anything touches one.
  int cuda_device = 0;
  if (device != "cpu" && launch.world_size > 1) {
    const int visible = llama_train::cuda_device_count();
    if (visible > 0) {
      cuda_device = comm::choose_device(launch, visible, c.comm.share_gpu);
      llama_train::use_cuda_device(cuda_device);
    }
  }
  const llama_train::CudaDeviceInfo gpu = device == "cpu" ? llama_train::CudaDeviceInfo{} : llama_train::cuda_device_info();
  TESSERA_CHECK(device != "cuda" || gpu.visible, "training.device = \"cuda\": no CUDA device is visible (", gpu.why,
                "); set training.device = \"cpu\" or \"auto\"");
  if (device == "cuda" || (device == "auto" && gpu.visible)) {
#if !TESSERA_WITH_NCCL
    TESSERA_CHECK(launch.world_size == 1, "training.device = cuda with ", launch.world_size,
                  " processes: this llama-train was built without NCCL, which training on several GPUs needs "
                  "(install NCCL beside the CUDA toolkit and rebuild); --thread-ranks N gives N virtual ranks "
                  "sharing one GPU");
#endif
    train::resolve_mixed_precision(c, true);
    const bool bf16_model = c.training.mixed_precision_param == "bfloat16";
    const double known = bf16_model ? gpu.peak_bf16 : gpu.peak_fp32;
    in.peak_flops = c.metrics.peak_tflops > 0 ? c.metrics.peak_tflops * 1e12 : known;
    char text[160];
    if (in.peak_flops > 0)
      std::snprintf(text, sizeof text, "peak %.1f TFLOP/s (%s)", in.peak_flops / 1e12,
                    c.metrics.peak_tflops > 0 ? "metrics.peak_tflops"
                                              : (bf16_model ? "dense bf16 of this GPU" : "fp32 of this GPU, no TF32"));
    else
      std::snprintf(text, sizeof text, "peak unknown for this GPU (set metrics.peak_tflops for MFU)");
    in.peak_text = text;
    const std::string memory = llama_train::setup_cuda_allocator(c);
    const std::string attention = llama_train::setup_cuda_attention(c);
    const bool shared = launch.world_size > 1 && c.comm.share_gpu;
    const std::string compute = (thread_ranks > 1 || shared ? "sharing one " : launch.world_size > 1 ? "each on one " : "on one ") +
                                gpu.name + " (sm_" +
                                std::to_string(gpu.cc_major) + std::to_string(gpu.cc_minor) + "), " +
                                (bf16_model ? "bf16 activations and parameters" : "float32") +
                                " | attention: " + attention + " | memory: " + memory +
                                (shared ? " | comm.share_gpu: NCCL over sockets on loopback, a host per rank "
                                          "(testing only: slow)"
                                        : "");
    in.compute_text = [compute] { return compute; };
    in.annotations = llama_train::nvtx_annotations();
    TESSERA_CHECK(!c.comm.check_nccl_semantics, "comm.check_nccl_semantics = true on a GPU: the check holds the CPU "
                  "engines to NCCL's rules (set training.device = \"cpu\"); GPU processes run NCCL itself, and "
                  "virtual ranks share one device, which NCCL refuses");
#if TESSERA_WITH_NCCL
    if (launch.world_size > 1) return llama_train::run_rank_cuda(nccl_world(launch, cuda_device, c), in);
#endif
    if (thread_ranks == 1) return llama_train::run_rank_cuda(comm::Communicator(), in);
    comm::ThreadOptions options;
    options.timeout = train_timeout(c);
    options.memory = llama_train::cuda_memory_access();
    comm::run_thread_ranks(thread_ranks, [&](comm::Communicator& world) { llama_train::run_rank_cuda(world, in); },
                           options);
    return 0;
  }
#else
  TESSERA_CHECK(device != "cuda",
                "training.device = \"cuda\": this llama-train was built without CUDA (install the CUDA toolkit, "
                "put nvcc on PATH and rebuild); set training.device = \"cpu\" or \"auto\"");
#endif
  train::resolve_mixed_precision(c, false);
  TESSERA_CHECK(!c.comm.share_gpu, "comm.share_gpu = true: this run is on the CPU, whose engines (thread ranks, "
                "MPI) share no device; the key is for NCCL processes on one GPU");
  // The CPU has one attention (backend/cpu/attention.hpp): training.attention = "cudnn"
  // is refused by name, "auto" and "tessera" change nothing.
  cuda::choose_attention(c.training.attention, cuda::AttentionFacts{}, {});
  comm::check_cpu_launch(launch);

  {
    // The peak for MFU: the fastest of the step's own GEMMs (traced on the dry-run
    // backend, one device's whole model) and a 1024^3 product, each the median of runs.
    char text[200];
    if (c.metrics.peak_tflops > 0) {
      in.peak_flops = c.metrics.peak_tflops * 1e12;
      std::snprintf(text, sizeof text, "peak %.1f GFLOP/s (metrics.peak_tflops, OpenBLAS %s kernels)",
                    in.peak_flops / 1e9, Cpu::blas_kernels());
    } else {
      plan::CpuProfile measured;
      const plan::StepTrace step = llama_train::sized_by(
          tessera::detail::concat("tracing a step for the MFU peak (a rank's batch: training.local_batch_size x "
                                  "training.seq_len = ", c.training.local_batch_size, " x ", c.training.seq_len, " tokens)"),
          [&] { return llama_plan::trace_step(llama_plan::on_one_device(c), false); });
      plan::measure_gemms(step.trace, 0.02, measured);
      in.peak_flops = measured.peak_gemm_flops;
      std::snprintf(text, sizeof text, "peak %.1f GFLOP/s (fastest of the step's %zu GEMM shapes, measured; OpenBLAS %s kernels)",
                    in.peak_flops / 1e9, measured.gemm_seconds.size(), Cpu::blas_kernels());
    }
    in.peak_text = text;
  }
  in.compute_text = [] {
    return std::to_string(Cpu::threads()) + " OpenMP thread" + (Cpu::threads() == 1 ? "" : "s") + " each";
  };
  if (launch.kind == comm::LaunchKind::mpi && launch.world_size > 1) {
#if TESSERA_WITH_MPI
    const comm::MemoryAccess memory = Cpu::memory_access();
    return llama_train::run_rank<CpuModel>(comm::mpi_world(launch, c.comm.check_nccl_semantics ? &memory : nullptr),
                                           in);
#else
    fail("started as rank ", launch.rank, " of ", launch.world_size,
         " by mpirun or srun, but this llama-train was built without MPI (install libopenmpi-dev and rebuild)");
#endif
  }
  if (thread_ranks == 1) return llama_train::run_rank<CpuModel>(comm::Communicator(), in);
  comm::ThreadOptions options;
  options.timeout = train_timeout(c);
  options.memory = Cpu::memory_access();
  options.nccl_rules = c.comm.check_nccl_semantics;
  comm::run_thread_ranks(thread_ranks, [&](comm::Communicator& world) { llama_train::run_rank<CpuModel>(world, in); },
                         options);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::exception& e) {
#if TESSERA_WITH_MPI
    // Under mpirun this ends every rank, so none waits for this one. (The launch is read
    // again: the error may be a bad launcher variable, which then reads as one process.)
    int processes = 1;
    try {
      processes = comm::detect_launch().world_size;
    } catch (const std::exception&) {
    }
    if (processes > 1) comm::mpi_abort_on_error(e, "\nllama-train: error");
#endif
    std::fprintf(stderr, "\nllama-train: error: %s\n", e.what());
    return 1;
  }
}
