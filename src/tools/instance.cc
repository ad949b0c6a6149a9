#include "tools/instance.h"

#include <httplib.h>
#include <malloc.h>
#include <sys/prctl.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/auth.h"
#include "common/checks.h"
#include "common/env.h"
#include "common/listen_socket.h"
#include "common/logging.h"
#include "cuda/device_ops.h"
#include "disagg/connector_pools.h"
#include "disagg/http_auth.h"
#include "kvferry/connector.h"
#include "kvferry/tp_plan.h"
#include "tools/commands.h"
#include "tools/flag_checks.h"
#include "tools/gpu/gpu_pattern.h"
#include "tools/instance_request.h"
#include "tools/kv_pattern.h"
#include "tools/metrics_page.h"

namespace kvferry::tools {

using json = nlohmann::json;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

// A steady-clock time in nanoseconds since its epoch: comparable between the replay's
// processes, which share a host.
int64_t SteadyNs(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// Everything one instance owns.
struct Instance {
  InstanceFlags flags;
  std::unique_ptr<KvLayout> layout;
  std::unique_ptr<KvPool> pool;
  std::unique_ptr<AuxBuffer> aux;
  std::unique_ptr<PageAllocator> allocator;
  // Hybrid models: linear-attention state slots, handed out one per request.
  std::unique_ptr<StateLayout> state_layout;
  std::unique_ptr<StatePool> state;
  std::unique_ptr<PageAllocator> state_slots;
  std::mutex aux_mu;
  std::condition_variable aux_freed;
  httplib::Server server;
  std::string auth_secret;  // the shared secret (empty: none)
  std::atomic<bool> stopping{false};
  bool on_gpu = false;
  int total_kv_heads = 0;  // of the model; this rank holds its share
  int head_offset = 0;     // global KV head of this rank's local head 0
  cuda::PoolGeometry gpu_geometry;
  std::mutex patterns_mu;
  std::vector<std::unique_ptr<cuda::GpuPattern>> patterns;  // idle GPU fill/verify contexts

  // A GPU fill/verify context for this handler thread (returned with ReturnPattern).
  StatusOr<std::unique_ptr<cuda::GpuPattern>> TakePattern() {
    {
      std::lock_guard<std::mutex> lock(patterns_mu);
      if (!patterns.empty()) {
        auto p = std::move(patterns.back());
        patterns.pop_back();
        return p;
      }
    }
    return cuda::GpuPattern::Create(flags.gpu);
  }
  void ReturnPattern(std::unique_ptr<cuda::GpuPattern> p) {
    std::lock_guard<std::mutex> lock(patterns_mu);
    patterns.push_back(std::move(p));
  }

  // Writes the aux row for `room` (through the device for GPU rows).
  Status WriteAuxRow(int32_t row, uint64_t room) {
    if (!on_gpu) {
      FillAuxRow(aux->layout(), aux->Row(row), room);
      return OkStatus();
    }
    std::vector<uint8_t> host(aux->layout().row_bytes());
    FillAuxRow(aux->layout(), host.data(), room);
    return cuda::CopyToDevice(aux->Row(row), host.data(), host.size());
  }
  Status CheckAuxRow(int32_t row, uint64_t room) {
    if (!on_gpu) return VerifyAuxRow(aux->layout(), aux->Row(row), room);
    std::vector<uint8_t> host(aux->layout().row_bytes());
    RETURN_IF_ERROR(cuda::CopyToHost(host.data(), aux->Row(row), host.size()));
    return VerifyAuxRow(aux->layout(), host.data(), room);
  }
  // Writes / checks a request's linear-attention state (through host copies for GPU pools).
  Status FillState(int32_t slot, uint64_t room) {
    if (state == nullptr) return OkStatus();
    if (!on_gpu) {
      FillStateSlot(*state_layout, *state, slot, room, flags.tp_rank);
      return OkStatus();
    }
    for (int b = 0; b < state_layout->num_buffers(); ++b) {
      std::vector<uint8_t> host(state_layout->slot_bytes(b));
      FillStateBuffer(*state_layout, b, host.data(), room, flags.tp_rank);
      RETURN_IF_ERROR(cuda::CopyToDevice(state->SlotAddress(b, slot), host.data(), host.size()));
    }
    return OkStatus();
  }
  StatusOr<VerifyResult> VerifyState(int32_t slot, uint64_t room) {
    if (state == nullptr) return VerifyResult{};
    if (!on_gpu) return VerifyStateSlot(*state_layout, *state, slot, room, flags.tp_rank);
    VerifyResult all;
    for (int b = 0; b < state_layout->num_buffers(); ++b) {
      std::vector<uint8_t> host(state_layout->slot_bytes(b));
      RETURN_IF_ERROR(cuda::CopyToHost(host.data(), state->SlotAddress(b, slot), host.size()));
      VerifyResult one = VerifyStateBuffer(*state_layout, b, host.data(), room, flags.tp_rank);
      all.pages_checked += one.pages_checked;
      all.pages_mismatched += one.pages_mismatched;
      if (all.first_mismatch.empty()) all.first_mismatch = std::move(one.first_mismatch);
    }
    return all;
  }
  // Fills tokens of a request on the CPU or with a GPU kernel.
  Status Fill(uint64_t room, std::span<const int32_t> pages, int64_t first, int64_t n) {
    if (!on_gpu) {
      FillTokens(*layout, *pool, room, pages, first, n, head_offset);
      return OkStatus();
    }
    ASSIGN_OR_RETURN(auto p, TakePattern());
    Status s = p->Fill(gpu_geometry, pool->data(), room, pages, first, n);
    ReturnPattern(std::move(p));
    return s;
  }
  // Returns mismatched (buffer, page) pairs and the first mismatch's description.
  StatusOr<std::pair<int64_t, std::string>> Verify(uint64_t room, std::span<const int32_t> pages,
                                                   int64_t tokens) {
    if (!on_gpu) {
      VerifyResult v = VerifyTokens(*layout, *pool, room, pages, tokens, head_offset);
      return std::make_pair(v.pages_mismatched, v.first_mismatch);
    }
    ASSIGN_OR_RETURN(auto p, TakePattern());
    auto bad = p->Verify(gpu_geometry, pool->data(), room, pages, tokens);
    ReturnPattern(std::move(p));
    if (!bad.ok()) return bad.status();
    return std::make_pair(*bad, std::string(*bad > 0 ? "on the GPU (per-page flags)" : ""));
  }

  Status Init(bool fragmented) {
    ASSIGN_OR_RETURN(ModelGeometry g, ResolveModel(flags.model, flags.model_config));
    // A TP rank's pool holds only its share of the heads (replicated when TP > heads).
    total_kv_heads = g.attention == AttentionKind::kMla ? 1 : g.num_kv_heads;
    ASSIGN_OR_RETURN(TpPlan plan,
                     PlanHeadSlices(total_kv_heads, flags.tp_size, flags.tp_size, g.attention));
    if (g.attention != AttentionKind::kMla) {
      g.num_kv_heads = plan.prefill_heads;
      head_offset = flags.tp_size <= total_kv_heads
                        ? flags.tp_rank * (total_kv_heads / flags.tp_size)
                        : flags.tp_rank / (flags.tp_size / total_kv_heads);
    }
    ASSIGN_OR_RETURN(KvLayout l, KvLayout::Create(g, flags.page_size));
    layout = std::make_unique<KvLayout>(l);
    auto pool_bytes = ParseByteSize(flags.pool_size);
    if (!pool_bytes.ok()) return pool_bytes.status().WithContext("--pool-size");
    int32_t pages = KvPool::PagesForBytes(*layout, *pool_bytes);
    if (pages < 1) {
      return InvalidArgumentError("--pool-size " + flags.pool_size + " holds no page of " +
                                  FormatBytes(layout->bytes_per_page_all_buffers()));
    }
    if (g.hybrid()) {
      ASSIGN_OR_RETURN(StateLayout sl, StateLayout::Create(g, flags.tp_size));
      state_layout = std::make_unique<StateLayout>(sl);
      if (flags.device == "cuda") {
        ASSIGN_OR_RETURN(state, StatePool::CreateOnDevice(sl, flags.state_slots, flags.gpu));
      } else {
        ASSIGN_OR_RETURN(state, StatePool::Create(sl, flags.state_slots));
      }
      state_slots = std::make_unique<PageAllocator>(flags.state_slots);
    }
    ASSIGN_OR_RETURN(AuxLayout al,
                     AuxLayout::Create(g.hidden_size > 0 ? g.hidden_size : 1, g.dtype));
    if (flags.device == "cuda") {
      on_gpu = true;
      ASSIGN_OR_RETURN(pool, KvPool::CreateOnDevice(*layout, pages, flags.gpu));
      ASSIGN_OR_RETURN(aux, AuxBuffer::CreateOnDevice(al, flags.aux_rows, flags.gpu));
      gpu_geometry = GpuGeometry(*pool);
      gpu_geometry.head_offset = head_offset;
    } else if (flags.device == "cpu") {
      ASSIGN_OR_RETURN(pool, KvPool::Create(*layout, pages));
      ASSIGN_OR_RETURN(aux, AuxBuffer::Create(al, flags.aux_rows));
    } else {
      return InvalidArgumentError("--device must be cpu or cuda, got '" + flags.device + "'");
    }
    // Decode hands out pages in the fragmented order of a long-running server.
    allocator = std::make_unique<PageAllocator>(pages, fragmented ? 0x5eed : 0);
    return OkStatus();
  }

  StatusOr<int32_t> AllocateRow(milliseconds timeout) {
    std::unique_lock<std::mutex> lock(aux_mu);
    auto until = Clock::now() + timeout;
    while (true) {
      auto row = aux->AllocateRow();
      if (row.ok()) return row;
      if (aux_freed.wait_until(lock, until) == std::cv_status::timeout) {
        return DeadlineExceededError("no free aux row within " + std::to_string(timeout.count()) +
                                     " ms");
      }
    }
  }
  void FreeRow(int32_t row) {
    {
      std::lock_guard<std::mutex> lock(aux_mu);
      aux->FreeRow(row).IgnoreError();
    }
    aux_freed.notify_one();
  }

  json Info() const {
    const ModelGeometry& g = layout->geometry();
    return {{"model", g.name},
            {"kv_dtype", std::string(DTypeName(g.dtype))},
            {"page_size", layout->page_size()},
            {"num_buffers", layout->num_buffers()},
            {"page_bytes_all_buffers", layout->bytes_per_page_all_buffers()},
            {"pool_pages", pool->num_pages()},
            {"pool_bytes", pool->size_bytes()},
            {"state_slots", state ? state->num_slots() : 0},
            {"state_bytes_per_slot", state ? state_layout->bytes_per_slot_all_buffers() : 0},
            {"device", flags.device},
            {"tp_rank", flags.tp_rank},
            {"tp_size", flags.tp_size},
            {"gpu", on_gpu ? flags.gpu : -1},
            {"auth_required", !auth_secret.empty()},
            {"control_address", flags.host + ":" + std::to_string(control_port)}};
  }
  int control_port = 0;
  int control_fd = -1;  // the control socket httplib bound (its socket-options callback)

  // Routes shared by both kinds: /info, /stats and /metrics (Prometheus text, metrics_page.h)
  // answer what `info`, `stats` and `metrics` return.
  void AddCommonRoutes(const std::function<json()>& info, const std::function<json()>& stats,
                       const std::function<std::string()>& metrics) {
    server.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("OK", "text/plain");
    });
    server.Get("/info", [info](const httplib::Request&, httplib::Response& res) {
      res.set_content(info().dump(), "application/json");
    });
    server.Get("/stats", [stats](const httplib::Request&, httplib::Response& res) {
      res.set_content(stats().dump(), "application/json");
    });
    server.Get("/metrics", [metrics](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics(), kMetricsContentType);
    });
    server.Post("/shutdown", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content("bye", "text/plain");
      stopping = true;
      std::thread([this] { server.stop(); }).detach();
    });
  }

  // Binds the control port and prints the ready line; then serves until /shutdown.
  int Serve(const std::function<json()>& info) {
    RequireBearerToken(server, auth_secret, "control server");
    server.new_task_queue = [] { return new httplib::ThreadPool(128); };
    // SO_REUSEADDR without httplib's SO_REUSEPORT (a second instance could bind a fixed
    // --control-port); the socket offered last is the one bound, its backlog raised after the
    // bind: httplib's 5 reset bursts of first connections (common/listen_socket.h).
    server.set_socket_options([this](socket_t sock) {
      SetListenAddressReuse(sock);
      control_fd = sock;
    });
    // A client that stops sending (or reading) frees its thread after 5 s; request bodies are
    // a few hundred bytes.
    server.set_read_timeout(5, 0);
    server.set_write_timeout(5, 0);
    server.set_payload_max_length(1 << 20);
    int port = flags.control_port > 0
                   ? (server.bind_to_port(flags.host, flags.control_port) ? flags.control_port : -1)
                   : server.bind_to_any_port(flags.host);
    if (port <= 0) {
      std::fprintf(stderr, "kvferry: cannot listen on %s:%d\n", flags.host.c_str(),
                   flags.control_port);
      return 1;
    }
    if (Status s = RaiseListenBacklog(control_fd); !s.ok()) {
      std::fprintf(stderr, "kvferry: control server on %s:%d: %s\n", flags.host.c_str(), port,
                   s.ToString().c_str());
      return 1;
    }
    control_port = port;
    std::printf("KVFERRY_READY %s\n", info().dump().c_str());
    std::fflush(stdout);
    server.listen_after_bind();
    return 0;
  }
};

void Reply(httplib::Response& res, int code, const json& body) {
  res.status = code;
  res.set_content(body.dump(), "application/json");
}

int HttpCode(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
      return 400;
    case StatusCode::kAlreadyExists:
      return 409;
    case StatusCode::kResourceExhausted:
      return 413;
    case StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

StatusOr<std::vector<int32_t>> AllocatePages(Instance& in, int64_t num_pages) {
  if (num_pages > in.allocator->capacity()) {
    return ResourceExhaustedError("request of " + std::to_string(num_pages) +
                                  " pages is larger than the whole pool of " +
                                  std::to_string(in.allocator->capacity()) + " pages");
  }
  return in.allocator->AllocateWait(static_cast<int32_t>(num_pages),
                                    milliseconds(in.flags.timeout_ms));
}

// A request's pages and aux row, handed back to the instance when the handler ends.
struct Admission {
  Instance* in = nullptr;
  uint64_t room = 0;
  int64_t tokens = 0;
  int64_t num_pages = 0;
  std::vector<int32_t> pages;
  int32_t row = -1;
  int32_t state_slot = -1;        // hybrid models
  std::string bootstrap_address;  // POST /decode
  ~Admission() {
    if (row >= 0) in->FreeRow(row);
    if (state_slot >= 0) in->state_slots->Free(std::span(&state_slot, 1)).IgnoreError();
    if (!pages.empty()) in->allocator->Free(pages).IgnoreError();
  }
};

// Parses the body of POST /prefill or (`decode`) POST /decode (instance_request.h), then takes
// the request's pages (waiting for pool space) and an aux row. On failure it answers the HTTP
// request (400 bad body, 413 larger than the whole pool, 504 no space in time) and returns null.
std::unique_ptr<Admission> Admit(Instance& in, const httplib::Request& req, httplib::Response& res,
                                 bool decode) {
  auto a = std::make_unique<Admission>();
  a->in = &in;
  StatusOr<InstanceRequest> request = ParseInstanceRequest(req.body, decode);
  if (!request.ok()) {
    Reply(res, 400, {{"ok", false}, {"error", request.status().ToString()}});
    return nullptr;
  }
  a->room = request->room;
  a->tokens = request->input_length;
  a->bootstrap_address = std::move(request->bootstrap_address);
  a->num_pages = in.layout->NumPages(a->tokens);
  auto pages = AllocatePages(in, a->num_pages);
  if (!pages.ok()) {
    Reply(res, HttpCode(pages.status()),
          {{"ok", false},
           {"rejected", pages.status().code() == StatusCode::kResourceExhausted},
           {"error", pages.status().ToString()}});
    return nullptr;
  }
  a->pages = std::move(*pages);
  auto row = in.AllocateRow(milliseconds(in.flags.timeout_ms));
  if (!row.ok()) {
    Reply(res, 504, {{"ok", false}, {"error", row.status().ToString()}});
    return nullptr;
  }
  a->row = *row;
  if (in.state_slots != nullptr) {
    auto slot = in.state_slots->AllocateWait(1, milliseconds(in.flags.timeout_ms));
    if (!slot.ok()) {
      Reply(res, 504,
            {{"ok", false}, {"error", slot.status().WithContext("state slot").ToString()}});
      return nullptr;
    }
    a->state_slot = (*slot)[0];
  }
  return a;
}

// Instances the replay spawns end with it (it passes its pid); ones an operator starts stay up
// whatever happens to the shell that started them.
void InstallSignalExit(int exit_with_parent) {
  std::signal(SIGPIPE, SIG_IGN);
  if (exit_with_parent <= 0) return;
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() != exit_with_parent) ::raise(SIGTERM);  // the parent died before prctl
}

// glibc gives threads that allocate at once arenas of their own (up to 8 per core) and keeps
// the memory each arena held. An instance's many threads (HTTP, completion, NVLink progress)
// then grew prefill's resident memory by 1 GiB over six soak passes over NVLink before it
// levelled off; with two arenas it stayed at 0.3 GiB at the same throughput
// (docs/reliability.md). MALLOC_ARENA_MAX, when set, is glibc's to apply and is left alone.
void LimitMallocArenas() {
  if (!MallocArenaMaxSet()) mallopt(M_ARENA_MAX, 2);
}

// Start-up shared by both roles: flag checks, signals, pools, and the engine options of this
// rank. Returns false (after printing why) when the instance cannot start.
bool StartInstance(const InstanceFlags& flags, const char* role, Instance* in,
                   EngineOptions* engine) {
  const bool prefill = std::string(role) == "prefill";
  if (Status checked = CheckInstanceFlags(flags, prefill); !checked.ok()) {
    std::fprintf(stderr, "kvferry %s: %s\n", role, checked.message().c_str());
    return false;
  }
  InstallSignalExit(flags.exit_with_parent);
  LimitMallocArenas();
  in->flags = flags;
  // The shared secret, and whether the control server may listen on --host with what it has
  // (the engine and the bootstrap server check the same when they start).
  auto secret = ResolveAuthFlags(flags.auth);
  Status s = secret.status();
  if (s.ok()) {
    s = CheckListenSecurity("control server", flags.host, !secret->empty(), flags.auth.insecure);
  }
  if (s.ok()) s = in->Init(/*fragmented=*/!prefill);
  if (!s.ok()) {
    std::fprintf(stderr, "kvferry %s: %s\n", role, s.ToString().c_str());
    return false;
  }
  in->auth_secret = *secret;
  engine->auth_secret = *secret;
  engine->insecure = flags.auth.insecure;
  engine->listen_host = flags.host;
  engine->transport = flags.transport;
  engine->name = std::string(role) + "-tp" + std::to_string(flags.tp_rank);
  engine->faults = *ParseFaultPlan(flags.faults);  // checked by CheckInstanceFlags
  return true;
}

}  // namespace

int RunPrefillInstance(const InstanceFlags& flags) {
  Instance in;
  PrefillConnectorOptions o;
  if (!StartInstance(flags, "prefill", &in, &o.engine)) return 2;
  o.state_pool = in.state.get();
  o.tp_rank = flags.tp_rank;
  o.tp_size = flags.tp_size;
  o.cp_rank = flags.cp_rank;
  o.cp_size = flags.cp_size;
  o.cp_all_ranks_send = !flags.cp_rank0_only;
  o.allow_pull = flags.pull;
  o.total_kv_heads = in.total_kv_heads;
  if (flags.join_bootstrap.empty()) {
    o.bootstrap_address = flags.host + ":" + std::to_string(flags.bootstrap_port);
  } else {
    o.bootstrap_address = flags.join_bootstrap;
    o.start_bootstrap_server = false;
  }
  o.bootstrap_timeout = o.transfer_timeout = milliseconds(flags.timeout_ms);
  auto conn = PrefillConnector::Create(o, in.pool.get(), in.aux.get());
  if (!conn.ok()) {
    std::fprintf(stderr, "kvferry prefill: %s\n", conn.status().ToString().c_str());
    return 1;
  }
  PrefillConnector& c = **conn;
  const int64_t chunk_pages = std::max<int64_t>(1, flags.chunk_tokens / in.layout->page_size());
  auto info = [&] {
    json j = in.Info();
    j["role"] = "prefill";
    j["bootstrap_address"] = c.bootstrap_address();
    j["engine_address"] = c.engine_address();
    return j;
  };
  auto stats = [&] {
    ConnectorStats st = c.stats();
    return json{{"transfer_requests", st.transfer_requests},
                {"bytes", st.bytes},
                {"rooms_succeeded", st.rooms_succeeded},
                {"rooms_failed", st.rooms_failed}};
  };
  in.AddCommonRoutes(info, stats,
                     [&] { return MetricsPage("prefill", c.engine_metrics(), c.stats()); });
  in.server.Post("/prefill", [&](const httplib::Request& req, httplib::Response& res) {
    auto admitted = Admit(in, req, res, /*decode=*/false);
    if (admitted == nullptr) return;
    const KvLayout& layout = *in.layout;
    const uint64_t room = admitted->room;
    const int64_t tokens = admitted->tokens, num_pages = admitted->num_pages;
    const std::vector<int32_t>* pages = &admitted->pages;
    const int32_t* row = &admitted->row;
    Status created = c.CreateSender(room, num_pages, admitted->state_slot);
    if (!created.ok()) {
      return Reply(res, HttpCode(created), {{"ok", false}, {"error", created.ToString()}});
    }
    auto fail = [&](const Status& why) {
      c.Abort(room, why.message()).IgnoreError();
      auto st = c.Poll(room);
      std::string reason = st.ok() && !st->error.ok() ? st->error.ToString() : why.ToString();
      c.Release(room).IgnoreError();
      Reply(res, 500, {{"ok", false}, {"error", reason}});
    };
    auto ready = c.Wait(room, RoomState::kWaitingForInput, milliseconds(flags.timeout_ms));
    if (!ready.ok() || ready->state != RoomState::kWaitingForInput) {
      return fail(ready.ok() ? (ready->error.ok() ? DeadlineExceededError("decode never paired")
                                                  : ready->error)
                             : ready.status());
    }
    auto start = Clock::now();
    const int model_layers = layout.geometry().num_model_layers();
    const auto layer_compute = std::chrono::microseconds(flags.compute_us_per_layer);
    Clock::time_point compute_end = start;
    // On a GPU the simulated compute is a spin kernel per layer, and layers are marked ready
    // by the CUDA event recorded after each (MarkLayerReadyOnEvent); on the CPU, a sleep.
    std::unique_ptr<cuda::ComputeStream> gpu_compute;
    if (in.on_gpu && layer_compute.count() > 0) {
      auto cs = cuda::ComputeStream::Create(flags.gpu, 2 * model_layers);
      if (!cs.ok()) return fail(cs.status());
      gpu_compute = std::move(*cs);
    }
    if (Status a = in.WriteAuxRow(*row, room); !a.ok()) return fail(a);
    // The linear-attention state (hybrid models). With GPU compute each linear layer's state
    // is written by a kernel on the compute stream just before that layer's spin kernel (in
    // the first chunk), as a real prefill produces it, so the layer's event covers it and
    // layers can be marked as soon as they are queued (written from the host, ~77 MB for
    // Qwen3-Next took ~20 ms: docs/perf/layerwise.md). Otherwise it is written before the
    // compute.
    bool state_pending = gpu_compute != nullptr && in.state != nullptr;
    if (gpu_compute == nullptr) {
      if (Status st = in.FillState(admitted->state_slot, room); !st.ok()) return fail(st);
    }
    // One simulated layer on the GPU: its state first (see above), then its spin kernel;
    // returns the event recorded after them.
    auto compute_layer = [&](int l, int64_t us) -> StatusOr<void*> {
      const ModelGeometry::LayerRef ref = layout.geometry().ModelLayer(l);
      if (state_pending && ref.linear) {
        for (int b : {ref.index, layout.geometry().num_linear_layers + ref.index}) {
          RETURN_IF_ERROR(gpu_compute->FillPatternRows(
              in.state->SlotAddress(b, admitted->state_slot), in.state_layout->row_bytes(b),
              StateRowSeeds(*in.state_layout, b, room, flags.tp_rank)));
        }
      }
      return gpu_compute->Spin(us);
    };
    // This rank computes and sends its range of the pages (all of them without context
    // parallelism); a CP rank with an empty range only reports, with an empty last chunk.
    const PageRange range = c.SendRange(num_pages);
    const int64_t end = range.first_page + range.num_pages;
    // Steady-clock ns for the replay's time breakdown (time_breakdown.h): [start, end) pairs
    // of content generation and of simulated compute, and when the first data was handed over.
    std::vector<int64_t> fill_ns, compute_ns;
    int64_t send_start_ns = 0;
    auto sending = [&] {
      if (send_start_ns == 0) send_start_ns = SteadyNs(Clock::now());
    };
    for (int64_t first = range.first_page; first < end || (first == end && range.num_pages == 0);
         first += chunk_pages) {
      int64_t n = std::min(chunk_pages, end - first);
      int64_t first_token = first * layout.page_size();
      int64_t chunk_tokens = std::min<int64_t>(n * layout.page_size(), tokens - first_token);
      // "Compute" this chunk's KV, then hand it to the sender while the next one computes.
      if (chunk_tokens > 0) {
        fill_ns.push_back(SteadyNs(Clock::now()));
        if (Status f = in.Fill(room, *pages, first_token, chunk_tokens); !f.ok()) return fail(f);
        fill_ns.push_back(SteadyNs(Clock::now()));
      }
      bool last = first + n == end;
      const std::optional<int32_t> aux = last ? std::optional<int32_t>(*row) : std::nullopt;
      // Simulated compute: layer after layer; sleeps run against absolute times so they do
      // not drift.
      auto layer_done = Clock::now();
      const auto compute_start = layer_done;
      if (flags.layerwise) {
        PrefillConnector::LayerwiseChunk chunk;
        chunk.room = room;
        chunk.first_page = first;
        chunk.src_pages.assign(pages->begin() + first, pages->begin() + first + n);
        chunk.aux_row = aux;
        auto pass = c.BeginLayerwisePass(std::span(&chunk, 1));
        if (!pass.ok()) return fail(pass.status());
        if (gpu_compute != nullptr) {
          // Every layer's kernels queued first (the GPU runs them back to back), then each
          // layer marked by its event: a layer whose kernel already finished is sent at once,
          // the others wait for their events.
          std::vector<void*> events;
          for (int l = 0; l < model_layers; ++l) {
            auto event = compute_layer(l, layer_compute.count());
            if (!event.ok()) return fail(event.status());
            events.push_back(*event);
          }
          state_pending = false;
          sending();
          for (int l = 0; l < model_layers; ++l) {
            if (Status m = c.MarkLayerReadyOnEvent(*pass, l, events[static_cast<size_t>(l)]);
                !m.ok()) {
              return fail(m);
            }
          }
          if (flags.abort_every > 0 && room % static_cast<uint64_t>(flags.abort_every) == 0) {
            // Failure drill: abort halfway through the layers, copies of later layers pending.
            // (The connector waits on its own copies of the events: ours may go.)
            std::this_thread::sleep_for(layer_compute * model_layers / 2);
            return fail(AbortedError("replay --abort-every drill"));
          }
        }
        for (int l = 0; gpu_compute == nullptr && l < model_layers; ++l) {
          layer_done += layer_compute;
          if (layer_compute.count() > 0) std::this_thread::sleep_until(layer_done);
          if (l == model_layers - 1) compute_end = Clock::now();  // the last layer is ready
          sending();
          if (Status m = c.MarkLayerReady(*pass, l); !m.ok()) return fail(m);
        }
        if (gpu_compute != nullptr) {
          if (Status w = gpu_compute->Synchronize(); !w.ok()) return fail(w);
          compute_end = Clock::now();
        }
      } else {
        if (gpu_compute != nullptr) {
          for (int l = 0; l < model_layers; ++l) {
            auto event = compute_layer(l, layer_compute.count());
            if (!event.ok()) return fail(event.status());
          }
          state_pending = false;
          if (Status w = gpu_compute->Synchronize(); !w.ok()) return fail(w);
        } else {
          layer_done += layer_compute * model_layers;
          if (layer_compute.count() > 0) std::this_thread::sleep_until(layer_done);
        }
        compute_end = Clock::now();  // the whole chunk is computed: hand it over
        sending();
        Status sent = c.SendChunk(room, first, std::span(pages->data() + first, n), aux);
        if (!sent.ok()) return fail(sent);
      }
      if (layer_compute.count() > 0) {
        compute_ns.insert(compute_ns.end(), {SteadyNs(compute_start), SteadyNs(compute_end)});
      }
      if (range.num_pages == 0) break;
    }
    KVF_LOG_DEBUG("prefill instance: room {} compute ended", room);
    auto done = c.Wait(room, RoomState::kSuccess, milliseconds(flags.timeout_ms));
    const auto success = Clock::now();
    KVF_LOG_DEBUG("prefill instance: room {} wait returned", room);
    double transfer_ms = std::chrono::duration<double, std::milli>(success - start).count();
    // The tail: from the last layer ready (end of compute) to the room's success.
    double tail_ms = std::chrono::duration<double, std::milli>(success - compute_end).count();
    double compute_ms = std::chrono::duration<double, std::milli>(compute_end - start).count();
    if (!done.ok() || done->state != RoomState::kSuccess) {
      return fail(
          done.ok() ? (done->error.ok() ? DeadlineExceededError("transfer timed out") : done->error)
                    : done.status());
    }
    c.Release(room).IgnoreError();
    Reply(res, 200,
          {{"ok", true},
           {"room", room},
           {"pages", num_pages},
           {"pages_sent", range.num_pages},
           {"transfer_ms", transfer_ms},
           {"compute_ms", compute_ms},
           {"tail_ms", tail_ms},
           {"compute_end_ns", SteadyNs(compute_end)},
           {"layers", model_layers},
           {"fill_ns", fill_ns},
           {"compute_ns", compute_ns},
           {"send_start_ns", send_start_ns}});
  });
  return in.Serve(info);
}

int RunDecodeInstance(const InstanceFlags& flags) {
  Instance in;
  DecodeConnectorOptions o;
  if (!StartInstance(flags, "decode", &in, &o.engine)) return 2;
  o.state_pool = in.state.get();
  o.tp_rank = flags.tp_rank;
  o.tp_size = flags.tp_size;
  o.kv_path = flags.kv_path;
  o.pull = flags.pull;
  auto staging = ParseByteSize(flags.staging_size);
  if (!staging.ok()) {
    std::fprintf(stderr, "kvferry decode: --staging-size: %s\n",
                 staging.status().message().c_str());
    return 2;
  }
  o.staging_bytes = *staging;
  o.bootstrap_timeout = o.waiting_timeout = milliseconds(flags.timeout_ms);
  auto conn = DecodeConnector::Create(o, in.pool.get(), in.aux.get());
  if (!conn.ok()) {
    std::fprintf(stderr, "kvferry decode: %s\n", conn.status().ToString().c_str());
    return 1;
  }
  DecodeConnector& c = **conn;
  auto info = [&] {
    json j = in.Info();
    j["role"] = "decode";
    j["engine_address"] = c.engine_address();
    return j;
  };
  auto stats = [&] {
    ConnectorStats st = c.stats();
    return json{{"bytes", st.bytes},
                {"transfer_requests", st.transfer_requests},
                {"rooms_succeeded", st.rooms_succeeded},
                {"rooms_failed", st.rooms_failed},
                {"rooms_done_by_mailbox", st.rooms_done_by_mailbox}};
  };
  in.AddCommonRoutes(info, stats,
                     [&] { return MetricsPage("decode", c.engine_metrics(), c.stats()); });
  in.server.Post("/decode", [&](const httplib::Request& req, httplib::Response& res) {
    auto admitted = Admit(in, req, res, /*decode=*/true);
    if (admitted == nullptr) return;
    const KvLayout& layout = *in.layout;
    const uint64_t room = admitted->room;
    const int64_t tokens = admitted->tokens, num_pages = admitted->num_pages;
    const std::vector<int32_t>* pages = &admitted->pages;
    const int32_t* row = &admitted->row;
    const std::string bootstrap = admitted->bootstrap_address;
    Status created = c.CreateReceiver(room, bootstrap, *pages, *row, admitted->state_slot);
    if (!created.ok()) {
      return Reply(res, HttpCode(created), {{"ok", false}, {"error", created.ToString()}});
    }
    auto done = c.Wait(room, RoomState::kSuccess, milliseconds(2 * flags.timeout_ms));
    if (!done.ok() || done->state != RoomState::kSuccess) {
      if (done.ok() && !IsFinal(done->state)) c.Abort(room, "decode gave up waiting").IgnoreError();
      auto st = c.Poll(room);
      std::string reason =
          st.ok() && !st->error.ok() ? st->error.ToString() : "room did not finish";
      c.Release(room).IgnoreError();
      json out = {{"ok", false}, {"error", reason}};
      if (flags.abort_every > 0 && in.on_gpu) {
        // Failure drill: nothing of the room may land once its failure is known here. A
        // sentinel pattern (another room's) goes over its pages; any page that changes within
        // the grace period was written late.
        const uint64_t sentinel = ~room;
        Status filled = in.Fill(sentinel, *pages, 0, tokens);
        std::this_thread::sleep_for(milliseconds(kLateWriteGraceMs));
        auto late = in.Verify(sentinel, *pages, tokens);
        if (!filled.ok() || !late.ok()) {
          out["error"] = reason + "; late-write check: " +
                         (!filled.ok() ? filled.ToString() : late.status().ToString());
        } else {
          out["late_writes"] = late->first;
          if (late->first > 0) out["first_late_write"] = late->second;
        }
      }
      return Reply(res, 500, out);
    }
    const auto verify_start = Clock::now();
    const auto success_time = done->final_time;  // when the room turned Success
    auto v = in.Verify(room, *pages, tokens);
    Status aux_ok = in.CheckAuxRow(*row, room);
    auto state_v = in.VerifyState(admitted->state_slot, room);
    c.Release(room).IgnoreError();
    if (!v.ok()) return Reply(res, 500, {{"ok", false}, {"error", v.status().ToString()}});
    if (!state_v.ok()) {
      return Reply(res, 500, {{"ok", false}, {"error", state_v.status().ToString()}});
    }
    const auto verify_end = Clock::now();
    const int64_t pages_mismatched = v->first;
    int64_t mismatched_pages = std::min<int64_t>(num_pages, pages_mismatched);
    json out = {
        {"ok", true},
        {"room", room},
        {"pages", num_pages},
        {"pages_verified", num_pages - mismatched_pages},
        {"verify_ms", std::chrono::duration<double, std::milli>(verify_end - verify_start).count()},
        {"verify_ns", {SteadyNs(verify_start), SteadyNs(verify_end)}},
        {"mismatches", pages_mismatched + (aux_ok.ok() ? 0 : 1) + state_v->pages_mismatched},
        {"success_ns", SteadyNs(success_time)},
        {"bytes", num_pages * layout.bytes_per_page_all_buffers() + in.aux->layout().row_bytes()}};
    if (pages_mismatched > 0) out["first_mismatch"] = v->second;
    if (!aux_ok.ok()) out["aux_error"] = aux_ok.ToString();
    if (!state_v->ok()) out["state_error"] = state_v->first_mismatch;
    if (in.state != nullptr) {
      out["bytes"] = out["bytes"].get<uint64_t>() + in.state_layout->bytes_per_slot_all_buffers();
    }
    Reply(res, 200, out);
  });
  return in.Serve(info);
}

}  // namespace kvferry::tools
