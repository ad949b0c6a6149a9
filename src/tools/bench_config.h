// Flags of `kvferry bench` and their validation into a plan the benchmark runs.
//
// The CLI stores flag text as typed (BenchFlags); MakeBenchPlan checks every value and turns
// it into typed fields (BenchPlan). Every error names the flag it is about, so a user who
// typed `--block-size 4XB` reads "--block-size: ..." rather than a generic parse failure.
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvferry/engine.h"
#include "kvferry/status.h"
#include "tools/auth_flags.h"

namespace kvferry::tools {

// Default sweep: small pages of one layer up to whole multi-layer KV blocks.
inline constexpr char kDefaultBenchBlockSizes[] = "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB";
// The derived default buffer never exceeds this, so a sweep to 64 MiB blocks stays within the
// memory of a small machine (each of the two processes holds one buffer). Blocks that do not
// fit a thread's share wrap around (see BenchPlan::buffer_bytes).
inline constexpr uint64_t kMaxDefaultBenchBufferBytes = 2ull << 30;

// Flag values as typed on the command line.
struct BenchFlags {
  std::string device = "cpu";  // "cuda": both buffers in GPU memory (initiator GPU 0, target GPU 1)
  std::string transport = "auto";
  std::string op = "write";
  std::string block_sizes = kDefaultBenchBlockSizes;
  std::string batch_sizes = "32";
  int threads = 4;
  int inflight = 1;  // batches each thread keeps submitted before waiting for the oldest
  double duration_s = 2.0;
  int lanes = 0;                       // 0: keep the EngineOptions default
  std::string buffer_size;             // empty: derived, see DefaultBenchBufferBytes
  std::string json_path;               // empty: no JSON
  std::string target;                  // empty: spawn a target process
  bool serve = false;                  // run as a target until SIGINT/SIGTERM
  std::string listen = "127.0.0.1:0";  // --serve only
  AuthFlags auth;                      // --auth-token-file, --insecure
};

// What one benchmark run does. Built only by MakeBenchPlan, so every field is valid.
struct BenchPlan {
  std::string device = "cpu";
  int local_gpu = 0;
  int target_gpu = 0;
  std::string transport;
  TransferOp op = TransferOp::kWrite;
  std::vector<uint64_t> block_sizes_bytes;  // each > 0, in the order given
  std::vector<size_t> batch_sizes;          // each > 0, in the order given
  int num_threads = 1;
  int inflight = 1;          // batches in flight per thread, 1..64
  double duration_s = 0;     // per configuration, > 0
  std::optional<int> lanes;  // --lanes when given
  // Size of the local buffer and of the target's registered region. Thread t uses bytes
  // [t * buffer_bytes / num_threads, (t + 1) * buffer_bytes / num_threads) of both; request j
  // of a batch uses block slot j modulo the number of blocks that fit that share.
  uint64_t buffer_bytes = 0;
  std::string json_path;
  std::string target_address;  // empty: spawn one
  bool serve = false;
  std::string listen_host;   // --serve only
  uint16_t listen_port = 0;  // --serve only; 0 picks a free port
  // The shared secret both engines prove (empty: none): --auth-token-file or
  // KVFERRY_AUTH_TOKEN; a fresh one for a spawned target when neither is given (RunBench).
  std::string auth_secret;
  bool insecure = false;  // --insecure
};

// Parses "4KiB,1MiB,..." (ParseByteSize syntax per item). Errors: kInvalidArgument naming
// `flag` for an empty list, an empty item, a bad number or suffix, or a size of 0.
StatusOr<std::vector<uint64_t>> ParseByteSizeList(const std::string& flag, const std::string& text);

// Parses "1,8,32": positive decimal integers up to `max_value`. Errors: kInvalidArgument
// naming `flag`.
StatusOr<std::vector<size_t>> ParseCountList(const std::string& flag, const std::string& text,
                                             size_t max_value);

// Parses "HOST:PORT" (ParseHostPort; PORT may be 0 to pick a free one). Errors:
// kInvalidArgument naming `flag`.
Status ParseFlagHostPort(const std::string& flag, const std::string& text, std::string* host,
                         uint16_t* port);

// The buffer that lets every thread keep a whole batch of the largest blocks in flight at
// distinct offsets, capped at kMaxDefaultBenchBufferBytes but never below one largest block
// per thread.
uint64_t DefaultBenchBufferBytes(int num_threads, size_t max_batch_size, uint64_t max_block_bytes);

// Validates flags. Errors: kInvalidArgument with the flag's name, e.g.
// "--block-size: byte size must be > 0, got '0'".
StatusOr<BenchPlan> MakeBenchPlan(const BenchFlags& flags);

}  // namespace kvferry::tools
