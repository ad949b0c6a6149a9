// `kvferry replay`: replays a request trace through a prefill and a decode instance and
// verifies every byte that lands in decode's pools.
#include <fcntl.h>
#include <httplib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "common/auth.h"
#include "common/checks.h"
#include "common/env.h"
#include "common/host_port.h"
#include "cuda/device_memory.h"
#include "disagg/http_auth.h"
#include "kvferry/faults.h"
#include "kvferry/tp_plan.h"
#include "tools/auth_flags.h"
#include "tools/child_instance.h"
#include "tools/commands.h"
#include "tools/flag_checks.h"
#include "tools/gpu/baselines.h"
#include "tools/instance.h"
#include "tools/stats.h"
#include "tools/time_breakdown.h"
#include "tools/trace.h"

namespace kvferry::tools {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr const char* kDemoTrace = "../shared/traces/conversation_trace.jsonl";
// Requests the demo replays unless --limit says otherwise: keeps `make demo` near a minute on
// a 2-core machine with the Llama-3.1-8B geometry (about 1.5 GiB of KV per request).
constexpr size_t kDemoLimit = 40;
// The most requests --synthetic generates (the whole conversation trace has about 12,000).
constexpr int64_t kMaxSyntheticRequests = 1'000'000;

struct ReplayFlags {
  std::string trace;
  int64_t synthetic = 0;
  bool synthetic_given = false;  // --synthetic was on the command line
  bool demo = false;
  int64_t limit = 0;
  int concurrency = 4;
  double time_scale = 0;  // 0: as fast as possible
  std::string json_path;
  std::string prefill_address;  // join a running prefill instance (control address)
  std::string decode_address;   // join a running decode instance
  std::string seed_text;        // --seed as typed
  uint64_t seed = 0;            // parsed from seed_text; 0: random
  int prefill_tp = 1;
  int decode_tp = 1;
  int prefill_cp = 1;
  std::string kv_path = "auto";
  std::string prefill_faults, decode_faults;  // fault plans of the instances started
  InstanceFlags instance;
  AuthFlags auth;  // for joined instances; ours get a fresh secret
};

// Pages both pools can hold at once; requests acquire their pages before they are sent, so
// neither instance ever waits on the other's memory (no allocation deadlock).
class PageBudget {
 public:
  explicit PageBudget(int64_t pages) : available_(pages) {}
  void Acquire(int64_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return available_ >= n; });
    available_ -= n;
  }
  void Release(int64_t n) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      available_ += n;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t available_;
};

struct Totals {
  std::atomic<uint64_t> done{0}, failed{0}, rejected{0}, tokens{0}, pages{0}, pages_verified{0},
      mismatches{0}, bytes{0}, aborted{0}, late_writes{0}, not_sent{0};
};

int Fail(const std::string& message) {
  std::fprintf(stderr, "kvferry replay: %s\n", message.c_str());
  return 2;
}

}  // namespace

int ReplayGpu(bool prefill, int index, int prefill_ranks, int decode_ranks, int gpu_count) {
  if (gpu_count <= 1) return 0;
  if (prefill_ranks + decode_ranks <= gpu_count) {
    return prefill ? index : prefill_ranks + index;
  }
  const int prefill_gpus = gpu_count / 2;
  return prefill ? index % prefill_gpus : prefill_gpus + index % (gpu_count - prefill_gpus);
}

namespace {

std::string Fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

int RunReplay(ReplayFlags flags) {
  std::signal(SIGPIPE, SIG_IGN);
  // Validate flags before starting anything.
  auto model = ResolveModel(flags.instance.model, flags.instance.model_config);
  if (!model.ok()) return Fail(model.status().message());
  auto pool_bytes = ParseByteSize(flags.instance.pool_size);
  if (!pool_bytes.ok()) return Fail("--pool-size: " + pool_bytes.status().message());
  if (auto staging = ParseByteSize(flags.instance.staging_size); !staging.ok()) {
    return Fail("--staging-size: " + staging.status().message());
  }
  const InstanceFlags& in = flags.instance;
  std::vector<Status> checks = {
      CheckFlagRange("--page-size", in.page_size, 1, kMaxPageSize),
      CheckFlagRange("--concurrency", flags.concurrency, 1, kInstanceHttpThreads),
      CheckFlagNumber("--time-scale", flags.time_scale, 0.0, 1e9),
      CheckFlagRange("--limit", flags.limit, 0),
      CheckFlagRange("--timeout-ms", in.timeout_ms, kMinTimeoutMs, kMaxTimeoutMs),
      CheckFlagRange("--chunk-tokens", in.chunk_tokens, 1, kMaxChunkTokens),
      CheckFlagRange("--compute-us-per-layer", in.compute_us_per_layer, 0, kMaxComputeUsPerLayer),
      CheckFlagRange("--prefill-tp", flags.prefill_tp, 1, kMaxParallelRanks),
      CheckFlagRange("--decode-tp", flags.decode_tp, 1, kMaxParallelRanks),
      CheckFlagRange("--prefill-cp", flags.prefill_cp, 1, kMaxParallelRanks),
      CheckFlagRange("--abort-every", in.abort_every, 0),
      ParseFaultPlan(flags.prefill_faults).status().WithContext("--prefill-faults"),
      ParseFaultPlan(flags.decode_faults).status().WithContext("--decode-faults")};
  if (flags.synthetic_given) {
    checks.push_back(CheckFlagRange("--synthetic", flags.synthetic, 1, kMaxSyntheticRequests));
  }
  for (const Status& checked : checks) {
    if (!checked.ok()) return Fail(checked.message());
  }
  if (!flags.seed_text.empty()) {
    auto seed = ParseUint64Flag("--seed", flags.seed_text);
    if (!seed.ok()) return Fail(seed.status().message());
    flags.seed = *seed;
  }
  if (flags.instance.abort_every > 0 &&
      (flags.instance.device != "cuda" || !flags.instance.layerwise ||
       flags.instance.compute_us_per_layer <= 0)) {
    return Fail("--abort-every needs --device cuda, --layerwise and --compute-us-per-layer > 0");
  }
  flags.instance.aux_rows = std::max(flags.instance.aux_rows, 2 * flags.concurrency);
  flags.instance.state_slots = std::max(flags.instance.state_slots, flags.concurrency + 1);
  int gpu_count = 0;
  if (flags.instance.device == "cuda") {
    Status one = cuda::CheckDevice(0);
    if (!one.ok()) return Fail("--device cuda: " + one.message());
    gpu_count = cuda::DeviceCount();
  } else if (flags.instance.device != "cpu") {
    return Fail("--device must be cpu or cuda, got '" + flags.instance.device + "'");
  }

  std::vector<TraceRequest> requests;
  std::string source;
  if (flags.demo && flags.limit == 0) flags.limit = static_cast<int64_t>(kDemoLimit);
  if (flags.demo && flags.trace.empty() && flags.synthetic == 0) {
    if (std::filesystem::exists(kDemoTrace)) {
      flags.trace = kDemoTrace;
    } else {
      flags.synthetic = flags.limit > 0 ? flags.limit : 40;
    }
  }
  if (!flags.trace.empty() && flags.synthetic > 0)
    return Fail("give --trace or --synthetic, not both");
  if (!flags.trace.empty()) {
    auto t = LoadTrace(flags.trace, static_cast<size_t>(flags.limit));
    if (!t.ok()) return Fail(t.status().message());
    requests = std::move(*t);
    source = flags.trace;
  } else if (flags.synthetic > 0) {
    requests = SyntheticTrace(static_cast<size_t>(flags.synthetic), flags.seed + 1);
    const size_t limit = static_cast<size_t>(flags.limit);
    if (limit > 0 && requests.size() > limit) requests.resize(limit);
    source = "synthetic (" + std::to_string(requests.size()) + " requests)";
  } else {
    return Fail("give --trace FILE, --synthetic N or --demo");
  }
  if (requests.empty()) return Fail("the workload has no requests");

  // Instances: join running ones or start our own, one process per attention TP rank.
  if (flags.kv_path != "auto" && flags.kv_path != "direct" && flags.kv_path != "staging" &&
      flags.kv_path != "fused") {
    return Fail("--kv-path " + flags.kv_path + ": must be auto, direct, staging or fused");
  }
  flags.instance.kv_path = flags.kv_path;
  {
    const int heads = model->attention == AttentionKind::kMla ? 1 : model->num_kv_heads;
    auto plan = PlanHeadSlices(heads, flags.prefill_tp, flags.decode_tp, model->attention);
    if (!plan.ok()) return Fail(plan.status().message());
  }
  std::vector<std::unique_ptr<ChildInstance>> children;
  std::vector<json> prefill_infos, decode_infos;
  // The shared secret: the given one for running instances we join; a fresh one for the
  // instances we start, which no other process needs to know.
  std::string secret;
  const bool joining = !flags.prefill_address.empty() || !flags.decode_address.empty();
  auto resolved = joining ? ResolveAuthFlags(flags.auth) : GenerateAuthSecret();
  if (!resolved.ok()) return Fail(resolved.status().message());
  secret = std::move(*resolved);
  if (joining) {
    if (flags.prefill_address.empty() || flags.decode_address.empty()) {
      return Fail("--prefill and --decode must be given together");
    }
    if (flags.prefill_tp != 1 || flags.decode_tp != 1 || flags.prefill_cp != 1) {
      return Fail("joining running instances supports one rank per side so far");
    }
    auto p = GetJson(flags.prefill_address, "/info", secret);
    if (!p.ok()) return Fail("--prefill: " + p.status().message());
    auto d = GetJson(flags.decode_address, "/info", secret);
    if (!d.ok()) return Fail("--decode: " + d.status().message());
    prefill_infos.push_back(*p);
    decode_infos.push_back(*d);
    if (p->value("page_size", 0) != d->value("page_size", -1)) {
      return Fail("prefill and decode instances use different page sizes");
    }
  } else {
    const int prefill_ranks = flags.prefill_tp * flags.prefill_cp;
    auto start_rank = [&](bool prefill, int rank, int size, const std::string& join, int cp_rank) {
      InstanceFlags f = flags.instance;
      if (gpu_count > 0) {
        const int index = prefill ? cp_rank * flags.prefill_tp + rank : rank;
        f.gpu = ReplayGpu(prefill, index, prefill_ranks, flags.decode_tp, gpu_count);
      }
      f.tp_rank = rank;
      f.tp_size = size;
      f.cp_rank = cp_rank;
      f.cp_size = prefill ? flags.prefill_cp : 1;
      f.join_bootstrap = join;
      f.faults = prefill ? flags.prefill_faults : flags.decode_faults;
      auto args = InstanceChildArgs(f, prefill, ::getpid());
      children.push_back(std::make_unique<ChildInstance>());
      Status st = children.back()->Start(prefill ? "prefill" : "decode", args, secret);
      if (!st.ok()) return st;
      (prefill ? prefill_infos : decode_infos).push_back(children.back()->info());
      return OkStatus();
    };
    // Prefill ranks in (cp, tp) order; rank 0 runs the bootstrap server, the rest join it.
    for (int cp = 0; cp < flags.prefill_cp; ++cp) {
      for (int r = 0; r < flags.prefill_tp; ++r) {
        std::string join =
            prefill_infos.empty() ? "" : prefill_infos[0]["bootstrap_address"].get<std::string>();
        if (Status st = start_rank(true, r, flags.prefill_tp, join, cp); !st.ok()) {
          return Fail(st.message());
        }
      }
    }
    for (int d = 0; d < flags.decode_tp; ++d) {
      if (Status st = start_rank(false, d, flags.decode_tp, "", 0); !st.ok()) {
        return Fail(st.message());
      }
    }
  }
  const json& prefill_info = prefill_infos[0];
  const int page_size = prefill_info["page_size"];
  // Whether every instance requires the shared secret (its engine, control and bootstrap
  // servers admit only peers that prove it).
  bool auth_required = true;
  for (const auto* infos : {&prefill_infos, &decode_infos}) {
    for (const json& j : *infos) auth_required = auth_required && j.value("auth_required", false);
  }
  int64_t pool_pages = INT64_MAX;  // a request must fit every rank's pool
  std::vector<std::string> prefill_ctl, decode_ctl;
  for (const json& j : prefill_infos) {
    pool_pages = std::min(pool_pages, j["pool_pages"].get<int64_t>());
    prefill_ctl.push_back(j["control_address"]);
  }
  for (const json& j : decode_infos) {
    pool_pages = std::min(pool_pages, j["pool_pages"].get<int64_t>());
    decode_ctl.push_back(j["control_address"]);
  }
  const std::string bootstrap = prefill_info["bootstrap_address"];
  for (const auto* list : {&prefill_ctl, &decode_ctl}) {
    for (const std::string& a : *list) {
      if (auto c = ControlClient(a, secret); !c.ok()) {
        return Fail("instance control address: " + c.status().message());
      }
    }
  }

  std::fprintf(stderr,
               "kvferry replay: %zu requests from %s | model %s, page size %d, %lld pages per "
               "pool (%s), concurrency %d, transport %s\n",
               requests.size(), source.c_str(), prefill_info["model"].get<std::string>().c_str(),
               page_size, static_cast<long long>(pool_pages),
               FormatBytes(prefill_info["pool_bytes"].get<uint64_t>()).c_str(), flags.concurrency,
               flags.instance.transport.c_str());

  std::mt19937_64 rng(flags.seed ? flags.seed : std::random_device{}());
  const uint64_t room_base = rng() & ~0xFFFFFFull;  // rooms unique across runs
  PageBudget budget(pool_pages);
  Totals totals;
  std::vector<std::atomic<uint64_t>> pages_sent_per_cp(static_cast<size_t>(flags.prefill_cp));
  LatencyRecorder latency, tail, tail_decode, ttft, transfer_per_layer;
  // Where the wall time goes: only with instances of our own, which share this host's clock.
  PhaseTimeline timeline;
  std::atomic<bool> timeline_complete{!joining};
  std::mutex errors_mu;
  std::vector<std::string> errors;
  ProgressBar progress("replay", requests.size());
  std::atomic<size_t> next{0};
  const auto start = Clock::now();

  const time_t read_timeout = static_cast<time_t>(3 * flags.instance.timeout_ms / 1000 + 10);
  // Each worker's clients, made here so that an early stop can cut off their calls.
  auto make_clients = [&](const std::vector<std::string>& addresses) {
    std::vector<std::unique_ptr<httplib::Client>> clients;
    for (const std::string& a : addresses) {
      clients.push_back(std::move(*ControlClient(a, secret)));  // validated above
      clients.back()->set_read_timeout(read_timeout);
    }
    return clients;
  };
  std::vector<std::vector<std::unique_ptr<httplib::Client>>> worker_prefill, worker_decode;
  for (int w = 0; w < flags.concurrency; ++w) {
    worker_prefill.push_back(make_clients(prefill_ctl));
    worker_decode.push_back(make_clients(decode_ctl));
  }
  // An early stop (an instance died or refuses connections): no request starts any more, and
  // the watcher cuts off calls in flight. The first reason is kept, except that how an
  // instance ended (`ended`) replaces a refused connection.
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  std::atomic<bool> stopping{false};
  std::string stop_reason;
  bool stop_reason_ended = false;
  bool workers_done = false;
  auto stop_early = [&](const std::string& why, bool ended) {
    std::lock_guard<std::mutex> lock(stop_mu);
    if (stop_reason.empty() || (ended && !stop_reason_ended)) {
      stop_reason = why;
      stop_reason_ended = ended;
    }
    stopping = true;
    stop_cv.notify_all();
  };
  auto check_children = [&] {
    for (auto& child : children) {
      std::string how;
      if (child->Ended(&how)) stop_early(how, /*ended=*/true);
    }
  };
  auto worker = [&](int w) {
    auto& prefill_clients = worker_prefill[static_cast<size_t>(w)];
    auto& decode_clients = worker_decode[static_cast<size_t>(w)];
    while (true) {
      size_t i = next++;
      if (i >= requests.size()) return;
      const TraceRequest& r = requests[i];
      auto finish_one = [&] { progress.Update(++totals.done, totals.bytes.load()); };
      if (stopping) {
        ++totals.failed;
        ++totals.not_sent;
        finish_one();
        continue;
      }
      auto arrival = Clock::now();
      if (flags.time_scale > 0) {
        auto due = start + std::chrono::microseconds(
                               static_cast<int64_t>(r.timestamp_ms * 1000.0 / flags.time_scale));
        {
          std::unique_lock<std::mutex> lock(stop_mu);
          stop_cv.wait_until(lock, due, [&] { return stopping.load(); });
        }
        if (stopping) {
          ++totals.failed;
          ++totals.not_sent;
          finish_one();
          continue;
        }
        arrival = due;
      }
      const int64_t pages = r.input_length / page_size + (r.input_length % page_size != 0);
      if (pages > pool_pages) {
        ++totals.rejected;
        finish_one();
        continue;
      }
      budget.Acquire(pages);
      const uint64_t room = room_base + i;
      json body = {{"room", room}, {"input_length", r.input_length}};
      json dbody = body;
      dbody["bootstrap_address"] = bootstrap;
      // Every rank of both sides takes part in every request.
      std::vector<std::future<httplib::Result>> calls;
      for (auto& c : decode_clients) {
        calls.push_back(std::async(std::launch::async, [&c, d = dbody.dump()] {
          return c->Post("/decode", d, "application/json");
        }));
      }
      for (auto& c : prefill_clients) {
        calls.push_back(std::async(std::launch::async, [&c, p = body.dump()] {
          return c->Post("/prefill", p, "application/json");
        }));
      }
      std::vector<httplib::Result> results;
      for (auto& call : calls) results.push_back(call.get());
      const auto answered = Clock::now();
      budget.Release(pages);
      const size_t num_decode = decode_clients.size();
      bool rejected = false, ok = true;
      std::string why;
      std::vector<json> bodies;
      for (size_t k = 0; k < results.size(); ++k) {
        const std::string who = (k < num_decode ? "decode rank " + std::to_string(k)
                                                : "prefill rank " + std::to_string(k - num_decode));
        const auto& res = results[k];
        bodies.push_back(res ? json::parse(res->body, nullptr, false) : json());
        if (res && res->status == 413) rejected = true;
        if (!res && res.error() == httplib::Error::Connection) {
          // Nobody listens there any more: the other requests would only wait out timeouts.
          const std::string& at = k < num_decode ? decode_ctl[k] : prefill_ctl[k - num_decode];
          stop_early(who + " at " + at + " refuses connections", /*ended=*/false);
        }
        if (!res || res->status != 200 || !bodies.back().value("ok", false)) {
          if (ok) {
            why = !res ? who + " unreachable (" + httplib::to_string(res.error()) + ")"
                       : who + ": " + bodies.back().value("error", res->body);
          }
          ok = false;
        }
      }
      // Failure drill (--abort-every): a room prefill aborted on purpose is not a failure;
      // what counts is whether anything of it landed after decode heard of the abort.
      bool drilled = false;
      for (size_t k = 0; k < bodies.size(); ++k) {
        if (k >= num_decode && bodies[k].is_object() &&
            bodies[k].value("error", std::string()).find("--abort-every drill") !=
                std::string::npos) {
          drilled = true;
        }
      }
      if (drilled) {
        ++totals.aborted;
        for (size_t k = 0; k < num_decode; ++k) {
          if (!bodies[k].is_object()) continue;
          const uint64_t late = bodies[k].value("late_writes", 0ull);
          totals.late_writes += late;
          if (late > 0) {
            std::lock_guard<std::mutex> lock(errors_mu);
            errors.push_back("request " + std::to_string(i) + " (room " + std::to_string(room) +
                             ", aborted): " + std::to_string(late) +
                             " pages written after decode "
                             "heard of the abort, first: " +
                             bodies[k].value("first_late_write", std::string("?")));
          }
        }
      } else if (rejected) {
        ++totals.rejected;
      } else if (!ok) {
        ++totals.failed;
        std::lock_guard<std::mutex> lock(errors_mu);
        errors.push_back("request " + std::to_string(i) + " (room " + std::to_string(room) +
                         "): " + why);
      } else {
        totals.tokens += static_cast<uint64_t>(r.input_length);
        totals.pages += static_cast<uint64_t>(pages);
        // A page counts as verified when every decode rank verified its heads of it.
        uint64_t verified = static_cast<uint64_t>(pages), mism = 0;
        double transfer_ms = 0, tail_ms = 0, verify_ms = 0, per_layer_ms = 0;
        // Steady-clock ns: the last decode rank's room success, the last prefill rank's end
        // of compute (processes of one host share the clock).
        int64_t decode_success_ns = 0, compute_end_ns = 0;
        std::string first;
        for (size_t k = 0; k < bodies.size(); ++k) {
          const json& j = bodies[k];
          if (k < num_decode) {
            verified = std::min<uint64_t>(verified, j.value("pages_verified", 0ull));
            uint64_t m = j.value("mismatches", 0ull);
            if (m > 0 && first.empty()) {
              first = j.value("first_mismatch",
                              j.value("aux_error", j.value("state_error", std::string("?"))));
            }
            mism += m;
            totals.bytes += j.value("bytes", 0ull);
            decode_success_ns =
                std::max<int64_t>(decode_success_ns, j.value("success_ns", int64_t{0}));
            verify_ms = std::max(verify_ms, j.value("verify_ms", 0.0));
          } else {
            transfer_ms = std::max(transfer_ms, j.value("transfer_ms", 0.0));
            tail_ms = std::max(tail_ms, j.value("tail_ms", 0.0));
            compute_end_ns =
                std::max<int64_t>(compute_end_ns, j.value("compute_end_ns", int64_t{0}));
            // Without layerwise transfer the whole transfer runs after compute: its tail over
            // the layer count is the transfer time of one layer.
            per_layer_ms =
                std::max(per_layer_ms, j.value("tail_ms", 0.0) / std::max(1, j.value("layers", 1)));
            // Prefill ranks are in (cp, tp) order.
            // Every TP rank of a CP rank covers the same page range (its heads of it): count
            // the range once, from TP rank 0.
            const size_t cp = (k - num_decode) / static_cast<size_t>(flags.prefill_tp);
            if ((k - num_decode) % static_cast<size_t>(flags.prefill_tp) == 0) {
              pages_sent_per_cp[cp] += j.value("pages_sent", 0ull);
            }
          }
        }
        totals.pages_verified += verified;
        totals.mismatches += mism;
        if (timeline_complete && !timeline.AddReplayRequest(bodies, num_decode)) {
          timeline_complete = false;
        }
        latency.Add(transfer_ms);
        tail.Add(tail_ms);
        if (decode_success_ns > 0 && compute_end_ns > 0) {
          tail_decode.Add(
              std::max<double>(0.0, static_cast<double>(decode_success_ns - compute_end_ns) / 1e6));
        }
        transfer_per_layer.Add(per_layer_ms);
        // Arrival to decode success: decode answers after verifying, which is not transfer.
        ttft.Add(std::max(
            0.0,
            std::chrono::duration<double, std::milli>(answered - arrival).count() - verify_ms));
        if (mism > 0) {
          std::lock_guard<std::mutex> lock(errors_mu);
          errors.push_back("request " + std::to_string(i) + " (room " + std::to_string(room) +
                           "): " + std::to_string(mism) + " mismatched pages, first: " + first);
        }
      }
      finish_one();
    }
  };
  // The watcher: every 100 ms, whether every instance this replay started still runs; once
  // the run stops early, it cuts off the calls in flight (again each round, for calls that
  // started meanwhile) until the workers are done.
  std::thread watcher([&] {
    while (true) {
      {
        std::unique_lock<std::mutex> lock(stop_mu);
        stop_cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return workers_done; });
        if (workers_done) return;
      }
      check_children();
      if (!stopping) continue;
      for (auto* side : {&worker_prefill, &worker_decode}) {
        for (auto& clients : *side) {
          for (auto& c : clients) c->stop();
        }
      }
    }
  });
  std::vector<std::thread> workers;
  for (int w = 0; w < flags.concurrency; ++w) workers.emplace_back(worker, w);
  for (auto& t : workers) t.join();
  {
    std::lock_guard<std::mutex> lock(stop_mu);
    workers_done = true;
    stop_cv.notify_all();
  }
  watcher.join();
  // An instance of ours that refuses connections is most likely ending: say how it ended.
  for (int i = 0; i < 10 && stopping && !stop_reason_ended && !children.empty(); ++i) {
    check_children();
    if (!stop_reason_ended) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const auto finish = Clock::now();
  const double seconds = std::chrono::duration<double>(finish - start).count();
  progress.Finish();

  // One counter of the instances' /stats, summed (an instance that does not answer adds 0).
  auto sum_stat = [&secret](const std::vector<std::string>& ctls, const char* key) {
    uint64_t sum = 0;
    for (const std::string& ctl : ctls) {
      if (auto st = GetJson(ctl, "/stats", secret); st.ok()) sum += st->value(key, 0ull);
    }
    return sum;
  };
  const uint64_t transfer_requests = sum_stat(prefill_ctl, "transfer_requests");
  const uint64_t done_by_mailbox = sum_stat(decode_ctl, "rooms_done_by_mailbox");
  const uint64_t pulled_requests = sum_stat(decode_ctl, "transfer_requests");
  if (stopping) {
    std::fprintf(stderr, "kvferry replay: stopped early: %s; %llu requests not sent\n",
                 stop_reason.c_str(), static_cast<unsigned long long>(totals.not_sent.load()));
  }
  for (auto& child : children) {
    // After an early stop the survivors hold rooms that cannot finish: they would wait out
    // their timeouts before they could shut down.
    if (stopping) {
      child->Kill();
    } else {
      child->Stop();
    }
  }

  const double gbps = seconds > 0 ? static_cast<double>(totals.bytes.load()) / seconds / 1e9 : 0;
  auto steady_ns = [](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  };
  const TimeBreakdown breakdown = timeline.Summarize(steady_ns(start), steady_ns(finish));
  const double transfer_gbps = TransferOnlyGbps(totals.bytes.load(), breakdown);
  json out = {
      {"requests", requests.size()},
      {"requests_failed", totals.failed.load()},
      {"requests_rejected", totals.rejected.load()},
      {"requests_aborted", totals.aborted.load()},
      {"requests_not_sent", totals.not_sent.load()},
      {"stopped_early", stop_reason},
      {"late_writes", totals.late_writes.load()},
      {"tokens", totals.tokens.load()},
      {"pages", totals.pages.load()},
      {"pages_verified", totals.pages_verified.load()},
      {"mismatches", totals.mismatches.load()},
      {"bytes", totals.bytes.load()},
      {"seconds", seconds},
      {"gbps", gbps},
      {"transfer_gbps", timeline_complete ? json(transfer_gbps) : json()},
      {"time_breakdown", timeline_complete ? TimeBreakdownJson(breakdown) : json()},
      {"transfer_latency_ms",
       {{"p50", latency.Percentile(50)},
        {"p90", latency.Percentile(90)},
        {"p99", latency.Percentile(99)}}},
      {"transfer_requests", transfer_requests},
      {"rooms_done_by_mailbox", done_by_mailbox},
      {"layerwise", flags.instance.layerwise},
      {"compute_us_per_layer", flags.instance.compute_us_per_layer},
      {"tail_ms", {{"p50", tail.Percentile(50)}, {"p99", tail.Percentile(99)}}},
      {"tail_to_decode_ms",
       {{"p50", tail_decode.Percentile(50)}, {"p99", tail_decode.Percentile(99)}}},
      {"ttft_ms", {{"p50", ttft.Percentile(50)}, {"p99", ttft.Percentile(99)}}},
      {"tail_per_layer_ms", {{"p50", transfer_per_layer.Percentile(50)}}},
      {"model", prefill_info["model"]},
      {"page_size", page_size},
      {"concurrency", flags.concurrency},
      {"transport", flags.instance.transport},
      {"device", flags.instance.device},
      {"prefill_tp", flags.prefill_tp},
      {"decode_tp", flags.decode_tp},
      {"kv_path", flags.kv_path},
      {"pull", flags.instance.pull},
      {"pulled_requests", pulled_requests},
      {"prefill_cp", flags.prefill_cp},
      {"pages_sent_per_cp_rank",
       [&] {
         json list = json::array();
         for (auto& p : pages_sent_per_cp) list.push_back(p.load());
         return list;
       }()},
      {"trace", source},
      {"auth_required", auth_required},
  };
  std::vector<std::vector<std::string>> rows = {
      {"metric", "value"},
      {"requests", std::to_string(requests.size())},
      {"requests failed", std::to_string(totals.failed.load())},
      {"requests rejected (larger than pool)", std::to_string(totals.rejected.load())},
      {"requests aborted (--abort-every drill)", std::to_string(totals.aborted.load())},
      {"requests not sent (stopped early)", std::to_string(totals.not_sent.load())},
      {"pages written after an abort was known", std::to_string(totals.late_writes.load())},
      {"tokens", std::to_string(totals.tokens.load())},
      {"pages", std::to_string(totals.pages.load())},
      {"pages verified", std::to_string(totals.pages_verified.load())},
      {"mismatches", std::to_string(totals.mismatches.load())},
      {"bytes delivered", FormatBytes(totals.bytes.load())},
      {"seconds", Fixed(seconds, 2)},
      {"throughput (GB/s)", Fixed(gbps, 2)},
      {"transfer latency p50/p90/p99 (ms)", Fixed(latency.Percentile(50), 1) + " / " +
                                                Fixed(latency.Percentile(90), 1) + " / " +
                                                Fixed(latency.Percentile(99), 1)},
      {"engine transfer requests", std::to_string(transfer_requests)},
      {"rooms done by mailbox", std::to_string(done_by_mailbox)},
      {std::string("tail after last layer p50/p99 (ms)") +
           (flags.instance.layerwise ? ", layerwise" : ""),
       Fixed(tail.Percentile(50), 2) + " / " + Fixed(tail.Percentile(99), 2)},
      {"tail to decode's room success p50/p99 (ms)",
       Fixed(tail_decode.Percentile(50), 2) + " / " + Fixed(tail_decode.Percentile(99), 2)},
      {"TTFT (arrival to decode success) p50/p99 (ms)",
       Fixed(ttft.Percentile(50), 1) + " / " + Fixed(ttft.Percentile(99), 1)},
  };
  if (timeline_complete) {
    for (auto& row : TimeBreakdownRows(breakdown, transfer_gbps)) rows.push_back(std::move(row));
  }
  std::printf("%s", RenderTable(rows).c_str());
  for (size_t i = 0; i < errors.size() && i < 10; ++i) {
    std::fprintf(stderr, "kvferry replay: %s\n", errors[i].c_str());
  }
  if (errors.size() > 10)
    std::fprintf(stderr, "kvferry replay: ... %zu more\n", errors.size() - 10);
  if (!flags.json_path.empty()) {
    std::ofstream f(flags.json_path);
    f << out.dump(2) << "\n";
    if (!f) return Fail("cannot write --json file " + flags.json_path);
  }
  return stopping || totals.failed.load() > 0 || totals.mismatches.load() > 0 ||
                 totals.late_writes.load() > 0
             ? 1
             : 0;
}

}  // namespace

void AddReplayCommand(CLI::App& app, RunFn* run) {
  auto flags = std::make_shared<ReplayFlags>();
  auto* cmd = app.add_subcommand(
      "replay",
      "Replay a request trace through prefill and decode instances, verifying every byte");
  cmd->add_option("--trace", flags->trace, "Mooncake-format JSONL trace");
  CLI::Option* synthetic = cmd->add_option("--synthetic", flags->synthetic,
                                           "Generate N requests with trace-like lengths");
  cmd->add_flag("--demo", flags->demo,
                std::string("Embedded default: ") + kDemoTrace + " when present, else synthetic");
  cmd->add_option("--model", flags->instance.model, "Model preset (KV geometry)")
      ->capture_default_str();
  cmd->add_option("--model-config", flags->instance.model_config,
                  "Hugging Face config.json (overrides --model)");
  cmd->add_option("--limit", flags->limit, "Replay at most N requests (0 = all)");
  cmd->add_option("--page-size", flags->instance.page_size, "Tokens per KV page")
      ->capture_default_str();
  cmd->add_option("--concurrency", flags->concurrency, "Requests in flight")->capture_default_str();
  cmd->add_option("--time-scale", flags->time_scale,
                  "Honour arrival times, X times faster (default: as fast as possible)");
  cmd->add_option("--pool-size", flags->instance.pool_size, "KV pool bytes per side")
      ->capture_default_str();
  cmd->add_option("--transport", flags->instance.transport, "Transport: auto, tcp, ucx or nvlink")
      ->capture_default_str();
  cmd->add_option("--chunk-tokens", flags->instance.chunk_tokens, "Tokens per prefill chunk")
      ->capture_default_str();
  cmd->add_option("--timeout-ms", flags->instance.timeout_ms, "Bootstrap/waiting/transfer timeout")
      ->capture_default_str();
  cmd->add_flag("--layerwise", flags->instance.layerwise,
                "Send each layer's KV as soon as it is computed (layerwise transfer)");
  cmd->add_option("--compute-us-per-layer", flags->instance.compute_us_per_layer,
                  "Simulate prefill compute per model layer (a sleep), in microseconds")
      ->capture_default_str();
  cmd->add_option("--json", flags->json_path, "Write the summary as JSON");
  cmd->add_option("--prefill", flags->prefill_address,
                  "Join a running prefill instance (its control host:port)");
  cmd->add_option("--decode", flags->decode_address,
                  "Join a running decode instance (its control host:port)");
  cmd->add_option("--seed", flags->seed_text, "Seed for rooms and the synthetic workload");
  AddAuthFlags(cmd, &flags->auth);
  cmd->add_option("--prefill-tp", flags->prefill_tp,
                  "Prefill attention TP size (one process per rank, each with its heads)")
      ->capture_default_str();
  cmd->add_option("--decode-tp", flags->decode_tp, "Decode attention TP size")
      ->capture_default_str();
  cmd->add_option("--prefill-cp", flags->prefill_cp,
                  "Prefill context-parallel size: each CP rank (a process) sends its pages")
      ->capture_default_str();
  cmd->add_flag("--cp-rank0-only", flags->instance.cp_rank0_only,
                "Old behaviour: CP rank 0 sends every page, the others only report");
  cmd->add_option("--abort-every", flags->instance.abort_every,
                  "Failure drill (--device cuda --layerwise with compute): prefill aborts rooms "
                  "whose id is a multiple of N halfway through their layers; decode checks that "
                  "nothing of them lands after it heard of the abort (JSON late_writes)");
  cmd->add_option("--prefill-faults", flags->prefill_faults,
                  "Fault-injection plan of the prefill instances' engines (kvferry/faults.h), "
                  "e.g. drop=0.01,fail=0.02");
  cmd->add_option("--decode-faults", flags->decode_faults,
                  "Fault-injection plan of the decode instances' engines");
  cmd->add_option("--staging-size", flags->instance.staging_size,
                  "Decode staging ring bytes for --kv-path staging")
      ->capture_default_str();
  cmd->add_option(
         "--kv-path", flags->kv_path,
         "Unequal-TP data path: auto (staging for host pools, fused for GPU pools), direct, "
         "staging or fused")
      ->capture_default_str();
  cmd->add_flag("--pull", flags->instance.pull,
                "Decode READs each batch from prefill's pools (prefill plans the copies) instead "
                "of prefill WRITing it: copy kernels on decode's GPU");
  cmd->add_option("--device", flags->instance.device,
                  "Pools on cpu, or on cuda (each rank its own GPU where they fit, see ReplayGpu; "
                  "verified on the GPU)")
      ->capture_default_str();
  cmd->callback([run, flags, synthetic] {
    flags->synthetic_given = synthetic->count() > 0;
    *run = [flags] { return RunReplay(*flags); };
  });
}

}  // namespace kvferry::tools
