// `kvferry bench`: transfer-engine throughput and batch latency between two processes.
//
// By default the initiator spawns its target (the hidden `bench-target` subcommand of this
// same binary) on loopback, sweeps block sizes x batch sizes, verifies the bytes after each
// configuration, prints a table and optionally writes JSON. `--serve` runs a target by hand
// and `--target HOST:PORT` points an initiator at it, so the two sides can be two machines.
// Comparable tools: Mooncake's transfer_engine_bench, NVIDIA's nixlbench.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/auth.h"
#include "common/env.h"
#include "tools/bench_config.h"
#include "tools/bench_session.h"
#include "tools/bench_target.h"
#include "tools/commands.h"
#include "tools/gpu/baselines.h"
#include "tools/stats.h"

namespace kvferry::tools {

namespace {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
// The target allocates and touches its whole buffer before it reports (2 GiB takes about a
// second), so allow for a slow, loaded machine.
constexpr std::chrono::milliseconds kTargetStartupTimeout{60000};
// Untimed run before the sweep: opens every lane so the first configuration does not pay for
// connection setup.
constexpr double kWarmupSeconds = 0.2;

// Effective lanes and slice size of the transport the route names (UCX's, else TCP's): what
// the engine will use after environment overrides (TransferEngine::Create lets
// KVFERRY_TCP_LANES / KVFERRY_TCP_SLICE, or KVFERRY_UCX_LANES / KVFERRY_UCX_SLICE, win over
// options).
struct EffectiveTcp {
  int lanes = EngineOptions().tcp_lanes_per_peer;
  uint64_t slice_bytes = EngineOptions().tcp_slice_bytes;
};

EffectiveTcp ResolveTcp(const BenchPlan& plan, const std::string& route) {
  const bool ucx = route.rfind("ucx", 0) == 0;
  EffectiveTcp tcp;
  if (ucx) {
    tcp.lanes = EngineOptions().ucx_lanes_per_peer;
    tcp.slice_bytes = EngineOptions().ucx_slice_bytes;
  }
  if (plan.lanes) tcp.lanes = *plan.lanes;
  StatusOr<EnvConfig> env = ReadEnvConfig();  // already validated by the CLI
  if (!env.ok()) return tcp;
  const std::optional<int> env_lanes = ucx ? env->ucx_lanes : env->tcp_lanes;
  const std::optional<uint64_t> env_slice = ucx ? env->ucx_slice_bytes : env->tcp_slice_bytes;
  if (env_lanes) {
    if (plan.lanes && *plan.lanes != *env_lanes) {
      std::fprintf(stderr, "kvferry bench: KVFERRY_%s_LANES=%d overrides --lanes %d\n",
                   ucx ? "UCX" : "TCP", *env_lanes, *plan.lanes);
    }
    tcp.lanes = *env_lanes;
  }
  if (env_slice) tcp.slice_bytes = *env_slice;
  return tcp;
}

std::string Hostname() {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  return host;
}

std::string UtcNow() {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

std::string FormatLatencyUs(double us) {
  return us >= 100 ? fmt::format("{:.0f}", us) : fmt::format("{:.1f}", us);
}

// What CUDA itself achieves between the two GPUs, measured in the same run.
struct GpuBaseline {
  std::string what;  // "cudaMemcpyPeer" or "cudaMemcpyBatchAsync"
  uint64_t block_bytes = 0;
  size_t count = 1;
  double gbps = 0;
};

std::vector<GpuBaseline> MeasureGpuBaselines(const BenchPlan& plan) {
  std::vector<GpuBaseline> out;
  const int src = plan.op == TransferOp::kWrite ? plan.local_gpu : plan.target_gpu;
  const int dst = plan.op == TransferOp::kWrite ? plan.target_gpu : plan.local_gpu;
  std::vector<std::vector<std::string>> rows = {{"baseline", "block", "count", "GB/s"}};
  auto peer = cuda::MeasureMemcpyPeer(src, dst, 1ull << 30, 10);
  if (peer.ok()) {
    out.push_back({"cudaMemcpyPeer", 1ull << 30, 1, *peer});
  } else {
    std::fprintf(stderr, "kvferry bench: cudaMemcpyPeer baseline: %s\n",
                 peer.status().ToString().c_str());
  }
  for (uint64_t block : plan.block_sizes_bytes) {
    for (size_t batch : plan.batch_sizes) {
      // The same blocks the engine moved; never less than 64 MiB in flight per copy call.
      size_t count = std::max<size_t>(batch, static_cast<size_t>((64ull << 20) / block));
      count = std::min<size_t>(count, static_cast<size_t>((4ull << 30) / block));
      auto b = cuda::MeasureMemcpyBatch(src, dst, block,
                                        static_cast<int>(std::max<size_t>(1, count)), 5);
      if (b.ok()) {
        out.push_back({"cudaMemcpyBatchAsync", block, count, *b});
      } else {
        std::fprintf(stderr, "kvferry bench: cudaMemcpyBatchAsync baseline (%s): %s\n",
                     FormatBytes(block).c_str(), b.status().ToString().c_str());
      }
    }
  }
  for (const auto& b : out) {
    char gbps[32];
    std::snprintf(gbps, sizeof(gbps), "%.2f", b.gbps);
    rows.push_back({b.what, FormatBytes(b.block_bytes), std::to_string(b.count), gbps});
  }
  std::printf("\nCUDA baselines, GPU %d -> GPU %d, same run:\n%s", src, dst,
              RenderTable(rows).c_str());
  return out;
}

std::string RenderResults(const std::vector<BenchConfigResult>& results) {
  std::vector<std::vector<std::string>> rows = {{"block", "batch", "threads", "seconds", "GB/s",
                                                 "p50 us", "p99 us", "submit ns/req",
                                                 "CPU ns/req"}};
  for (const BenchConfigResult& r : results) {
    rows.push_back({FormatBytes(r.block_bytes), std::to_string(r.batch_size),
                    std::to_string(r.num_threads), fmt::format("{:.2f}", r.seconds),
                    fmt::format("{:.3f}", r.gbps), FormatLatencyUs(r.latency_p50_us),
                    FormatLatencyUs(r.latency_p99_us),
                    fmt::format("{:.0f}", r.host_ns_per_request_submit),
                    fmt::format("{:.0f}", r.host_ns_per_request_submitting_cpu +
                                              r.host_ns_per_request_other_cpu)});
  }
  return RenderTable(rows);
}

Status WriteJson(const std::string& path, const BenchPlan& plan, const EffectiveTcp& tcp,
                 const std::string& route, const std::vector<BenchConfigResult>& results,
                 const std::vector<GpuBaseline>& baselines) {
  nlohmann::ordered_json configs = nlohmann::ordered_json::array();
  for (const BenchConfigResult& r : results) {
    configs.push_back({{"block_size", r.block_bytes},
                       {"batch_size", r.batch_size},
                       {"threads", r.num_threads},
                       {"seconds", r.seconds},
                       {"bytes", r.bytes},
                       {"batches", r.num_batches},
                       {"gbps", r.gbps},
                       {"latency_us", {{"p50", r.latency_p50_us}, {"p99", r.latency_p99_us}}},
                       {"verified", true},
                       {"host_ns_per_request",
                        {{"submit", r.host_ns_per_request_submit},
                         {"submitting_threads_cpu", r.host_ns_per_request_submitting_cpu},
                         {"other_threads_cpu", r.host_ns_per_request_other_cpu}}}});
  }
  nlohmann::ordered_json ceilings = nlohmann::ordered_json::array();
  for (const GpuBaseline& b : baselines) {
    ceilings.push_back(
        {{"what", b.what}, {"block_size", b.block_bytes}, {"count", b.count}, {"gbps", b.gbps}});
  }
  nlohmann::ordered_json doc = {
      {"device", plan.device},
      {"transport", plan.transport},
      {"route", route},
      {"op", plan.op == TransferOp::kWrite ? "write" : "read"},
      {"threads", plan.num_threads},
      {"inflight", plan.inflight},
      {"lanes", tcp.lanes},
      {"slice_bytes", tcp.slice_bytes},
      {"duration_s", plan.duration_s},
      {"configs", configs},
      {"baselines", ceilings},
      {"machine", {{"hostname", Hostname()}, {"nproc", std::thread::hardware_concurrency()}}},
      {"date", UtcNow()}};
  std::ofstream out(path);
  if (!out) return UnavailableError("--json: cannot open '" + path + "' for writing");
  out << doc.dump(2) << "\n";
  out.close();
  if (!out) return UnavailableError("--json: cannot write '" + path + "'");
  return OkStatus();
}

int Fail(const Status& status) {
  std::fprintf(stderr, "kvferry bench: %s\n", status.ToString().c_str());
  return kExitFailure;
}

int RunBench(const BenchFlags& flags) {
  StatusOr<BenchPlan> plan_or = MakeBenchPlan(flags);
  if (!plan_or.ok()) {
    std::fprintf(stderr, "kvferry bench: %s\n", plan_or.status().message().c_str());
    return kExitUsage;
  }
  BenchPlan& plan = *plan_or;
  // The shared secret: the given one, else (no running target to match) a fresh one for the
  // target this run spawns.
  StatusOr<std::string> secret = ResolveAuthFlags(flags.auth);
  if (secret.ok() && secret->empty() && !plan.serve && plan.target_address.empty()) {
    secret = GenerateAuthSecret();
  }
  if (!secret.ok()) {
    std::fprintf(stderr, "kvferry bench: %s\n", secret.status().message().c_str());
    return kExitUsage;
  }
  plan.auth_secret = *secret;
  TargetOptions target_options;
  target_options.auth_secret = plan.auth_secret;
  target_options.insecure = plan.insecure;
  target_options.transport = plan.transport;
  target_options.buffer_bytes = plan.buffer_bytes;
  target_options.device = plan.device;
  target_options.gpu = plan.target_gpu;
  if (plan.serve) {
    target_options.listen_host = plan.listen_host;
    target_options.listen_port = plan.listen_port;
    target_options.until_stdin_closes = false;
    return RunBenchTarget(target_options);
  }

  // Spawn first: the engine's threads do not exist yet.
  std::unique_ptr<TargetProcess> target;
  std::string address = plan.target_address;
  if (address.empty()) {
    target_options.until_stdin_closes = true;
    StatusOr<std::unique_ptr<TargetProcess>> spawned =
        TargetProcess::Spawn(target_options, kTargetStartupTimeout);
    if (!spawned.ok()) return Fail(spawned.status());
    target = std::move(*spawned);
    address = target->info().address;
  }
  StatusOr<std::unique_ptr<BenchSession>> session =
      BenchSession::Open(plan, address, target ? &target->info() : nullptr);
  if (!session.ok()) return Fail(session.status());
  const EffectiveTcp tcp = ResolveTcp(plan, (*session)->route());

  std::printf(
      "kvferry bench: %s, transport %s (route: %s), %d threads x %d batches in flight, %d "
      "lanes, slice %s, buffer %s, target %s%s, %.2f s per configuration\n",
      plan.op == TransferOp::kWrite ? "WRITE" : "READ", plan.transport.c_str(),
      (*session)->route().c_str(), plan.num_threads, plan.inflight, tcp.lanes,
      FormatBytes(tcp.slice_bytes).c_str(), FormatBytes((*session)->buffer_bytes()).c_str(),
      address.c_str(), target ? " (spawned)" : "", plan.duration_s);
  std::fflush(stdout);

  StatusOr<BenchConfigResult> warmup =
      (*session)->Run(plan.block_sizes_bytes.front(), plan.batch_sizes.front(),
                      std::min(kWarmupSeconds, plan.duration_s));
  if (!warmup.ok()) return Fail(warmup.status().WithContext("warm-up"));

  std::vector<BenchConfigResult> results;
  for (uint64_t block_bytes : plan.block_sizes_bytes) {
    for (size_t batch_size : plan.batch_sizes) {
      StatusOr<BenchConfigResult> result =
          (*session)->Run(block_bytes, batch_size, plan.duration_s);
      if (!result.ok()) return Fail(result.status());
      if (Status verified = (*session)->Verify(block_bytes, batch_size); !verified.ok()) {
        return Fail(verified);
      }
      std::fprintf(stderr, "  %s x %zu: %.3f GB/s, batch p50 %s us, p99 %s us (verified)\n",
                   FormatBytes(block_bytes).c_str(), batch_size, result->gbps,
                   FormatLatencyUs(result->latency_p50_us).c_str(),
                   FormatLatencyUs(result->latency_p99_us).c_str());
      results.push_back(*result);
    }
  }
  const std::string route = (*session)->route();
  session->reset();  // close connections before the target goes away
  if (target != nullptr) {
    if (Status stopped = target->Stop(); !stopped.ok()) {
      std::fprintf(stderr, "kvferry bench: warning: %s\n", stopped.ToString().c_str());
    }
  }

  std::printf("%s", RenderResults(results).c_str());
  std::vector<GpuBaseline> baselines;
  if (plan.device == "cuda") baselines = MeasureGpuBaselines(plan);
  std::fflush(stdout);
  if (!plan.json_path.empty()) {
    if (Status written = WriteJson(plan.json_path, plan, tcp, route, results, baselines);
        !written.ok()) {
      return Fail(written);
    }
  }
  return 0;
}

}  // namespace

void AddBenchCommand(CLI::App& app, RunFn* run) {
  auto flags = std::make_shared<BenchFlags>();
  CLI::App* cmd = app.add_subcommand(
      "bench", "Transfer-engine benchmark between two processes (throughput, batch latency)");
  cmd->add_option("--device", flags->device,
                  "cpu, or cuda: buffers in GPU memory (initiator GPU 0, target GPU 1); also "
                  "measures cudaMemcpyPeer and cudaMemcpyBatchAsync in the same run")
      ->capture_default_str();
  cmd->add_option("--transport", flags->transport, "Transport: auto, tcp, ucx or nvlink")
      ->capture_default_str();
  cmd->add_option("--op", flags->op, "write or read")->capture_default_str();
  cmd->add_option("--block-size", flags->block_sizes,
                  "Comma list of request sizes (KiB/MiB/GiB suffixes)")
      ->capture_default_str();
  cmd->add_option("--batch-size", flags->batch_sizes, "Comma list of requests per batch")
      ->capture_default_str();
  cmd->add_option("--threads", flags->threads, "Submitting threads")->capture_default_str();
  cmd->add_option("--inflight", flags->inflight,
                  "Batches each thread keeps in flight (waits for the oldest when full), 1..64")
      ->capture_default_str();
  cmd->add_option("--duration", flags->duration_s, "Seconds per configuration (fractions allowed)")
      ->capture_default_str();
  cmd->add_option(
      "--lanes", flags->lanes,
      "lanes per peer (TCP connections, UCX workers); default: the engine's (half the CPUs, 4..8)");
  cmd->add_option("--buffer-size", flags->buffer_size,
                  "Bytes of each side's buffer; default threads x batch x block, at most 2 GiB");
  cmd->add_option("--json", flags->json_path, "Also write results as JSON to this file");
  cmd->add_option("--target", flags->target,
                  "HOST:PORT of a running `kvferry bench --serve` instead of spawning one");
  cmd->add_flag("--serve", flags->serve,
                "Serve as a target (for --target elsewhere) until SIGINT/SIGTERM");
  cmd->add_option("--listen", flags->listen, "With --serve: HOST:PORT to listen on")
      ->capture_default_str();
  AddAuthFlags(cmd, &flags->auth);
  cmd->callback([run, flags] { *run = [flags] { return RunBench(*flags); }; });

  // Hidden: the target an initiator spawns. Serves until its stdin closes.
  auto target_flags = std::make_shared<BenchFlags>();
  CLI::App* hidden = app.add_subcommand("bench-target", "Target process of `kvferry bench`");
  hidden->group("");
  hidden->add_option("--transport", target_flags->transport);
  hidden->add_option("--listen", target_flags->listen);
  hidden->add_option("--buffer-size", target_flags->buffer_size)->required();
  hidden->add_option("--device", target_flags->device);
  auto target_gpu = std::make_shared<int>(0);
  hidden->add_option("--gpu", *target_gpu);
  hidden->callback([run, target_flags, target_gpu] {
    *run = [target_flags, target_gpu] {
      TargetOptions options;
      options.transport = target_flags->transport;
      options.device = target_flags->device;
      options.gpu = *target_gpu;
      options.until_stdin_closes = true;
      Status parsed = ParseFlagHostPort("--listen", target_flags->listen, &options.listen_host,
                                        &options.listen_port);
      StatusOr<uint64_t> size = ParseByteSize(target_flags->buffer_size);
      if (!parsed.ok() || !size.ok() || *size == 0 || *target_gpu < 0) {
        std::fprintf(stderr, "kvferry bench-target: bad --listen, --buffer-size or --gpu\n");
        return kExitUsage;
      }
      options.buffer_bytes = *size;
      return RunBenchTarget(options);
    };
  });
}

}  // namespace kvferry::tools
