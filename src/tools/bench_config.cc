#include "tools/bench_config.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "common/checks.h"
#include "common/env.h"
#include "common/host_port.h"
#include "cuda/device_memory.h"

namespace kvferry::tools {

namespace {

std::vector<std::string> SplitCommas(const std::string& text) {
  std::vector<std::string> items;
  size_t begin = 0;
  while (true) {
    size_t comma = text.find(',', begin);
    std::string item = text.substr(begin, comma == std::string::npos ? comma : comma - begin);
    // Trim so "4KiB, 1MiB" works.
    size_t first = item.find_first_not_of(" \t");
    size_t last = item.find_last_not_of(" \t");
    items.push_back(first == std::string::npos ? "" : item.substr(first, last - first + 1));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return items;
}

std::string FormatDouble(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}

Status FlagError(const std::string& flag, const std::string& what) {
  return InvalidArgumentError(flag + ": " + what);
}

}  // namespace

StatusOr<std::vector<uint64_t>> ParseByteSizeList(const std::string& flag,
                                                  const std::string& text) {
  std::vector<uint64_t> sizes;
  for (const std::string& item : SplitCommas(text)) {
    if (item.empty()) return FlagError(flag, "empty item in list '" + text + "'");
    StatusOr<uint64_t> size = ParseByteSize(item);
    if (!size.ok()) return FlagError(flag, size.status().message());
    if (*size == 0) return FlagError(flag, "byte size must be > 0, got '" + item + "'");
    sizes.push_back(*size);
  }
  return sizes;
}

StatusOr<std::vector<size_t>> ParseCountList(const std::string& flag, const std::string& text,
                                             size_t max_value) {
  std::vector<size_t> counts;
  for (const std::string& item : SplitCommas(text)) {
    if (item.empty()) return FlagError(flag, "empty item in list '" + text + "'");
    size_t value = 0;
    for (char c : item) {
      if (c < '0' || c > '9') {
        return FlagError(flag, "'" + item + "' is not a positive integer");
      }
      value = value * 10 + static_cast<size_t>(c - '0');
      if (value > max_value) {
        return FlagError(flag, "'" + item + "' exceeds " + std::to_string(max_value));
      }
    }
    if (value == 0) return FlagError(flag, "must be > 0, got '" + item + "'");
    counts.push_back(value);
  }
  return counts;
}

Status ParseFlagHostPort(const std::string& flag, const std::string& text, std::string* host,
                         uint16_t* port) {
  StatusOr<HostPort> parsed = ParseHostPort(text, "address", /*allow_port_zero=*/true);
  if (!parsed.ok()) return FlagError(flag, parsed.status().message());
  *host = parsed->host;
  *port = parsed->port;
  return OkStatus();
}

uint64_t DefaultBenchBufferBytes(int num_threads, size_t max_batch_size, uint64_t max_block_bytes) {
  const uint64_t threads = static_cast<uint64_t>(std::max(num_threads, 1));
  uint64_t want = kMaxDefaultBenchBufferBytes;
  // Multiply only when it cannot overflow (silly flags can ask for more than 2^64 bytes).
  if (max_batch_size > 0 && max_block_bytes > 0 &&
      max_block_bytes <= kMaxDefaultBenchBufferBytes / max_batch_size / threads) {
    want = threads * max_batch_size * max_block_bytes;
  }
  const uint64_t floor = max_block_bytes > std::numeric_limits<uint64_t>::max() / threads
                             ? std::numeric_limits<uint64_t>::max()
                             : threads * max_block_bytes;
  return std::max(want, floor);
}

StatusOr<BenchPlan> MakeBenchPlan(const BenchFlags& flags) {
  if (flags.device != "cpu" && flags.device != "cuda") {
    return InvalidArgumentError("--device must be cpu or cuda, got '" + flags.device + "'");
  }
  BenchPlan plan;
  plan.serve = flags.serve;
  plan.insecure = flags.auth.insecure;
  plan.transport = flags.transport;
  plan.device = flags.device;
  if (plan.device == "cuda") {
    // The initiator on GPU 0, the target on GPU 1 (GPU 0 too when there is only one).
    RETURN_IF_ERROR(cuda::CheckDevice(0).WithContext("--device cuda"));
    plan.local_gpu = 0;
    plan.target_gpu = cuda::CheckDevice(1).ok() ? 1 : 0;
  }
  if (plan.transport.empty()) return FlagError("--transport", "must not be empty");
  if (flags.op == "write") {
    plan.op = TransferOp::kWrite;
  } else if (flags.op == "read") {
    plan.op = TransferOp::kRead;
  } else {
    return FlagError("--op", "unknown op '" + flags.op + "' (use write or read)");
  }
  ASSIGN_OR_RETURN(plan.block_sizes_bytes, ParseByteSizeList("--block-size", flags.block_sizes));
  ASSIGN_OR_RETURN(plan.batch_sizes, ParseCountList("--batch-size", flags.batch_sizes, 1 << 20));
  if (flags.threads < 1 || flags.threads > 1024) {
    return FlagError("--threads", "must be in 1..1024, got " + std::to_string(flags.threads));
  }
  plan.num_threads = flags.threads;
  if (flags.inflight < 1 || flags.inflight > 64) {
    return FlagError("--inflight", "must be in 1..64, got " + std::to_string(flags.inflight));
  }
  plan.inflight = flags.inflight;
  if (!std::isfinite(flags.duration_s) || flags.duration_s <= 0 || flags.duration_s > 86400) {
    return FlagError("--duration", "must be a number of seconds in (0, 86400], got " +
                                       FormatDouble(flags.duration_s));
  }
  plan.duration_s = flags.duration_s;
  if (flags.lanes != 0) {
    if (flags.lanes < 1 || flags.lanes > 64) {
      return FlagError("--lanes", "must be in 1..64, got " + std::to_string(flags.lanes));
    }
    plan.lanes = flags.lanes;
  }
  const uint64_t max_block =
      *std::max_element(plan.block_sizes_bytes.begin(), plan.block_sizes_bytes.end());
  const size_t max_batch = *std::max_element(plan.batch_sizes.begin(), plan.batch_sizes.end());
  if (flags.buffer_size.empty()) {
    plan.buffer_bytes = DefaultBenchBufferBytes(plan.num_threads, max_batch, max_block);
  } else {
    StatusOr<uint64_t> size = ParseByteSize(flags.buffer_size);
    if (!size.ok()) return FlagError("--buffer-size", size.status().message());
    if (*size == 0) return FlagError("--buffer-size", "must be > 0");
    plan.buffer_bytes = *size;
  }
  // --serve does not submit, so its buffer need not hold the initiator's blocks.
  if (!plan.serve && plan.buffer_bytes / static_cast<uint64_t>(plan.num_threads) < max_block) {
    return FlagError("--buffer-size",
                     FormatBytes(plan.buffer_bytes) + " is too small for --threads " +
                         std::to_string(plan.num_threads) + " x --block-size " +
                         FormatBytes(max_block) + " (each thread needs one block)");
  }
  plan.json_path = flags.json_path;
  plan.target_address = flags.target;
  if (!plan.target_address.empty()) {
    std::string host;
    uint16_t port = 0;
    RETURN_IF_ERROR(ParseFlagHostPort("--target", plan.target_address, &host, &port));
    if (port == 0) return FlagError("--target", "port must not be 0");
  }
  if (plan.serve) {
    if (!plan.target_address.empty()) {
      return FlagError("--serve", "cannot be combined with --target");
    }
    RETURN_IF_ERROR(
        ParseFlagHostPort("--listen", flags.listen, &plan.listen_host, &plan.listen_port));
  }
  return plan;
}

}  // namespace kvferry::tools
