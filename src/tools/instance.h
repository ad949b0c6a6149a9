// Prefill and decode instances as processes, the way the replay (or an operator) runs them.
//
// Each instance holds a KV pool, an aux buffer, a page allocator and a connector, and serves
// a small HTTP control API standing in for an inference server's request path:
//   prefill  POST /prefill {"room","input_length"}: allocates pages, waits for decode's
//            destination, "computes" the prompt chunk by chunk (deterministic content per
//            (room, layer, token, head)) and sends each chunk as it is produced, then the
//            aux row; answers when the room succeeded or failed.
//   decode   POST /decode {"room","input_length","bootstrap_address"}: allocates pages in
//            fragmented order, receives, verifies every byte and the aux row, frees.
//   both     GET /info, GET /stats, GET /metrics (Prometheus text: metrics_page.h),
//            GET /health, POST /shutdown.
// With a shared secret (--auth-token-file or KVFERRY_AUTH_TOKEN) every route but /health needs
// its bearer token (disagg/http_auth.h), and the engine and bootstrap server admit only peers
// that prove it; without one, a non-loopback --host is refused unless --insecure.
// A request larger than the whole pool is refused with HTTP 413 ("rejected"); smaller ones
// wait for pool space.
// On start an instance prints one line "KVFERRY_READY <json of /info>" on stdout.
#pragma once

#include <cstdint>
#include <string>

#include "kvferry/kv_layout.h"
#include "kvferry/status.h"
#include "tools/auth_flags.h"

namespace kvferry::tools {

struct InstanceFlags {
  std::string model = "llama-3.1-8b";
  std::string model_config;  // Hugging Face config.json; overrides `model`
  int page_size = 16;
  std::string pool_size = "4GiB";  // per instance
  std::string transport = "auto";
  std::string host = "127.0.0.1";
  int control_port = 0;
  int bootstrap_port = 0;       // prefill only
  int64_t chunk_tokens = 8192;  // prefill: tokens per prefill chunk (chunked prefill)
  int aux_rows = 1024;
  int state_slots = 8;  // hybrid models: linear-attention state slots (one per request in flight)
  int64_t timeout_ms = 120000;  // bootstrap, waiting and transfer timeouts
  std::string device = "cpu";   // "cpu": host pools; "cuda": pools and aux rows on GPU `gpu`
  int gpu = 0;
  // Attention tensor parallelism: this instance is rank `tp_rank` of `tp_size` and holds only
  // its share of the model's KV heads (tp_plan.h). Prefill ranks other than 0 join rank 0's
  // bootstrap server at `join_bootstrap`.
  int tp_rank = 0;
  int tp_size = 1;
  std::string join_bootstrap;
  // Decode, unequal TP: "auto", "direct" or "staging" (through a host staging ring of
  // staging_size).
  std::string kv_path = "auto";
  std::string staging_size = "1GiB";
  // Decode pulls each batch (READs it from prefill's pools); prefill allows it
  // (DecodeConnectorOptions::pull, PrefillConnectorOptions::allow_pull).
  bool pull = false;
  int exit_with_parent = 0;  // pid of the replay that spawned this instance; 0: none
  AuthFlags auth;            // --auth-token-file, --insecure
  // Prefill context parallelism: rank cp_rank of cp_size sends its share of each request's
  // pages (cp_split.h); cp_rank0_only keeps the old behaviour (rank 0 sends everything).
  int cp_rank = 0;
  int cp_size = 1;
  bool cp_rank0_only = false;
  // Prefill: simulated compute per model layer (a sleep), before each chunk's KV is handed
  // over; with `layerwise` every layer is marked ready as it "finishes" (BeginLayerwisePass /
  // MarkLayerReady) instead of sending the chunk after its last layer.
  int64_t compute_us_per_layer = 0;
  bool layerwise = false;
  // Failure drill (GPU, layerwise): prefill aborts every room whose id is a multiple of
  // abort_every halfway through its simulated compute; decode overwrites a failed room's pages
  // with a sentinel pattern, waits kLateWriteGraceMs and counts pages changed since
  // ("late_writes": copies that landed after decode heard of the failure). 0: off.
  int abort_every = 0;
  // Fault-injection plan of this instance's engine (kvferry/faults.h); "" none.
  std::string faults;
};

// How long a decode instance watches a failed room's pages for late writes (abort_every).
inline constexpr int kLateWriteGraceMs = 50;

// Requests an instance serves at once (its HTTP threads), the most a replay keeps in flight.
inline constexpr int kInstanceHttpThreads = 128;

// Ranges of the numeric instance flags (CheckInstanceFlags), shared with the replay's.
inline constexpr int kMaxPageSize = 4096;
inline constexpr int64_t kMinTimeoutMs = 100;
inline constexpr int64_t kMaxTimeoutMs = 86'400'000;  // a day
inline constexpr int64_t kMaxChunkTokens = int64_t{1} << 30;
inline constexpr int64_t kMaxComputeUsPerLayer = 10'000'000;  // 10 s
inline constexpr int kMaxParallelRanks = 64;                  // TP or CP size
inline constexpr int kMaxAuxRows = 1 << 20;
inline constexpr int kMaxStateSlots = 1 << 16;
inline constexpr int kMaxGpu = 1023;

// Checks every numeric flag of an instance (prefill's own ones with `prefill`) against its
// range. Errors: kInvalidArgument naming the flag, e.g. "--aux-rows must be in 1..1048576,
// got 0".
Status CheckInstanceFlags(const InstanceFlags& flags, bool prefill);

// The command-line arguments that start an instance with `flags` (a replay's children),
// exiting when process `parent_pid` does.
std::vector<std::string> InstanceChildArgs(const InstanceFlags& flags, bool prefill,
                                           int parent_pid);

// Resolves --model / --model-config. Errors name the flag and value.
StatusOr<ModelGeometry> ResolveModel(const std::string& model, const std::string& model_config);

int RunPrefillInstance(const InstanceFlags& flags);
int RunDecodeInstance(const InstanceFlags& flags);

}  // namespace kvferry::tools
