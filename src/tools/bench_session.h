// The initiator side of `kvferry bench`: one engine connected to one target, running timed
// configurations (block size x batch size) and checking the bytes after each.
//
// Each of the plan's threads owns one share of the local buffer and the same share of the
// target's region, and loops: submit a batch of `batch_size` requests of `block_bytes` at
// distinct offsets of its share (wrapping when the share holds fewer blocks), wait until the
// batch is final, record the batch latency (submit -> complete), until the duration elapsed.
// With --inflight N a thread keeps N batches submitted (the same blocks: concurrent batches of
// one thread write the same bytes) and waits for the oldest before submitting the next, as a
// server with many requests in transfer does.
// Throughput is all bytes moved over the wall time from the common start to the end of the
// last batch, in GB/s (1e9 bytes per second, as network figures are quoted).
// Host cost per request (BenchConfigResult::host_ns_per_request_*): what the initiator's CPU
// spent per request moved, to tell a host-bound configuration (small blocks) from a
// link-bound one: the wall time inside SubmitBatch, and the CPU time of the submitting
// threads (submission, waiting with its spin, release) and of every other thread of the
// process (the engine's completion polling and handling, idle spins included).
//
// Thread-safety: a BenchSession runs one configuration at a time; call it from one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvferry/engine.h"
#include "kvferry/status.h"
#include "tools/bench_config.h"
#include "tools/bench_target.h"

namespace kvferry::tools {

struct BenchConfigResult {
  uint64_t block_bytes = 0;
  size_t batch_size = 0;
  int num_threads = 0;
  double seconds = 0;  // wall time of the timed loop
  uint64_t bytes = 0;  // bytes of all completed batches
  uint64_t num_batches = 0;
  double gbps = 0;  // bytes / seconds / 1e9
  double latency_p50_us = 0;
  double latency_p99_us = 0;
  // Per request of the completed batches, in nanoseconds (see the file comment): wall time
  // inside SubmitBatch; CPU time (user + system) of the submitting threads; CPU time of the
  // process's other threads over the same loop (process CPU minus the submitting threads').
  double host_ns_per_request_submit = 0;
  double host_ns_per_request_submitting_cpu = 0;
  double host_ns_per_request_other_cpu = 0;
};

// Verification writes at most this much per configuration (fewer requests than a batch for
// large blocks), so checking a 64 MiB sweep does not take longer than timing it.
inline constexpr uint64_t kMaxBenchVerifyBytes = 256ull << 20;

// Fills `length` bytes with the pseudo-random pattern of `seed` (splitmix64 per 8-byte word).
void FillBenchPattern(uint8_t* data, uint64_t length, uint64_t seed);
// Offset of the first byte that differs from the pattern of `seed`, or `length` when none.
uint64_t FindBenchPatternMismatch(const uint8_t* data, uint64_t length, uint64_t seed);

class BenchSession {
 public:
  // Creates the engine (transport and lanes from `plan`), allocates and registers the local
  // buffer, opens the target at `address` and picks its region: the one at `expected->base`
  // when the target was spawned here, otherwise its largest read-write region. Uses
  // min(plan.buffer_bytes, region length) of both sides.
  // Errors: those of TransferEngine::Create/OpenSegment; kFailedPrecondition when the target
  // has no usable region or it is too small for one largest block per thread.
  static StatusOr<std::unique_ptr<BenchSession>> Open(const BenchPlan& plan,
                                                      const std::string& address,
                                                      const TargetInfo* expected);
  ~BenchSession();

  // Runs one timed configuration for `duration_s`. Blocks. Errors: the first failed batch's
  // error (with context naming the configuration) or a SubmitBatch error.
  StatusOr<BenchConfigResult> Run(uint64_t block_bytes, size_t batch_size, double duration_s);

  // Writes one batch of a fresh random pattern, reads it back into cleared memory and compares.
  // Errors: kDataLoss naming the first differing byte; transfer errors as they come.
  Status Verify(uint64_t block_bytes, size_t batch_size);

  uint64_t buffer_bytes() const { return buffer_bytes_; }
  // How this session's requests travel (TransferEngine::DescribeRoute), e.g. "ucx, GPU memory
  // through pinned host bounce buffers"; the error text when no transport reaches the target.
  std::string route() const;
  const std::string& address() const { return address_; }

 private:
  BenchSession() = default;
  // Submits `requests` as one batch and blocks until it is final. Errors: the batch's error.
  Status TransferAll(const std::vector<TransferRequest>& requests);

  TransferOp op_ = TransferOp::kWrite;
  int num_threads_ = 1;
  int inflight_ = 1;
  std::string address_;
  std::unique_ptr<TransferEngine> engine_;
  HostBuffer local_;
  SegmentHandle segment_;
  uint64_t remote_base_ = 0;
  uint64_t buffer_bytes_ = 0;        // used of both sides
  uint64_t thread_share_bytes_ = 0;  // each thread's share of buffer_bytes_
  uint64_t verify_round_ = 0;
};

}  // namespace kvferry::tools
