#include "tools/bench_session.h"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <latch>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "common/checks.h"
#include "common/env.h"
#include "cuda/device_ops.h"
#include "tools/stats.h"

namespace kvferry::tools {

namespace {

using Clock = std::chrono::steady_clock;

// splitmix64 (Steele, Lea, Flood: "Fast splittable pseudorandom number generators", 2014).
uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::string Hex(uint64_t value) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%llx", static_cast<unsigned long long>(value));
  return text;
}

// CPU time of the calling thread or the whole process (user + system), in nanoseconds.
int64_t CpuNs(clockid_t clock) {
  timespec ts{};
  ::clock_gettime(clock, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

std::string OpName(TransferOp op) { return op == TransferOp::kWrite ? "WRITE" : "READ"; }

std::string ConfigName(uint64_t block_bytes, size_t batch_size) {
  return "block size " + FormatBytes(block_bytes) + ", batch size " + std::to_string(batch_size);
}

}  // namespace

void FillBenchPattern(uint8_t* data, uint64_t length, uint64_t seed) {
  uint64_t i = 0;
  for (; i + 8 <= length; i += 8) {
    uint64_t word = SplitMix64(seed + i / 8);
    std::memcpy(data + i, &word, 8);
  }
  if (i < length) {
    uint64_t word = SplitMix64(seed + i / 8);
    std::memcpy(data + i, &word, length - i);
  }
}

uint64_t FindBenchPatternMismatch(const uint8_t* data, uint64_t length, uint64_t seed) {
  for (uint64_t i = 0; i < length; i += 8) {
    uint64_t word = SplitMix64(seed + i / 8);
    uint64_t n = std::min<uint64_t>(8, length - i);
    if (std::memcmp(data + i, &word, n) != 0) {
      const auto* want = reinterpret_cast<const uint8_t*>(&word);
      for (uint64_t k = 0; k < n; ++k) {
        if (data[i + k] != want[k]) return i + k;
      }
    }
  }
  return length;
}

StatusOr<std::unique_ptr<BenchSession>> BenchSession::Open(const BenchPlan& plan,
                                                           const std::string& address,
                                                           const TargetInfo* expected) {
  std::unique_ptr<BenchSession> session(new BenchSession());
  session->op_ = plan.op;
  session->num_threads_ = plan.num_threads;
  session->inflight_ = plan.inflight;
  session->address_ = address;

  EngineOptions options;
  options.transport = plan.transport;
  options.name = "bench-initiator-" + std::to_string(::getpid());
  options.auth_secret = plan.auth_secret;
  options.insecure = plan.insecure;
  if (plan.lanes) {
    options.tcp_lanes_per_peer = *plan.lanes;
    options.ucx_lanes_per_peer = *plan.lanes;
  }
  ASSIGN_OR_RETURN(session->engine_, TransferEngine::Create(options));
  ASSIGN_OR_RETURN(session->segment_, session->engine_->OpenSegment(address));
  ASSIGN_OR_RETURN(SegmentDescriptor peer,
                   session->engine_->GetSegmentDescriptor(session->segment_));

  const RegionDescriptor* region = nullptr;
  for (const RegionDescriptor& r : peer.regions) {
    if ((r.access & kAccessRemoteReadWrite) != kAccessRemoteReadWrite) continue;
    const MemoryKind want = plan.device == "cuda" ? MemoryKind::kCuda : MemoryKind::kHost;
    if (r.kind != want) continue;
    if (expected != nullptr) {
      if (r.base == expected->base) region = &r;
    } else if (region == nullptr || r.length_bytes > region->length_bytes) {
      region = &r;
    }
  }
  if (region == nullptr) {
    return FailedPreconditionError("target " + address + " has no read-write " +
                                   std::string(plan.device == "cuda" ? "GPU" : "host") +
                                   " region to benchmark against");
  }
  session->remote_base_ = region->base;
  session->buffer_bytes_ = std::min(plan.buffer_bytes, region->length_bytes);
  uint64_t share = session->buffer_bytes_ / static_cast<uint64_t>(plan.num_threads);
  // Page-aligned shares keep every block page-aligned when block sizes are multiples of 4 KiB.
  if (share >= 2 * 4096) share -= share % 4096;
  session->thread_share_bytes_ = share;
  const uint64_t max_block =
      *std::max_element(plan.block_sizes_bytes.begin(), plan.block_sizes_bytes.end());
  if (share < max_block) {
    return FailedPreconditionError("target " + address + " registered " +
                                   FormatBytes(region->length_bytes) +
                                   ", too small for --threads " + std::to_string(plan.num_threads) +
                                   " x --block-size " + FormatBytes(max_block));
  }

  if (plan.device == "cuda") {
    ASSIGN_OR_RETURN(session->local_,
                     HostBuffer::AllocateOnDevice(session->buffer_bytes_, plan.local_gpu));
  } else {
    ASSIGN_OR_RETURN(session->local_, HostBuffer::Allocate(session->buffer_bytes_));
  }
  // Not needed by TCP (it reads local memory directly) but what a real client does, and what
  // transports with memory keys require.
  RETURN_IF_ERROR(
      session->engine_->RegisterMemory(session->local_.data(), session->local_.size_bytes(),
                                       session->local_.location(), kAccessRemoteReadWrite));
  return session;
}

std::string BenchSession::route() const {
  StatusOr<std::string> route = engine_->DescribeRoute(segment_, local_.location().kind);
  return route.ok() ? *route : route.status().message();
}

BenchSession::~BenchSession() {
  if (engine_ != nullptr && local_.data() != nullptr) {
    engine_->UnregisterMemory(local_.data()).IgnoreError();
  }
  engine_.reset();  // joins engine threads before the buffer is unmapped
}

StatusOr<BenchConfigResult> BenchSession::Run(uint64_t block_bytes, size_t batch_size,
                                              double duration_s) {
  if (block_bytes == 0 || block_bytes > thread_share_bytes_) {
    return InvalidArgumentError("block size " + FormatBytes(block_bytes) +
                                " does not fit a thread's share of " +
                                FormatBytes(thread_share_bytes_));
  }
  const uint64_t slots = thread_share_bytes_ / block_bytes;
  const auto duration =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(duration_s));

  LatencyRecorder latency_us;
  std::atomic<bool> stop{false};
  std::mutex error_mu;
  Status first_error;
  std::vector<uint64_t> bytes_per_thread(static_cast<size_t>(num_threads_), 0);
  std::vector<uint64_t> batches_per_thread(static_cast<size_t>(num_threads_), 0);
  std::vector<Clock::time_point> end_per_thread(static_cast<size_t>(num_threads_));
  std::vector<int64_t> submit_ns_per_thread(static_cast<size_t>(num_threads_), 0);
  std::vector<int64_t> cpu_ns_per_thread(static_cast<size_t>(num_threads_), 0);
  std::latch spawned(num_threads_);
  std::latch go(1);
  Clock::time_point start;
  Clock::time_point stop_at;

  auto fail = [&](const Status& s) {
    std::lock_guard<std::mutex> lock(error_mu);
    if (first_error.ok()) first_error = s;
    stop.store(true);
  };

  auto worker = [&](int t) {
    const uint64_t share_offset = static_cast<uint64_t>(t) * thread_share_bytes_;
    std::vector<TransferRequest> requests(batch_size);
    for (size_t j = 0; j < batch_size; ++j) {
      const uint64_t offset = share_offset + (j % slots) * block_bytes;
      requests[j].op = op_;
      requests[j].local_addr = local_.data() + offset;
      requests[j].segment = segment_;
      requests[j].remote_addr = remote_base_ + offset;
      requests[j].length_bytes = block_bytes;
    }
    spawned.count_down();
    go.wait();
    const int64_t cpu_start = CpuNs(CLOCK_THREAD_CPUTIME_ID);
    int64_t submit_ns = 0;
    uint64_t bytes = 0;
    uint64_t batches = 0;
    struct Pending {
      BatchId id;
      Clock::time_point submitted;
    };
    std::deque<Pending> pending;
    // Waits for the oldest pending batch; false on failure (recorded through fail).
    auto retire = [&]() {
      const Pending p = pending.front();
      pending.pop_front();
      StatusOr<BatchStatus> status = engine_->WaitBatch(p.id, std::chrono::hours(1));
      while (status.ok() && status->state == TransferState::kPending) {
        status = engine_->WaitBatch(p.id, std::chrono::hours(1));
      }
      const Clock::time_point completed = Clock::now();
      engine_->ReleaseBatch(p.id).IgnoreError();
      if (!status.ok()) {
        fail(status.status().WithContext("waiting for a batch"));
        return false;
      }
      if (status->state != TransferState::kCompleted) {
        fail(status->error.WithContext("a batch of " + std::to_string(batch_size) + " x " +
                                       OpName(op_) + " ended " +
                                       std::string(TransferStateName(status->state)) + " (" +
                                       std::to_string(status->num_failed) + " of " +
                                       std::to_string(status->num_requests) + " requests failed)"));
        return false;
      }
      latency_us.Add(std::chrono::duration<double, std::micro>(completed - p.submitted).count());
      bytes += batch_size * block_bytes;
      ++batches;
      return true;
    };
    bool ok = true;
    while (ok && !stop.load(std::memory_order_relaxed) && Clock::now() < stop_at) {
      const Clock::time_point submitted = Clock::now();
      StatusOr<BatchId> id = engine_->SubmitBatch(requests);
      submit_ns +=
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - submitted).count();
      if (!id.ok()) {
        fail(id.status().WithContext("submitting a batch"));
        break;
      }
      pending.push_back({*id, submitted});
      if (pending.size() >= static_cast<size_t>(inflight_)) ok = retire();
    }
    while (ok && !pending.empty()) ok = retire();
    for (const Pending& p : pending) {  // after a failure: let the rest finish, then free them
      (void)engine_->WaitBatch(p.id, std::chrono::hours(1));
      engine_->ReleaseBatch(p.id).IgnoreError();
    }
    end_per_thread[static_cast<size_t>(t)] = Clock::now();
    cpu_ns_per_thread[static_cast<size_t>(t)] = CpuNs(CLOCK_THREAD_CPUTIME_ID) - cpu_start;
    submit_ns_per_thread[static_cast<size_t>(t)] = submit_ns;
    bytes_per_thread[static_cast<size_t>(t)] = bytes;
    batches_per_thread[static_cast<size_t>(t)] = batches;
  };

  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(num_threads_));
  for (int t = 0; t < num_threads_; ++t) threads.emplace_back(worker, t);
  spawned.wait();
  const int64_t process_cpu_start = CpuNs(CLOCK_PROCESS_CPUTIME_ID);
  start = Clock::now();
  stop_at = start + duration;
  go.count_down();  // publishes start and stop_at to the workers
  for (std::thread& thread : threads) thread.join();
  const int64_t process_cpu_ns = CpuNs(CLOCK_PROCESS_CPUTIME_ID) - process_cpu_start;
  if (!first_error.ok()) {
    return first_error.WithContext(ConfigName(block_bytes, batch_size));
  }

  BenchConfigResult result;
  result.block_bytes = block_bytes;
  result.batch_size = batch_size;
  result.num_threads = num_threads_;
  Clock::time_point end = *std::max_element(end_per_thread.begin(), end_per_thread.end());
  result.seconds = std::chrono::duration<double>(end - start).count();
  for (int t = 0; t < num_threads_; ++t) {
    result.bytes += bytes_per_thread[static_cast<size_t>(t)];
    result.num_batches += batches_per_thread[static_cast<size_t>(t)];
  }
  result.gbps = result.seconds > 0 ? static_cast<double>(result.bytes) / result.seconds / 1e9 : 0;
  result.latency_p50_us = latency_us.Percentile(50);
  result.latency_p99_us = latency_us.Percentile(99);
  int64_t submit_ns = 0, submitting_cpu_ns = 0;
  for (int t = 0; t < num_threads_; ++t) {
    submit_ns += submit_ns_per_thread[static_cast<size_t>(t)];
    submitting_cpu_ns += cpu_ns_per_thread[static_cast<size_t>(t)];
  }
  const double requests = static_cast<double>(result.num_batches * batch_size);
  if (requests > 0) {
    result.host_ns_per_request_submit = static_cast<double>(submit_ns) / requests;
    result.host_ns_per_request_submitting_cpu = static_cast<double>(submitting_cpu_ns) / requests;
    result.host_ns_per_request_other_cpu =
        static_cast<double>(std::max<int64_t>(0, process_cpu_ns - submitting_cpu_ns)) / requests;
  }
  return result;
}

Status BenchSession::TransferAll(const std::vector<TransferRequest>& requests) {
  ASSIGN_OR_RETURN(BatchId id, engine_->SubmitBatch(requests));
  StatusOr<BatchStatus> status = engine_->WaitBatch(id, std::chrono::hours(1));
  while (status.ok() && status->state == TransferState::kPending) {
    status = engine_->WaitBatch(id, std::chrono::hours(1));
  }
  engine_->ReleaseBatch(id).IgnoreError();
  if (!status.ok()) return status.status();
  if (status->state != TransferState::kCompleted) {
    return status->error.ok()
               ? InternalError("batch ended " + std::string(TransferStateName(status->state)))
               : status->error;
  }
  return OkStatus();
}

Status BenchSession::Verify(uint64_t block_bytes, size_t batch_size) {
  // Blocks at distinct offsets: a wrapped batch would let two requests race for one block.
  const uint64_t slots = buffer_bytes_ / block_bytes;
  const uint64_t by_bytes = std::max<uint64_t>(1, kMaxBenchVerifyBytes / block_bytes);
  const size_t n = static_cast<size_t>(std::min<uint64_t>({batch_size, slots, by_bytes}));
  const uint64_t length = n * block_bytes;
  // A fresh seed each time, so bytes left over from an earlier round cannot pass.
  const uint64_t seed = std::random_device{}() ^ (++verify_round_ << 32);

  std::vector<TransferRequest> requests(n);
  auto build = [&](TransferOp op) {
    for (size_t j = 0; j < n; ++j) {
      requests[j].op = op;
      requests[j].local_addr = local_.data() + j * block_bytes;
      requests[j].segment = segment_;
      requests[j].remote_addr = remote_base_ + j * block_bytes;
      requests[j].length_bytes = block_bytes;
    }
  };
  const std::string what = ConfigName(block_bytes, batch_size) + ": verification";
  // GPU buffers are filled and checked through a host copy.
  const bool on_gpu = local_.location().kind == MemoryKind::kCuda;
  std::vector<uint8_t> staging(on_gpu ? length : 0);
  uint8_t* host = on_gpu ? staging.data() : local_.data();
  FillBenchPattern(host, length, seed);
  if (on_gpu) RETURN_IF_ERROR(cuda::CopyToDevice(local_.data(), host, length));
  build(TransferOp::kWrite);
  RETURN_IF_ERROR(TransferAll(requests).WithContext(what + " WRITE"));
  // Overwrite the pattern so a READ that moved nothing cannot pass.
  std::memset(host, 0x5a, length);
  if (on_gpu) RETURN_IF_ERROR(cuda::CopyToDevice(local_.data(), host, length));
  build(TransferOp::kRead);
  RETURN_IF_ERROR(TransferAll(requests).WithContext(what + " READ"));
  if (on_gpu) RETURN_IF_ERROR(cuda::CopyToHost(host, local_.data(), length));
  const uint64_t bad = FindBenchPatternMismatch(host, length, seed);
  if (bad != length) {
    return DataLossError(what + ": " + std::to_string(n) + " x " + FormatBytes(block_bytes) +
                         " written then read back differ first at byte " +
                         std::to_string(bad % block_bytes) + " of request " +
                         std::to_string(bad / block_bytes) + " (remote address " +
                         Hex(remote_base_ + bad) + ")");
  }
  return OkStatus();
}

}  // namespace kvferry::tools
