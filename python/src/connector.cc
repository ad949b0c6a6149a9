#include "connector.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "connector_docs.h"
#include "engine_holder.h"
#include "errors.h"
#include "kvferry/bootstrap.h"
#include "kvferry/connector.h"
#include "kvferry/faults.h"
#include "metrics.h"
#include "wait_slices.h"

namespace kvferry::python {
namespace {

namespace py = pybind11;
using std::chrono::milliseconds;
using I32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// Pops `key` from `d` as T, or `fallback` when absent; leftover keys are refused by the caller.
template <typename T>
T Take(py::dict& d, const char* key, T fallback) {
  if (!d.contains(key)) return fallback;
  py::object value = d[key];
  PyDict_DelItemString(d.ptr(), key);
  try {
    return value.cast<T>();
  } catch (const py::cast_error&) {
    throw StatusError(InvalidArgumentError(std::string("'") + key + "' has the wrong type (" +
                                           std::string(Py_TYPE(value.ptr())->tp_name) + ")"));
  }
}

void RefuseLeftovers(const py::dict& d, const char* what) {
  if (d.empty()) return;
  std::string keys;
  for (auto item : d) {
    if (!keys.empty()) keys += ", ";
    keys += py::str(item.first).cast<std::string>();
  }
  throw StatusError(InvalidArgumentError(std::string("unknown ") + what + " keys: " + keys));
}

DType DTypeOf(const std::string& text) { return ValueOrThrow(ParseDType(text)); }

ModelGeometry GeometryFromDict(py::dict in) {
  py::dict d = in.attr("copy")();
  ModelGeometry g;
  g.name = Take<std::string>(d, "name", "");
  const std::string attention = Take<std::string>(d, "attention", "mha");
  if (attention == "mla") {
    g.attention = AttentionKind::kMla;
  } else if (attention != "mha") {
    throw StatusError(
        InvalidArgumentError("attention must be 'mha' or 'mla', got '" + attention + "'"));
  }
  g.num_layers = Take<int>(d, "num_layers", 0);
  g.num_attention_heads = Take<int>(d, "num_attention_heads", 0);
  g.num_kv_heads = Take<int>(d, "num_kv_heads", 0);
  g.head_dim = Take<int>(d, "head_dim", 0);
  g.kv_lora_rank = Take<int>(d, "kv_lora_rank", 0);
  g.qk_rope_head_dim = Take<int>(d, "qk_rope_head_dim", 0);
  g.hidden_size = Take<int>(d, "hidden_size", 0);
  g.dtype = DTypeOf(Take<std::string>(d, "dtype", "bfloat16"));
  g.num_linear_layers = Take<int>(d, "num_linear_layers", 0);
  g.full_attention_interval = Take<int>(d, "full_attention_interval", 0);
  g.linear_num_key_heads = Take<int>(d, "linear_num_key_heads", 0);
  g.linear_num_value_heads = Take<int>(d, "linear_num_value_heads", 0);
  g.linear_key_head_dim = Take<int>(d, "linear_key_head_dim", 0);
  g.linear_value_head_dim = Take<int>(d, "linear_value_head_dim", 0);
  g.linear_conv_kernel_dim = Take<int>(d, "linear_conv_kernel_dim", 0);
  g.linear_state_dtype = DTypeOf(Take<std::string>(d, "linear_state_dtype", "float32"));
  RefuseLeftovers(d, "geometry");
  return g;
}

py::dict GeometryDict(const ModelGeometry& g) {
  py::dict d;
  d["name"] = g.name;
  d["attention"] = g.attention == AttentionKind::kMla ? "mla" : "mha";
  d["num_layers"] = g.num_layers;
  d["num_attention_heads"] = g.num_attention_heads;
  d["num_kv_heads"] = g.num_kv_heads;
  d["head_dim"] = g.head_dim;
  d["kv_lora_rank"] = g.kv_lora_rank;
  d["qk_rope_head_dim"] = g.qk_rope_head_dim;
  d["hidden_size"] = g.hidden_size;
  d["dtype"] = std::string(DTypeName(g.dtype));
  d["num_linear_layers"] = g.num_linear_layers;
  d["full_attention_interval"] = g.full_attention_interval;
  d["linear_num_key_heads"] = g.linear_num_key_heads;
  d["linear_num_value_heads"] = g.linear_num_value_heads;
  d["linear_key_head_dim"] = g.linear_key_head_dim;
  d["linear_value_head_dim"] = g.linear_value_head_dim;
  d["linear_conv_kernel_dim"] = g.linear_conv_kernel_dim;
  d["linear_state_dtype"] = std::string(DTypeName(g.linear_state_dtype));
  return d;
}

EngineOptions EngineOptionsFromDict(const py::object& in) {
  EngineOptions o;
  if (in.is_none()) return o;
  py::dict d = py::dict(in).attr("copy")();
  o.name = Take<std::string>(d, "name", "");
  o.listen_host = Take<std::string>(d, "listen_host", o.listen_host);
  o.listen_port = Take<uint16_t>(d, "listen_port", 0);
  o.transport = Take<std::string>(d, "transport", o.transport);
  o.default_deadline = Millis(Take<double>(d, "default_deadline", 30.0), "default_deadline");
  o.connect_timeout = Millis(Take<double>(d, "connect_timeout", 5.0), "connect_timeout");
  o.auth_secret = Take<std::string>(d, "auth_secret", "");
  o.insecure = Take<bool>(d, "insecure", false);
  o.tcp_lanes_per_peer = Take<int>(d, "tcp_lanes_per_peer", o.tcp_lanes_per_peer);
  o.faults = ValueOrThrow(ParseFaultPlan(Take<std::string>(d, "faults", "")));
  RefuseLeftovers(d, "engine option");
  return o;
}

MemoryLocation LocationOf(std::optional<int> device) {
  if (!device) return MemoryLocation{};
  if (*device < 0) {
    throw StatusError(InvalidArgumentError("device must be a CUDA ordinal >= 0 or None, got " +
                                           std::to_string(*device)));
  }
  return MemoryLocation{MemoryKind::kCuda, *device};
}

std::vector<uint8_t*> Pointers(const std::vector<uint64_t>& addresses) {
  std::vector<uint8_t*> out;
  out.reserve(addresses.size());
  for (uint64_t a : addresses) out.push_back(reinterpret_cast<uint8_t*>(a));
  return out;
}

// What both connectors are made over: the caller's KV, aux and state buffers, wrapped.
struct PoolArgs {
  py::dict geometry;
  int page_size = 0;
  int32_t num_pages = 0;
  std::vector<uint64_t> kv_bases;
  std::vector<uint32_t> aux_field_bytes;
  std::vector<uint64_t> aux_bases;
  int32_t num_aux_rows = 0;
  int aux_room_field = -1;
  std::vector<uint64_t> state_bases;
  int32_t num_state_slots = 0;
  int tp_size = 1;
  std::optional<int> device;      // of the KV and state buffers
  std::optional<int> aux_device;  // of the aux fields
};

struct Pools {
  std::unique_ptr<KvPool> kv;
  std::unique_ptr<AuxBuffer> aux;
  std::unique_ptr<StatePool> state;
};

Pools WrapPools(const PoolArgs& a) {
  const ModelGeometry geometry = GeometryFromDict(a.geometry);
  const MemoryLocation location = LocationOf(a.device);
  Pools p;
  const KvLayout layout = ValueOrThrow(KvLayout::Create(geometry, a.page_size));
  const std::vector<uint8_t*> kv = Pointers(a.kv_bases);
  p.kv = ValueOrThrow(KvPool::Wrap(layout, a.num_pages, kv, location));
  const int room_field =
      a.aux_room_field < 0 ? static_cast<int>(a.aux_field_bytes.size()) - 1 : a.aux_room_field;
  const AuxLayout aux_layout = ValueOrThrow(AuxLayout::FromFields(a.aux_field_bytes, room_field));
  const std::vector<uint8_t*> aux = Pointers(a.aux_bases);
  p.aux = ValueOrThrow(AuxBuffer::Wrap(aux_layout, a.num_aux_rows, aux, LocationOf(a.aux_device)));
  if (!a.state_bases.empty()) {
    const StateLayout state_layout = ValueOrThrow(StateLayout::Create(geometry, a.tp_size));
    const std::vector<uint8_t*> state = Pointers(a.state_bases);
    p.state = ValueOrThrow(StatePool::Wrap(state_layout, a.num_state_slots, state, location));
  }
  return p;
}

py::tuple StatusTuple(const RoomStatus& s) {
  return py::make_tuple(static_cast<int>(s.state), ErrorObject(s.error));
}

py::dict StatsDict(const ConnectorStats& s) {
  py::dict d;
  d["transfer_requests"] = s.transfer_requests;
  d["bytes"] = s.bytes;
  d["rooms_succeeded"] = s.rooms_succeeded;
  d["rooms_failed"] = s.rooms_failed;
  py::dict by_code;
  for (size_t c = 0; c < kNumStatusCodes; ++c) {
    if (s.rooms_failed_by_code[c] == 0) continue;
    by_code[py::str(std::string(StatusCodeName(static_cast<StatusCode>(c))))] =
        s.rooms_failed_by_code[c];
  }
  d["rooms_failed_by_code"] = std::move(by_code);
  d["rooms_done_by_mailbox"] = s.rooms_done_by_mailbox;
  d["control_messages_refused"] = s.control_messages_refused;
  return d;
}

std::span<const int32_t> Pages(const I32Array& pages) {
  if (pages.ndim() != 1) {
    throw StatusError(InvalidArgumentError("page indices must be one-dimensional, got " +
                                           std::to_string(pages.ndim()) + " dimensions"));
  }
  return {pages.data(), static_cast<size_t>(pages.size())};
}

// The longest one connector Wait call blocks inside the Python binding's wait.
constexpr milliseconds kWaitSlice{50};

// A connector and the pools it sends from or lands in. Calls hold a shared lock without the
// GIL; Close takes it exclusively, so the connector stops before the pools go. Once Close
// began, new calls fail at once, and a wait (done in slices of kWaitSlice) ends within one
// slice, so Close is not held for a wait's whole timeout.
template <typename Connector>
class Holder {
 public:
  Holder(Pools pools, std::unique_ptr<Connector> connector)
      : pools_(std::move(pools)), connector_(std::move(connector)) {}
  ~Holder() { Close(); }

  template <typename F>
  auto Call(F&& f) {
    py::gil_scoped_release release;
    if (closing_.load()) throw StatusError(FailedPreconditionError("the connector is closed"));
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (!connector_) throw StatusError(FailedPreconditionError("the connector is closed"));
    return f(*connector_);
  }

  void Close() {
    closing_.store(true);
    py::gil_scoped_release release;
    std::unique_lock<std::shared_mutex> lock(mu_);
    connector_.reset();
    pools_ = Pools{};
  }

 private:
  std::atomic<bool> closing_{false};
  std::shared_mutex mu_;
  Pools pools_;
  std::unique_ptr<Connector> connector_;
};

using PyPrefill = Holder<PrefillConnector>;
using PyDecode = Holder<DecodeConnector>;

PoolArgs PoolArgsOf(py::dict geometry, int page_size, int32_t num_pages,
                    std::vector<uint64_t> kv_bases, std::vector<uint32_t> aux_field_bytes,
                    std::vector<uint64_t> aux_bases, int32_t num_aux_rows, int aux_room_field,
                    std::vector<uint64_t> state_bases, int32_t num_state_slots, int tp_size,
                    std::optional<int> device, std::optional<int> aux_device) {
  PoolArgs a;
  a.geometry = std::move(geometry);
  a.page_size = page_size;
  a.num_pages = num_pages;
  a.kv_bases = std::move(kv_bases);
  a.aux_field_bytes = std::move(aux_field_bytes);
  a.aux_bases = std::move(aux_bases);
  a.num_aux_rows = num_aux_rows;
  a.aux_room_field = aux_room_field;
  a.state_bases = std::move(state_bases);
  a.num_state_slots = num_state_slots;
  a.tp_size = tp_size;
  a.device = device;
  a.aux_device = aux_device;
  return a;
}

std::unique_ptr<PyPrefill> MakePrefill(
    py::dict geometry, int page_size, int32_t num_pages, std::vector<uint64_t> kv_bases,
    std::vector<uint32_t> aux_field_bytes, std::vector<uint64_t> aux_bases, int32_t num_aux_rows,
    int aux_room_field, std::vector<uint64_t> state_bases, int32_t num_state_slots,
    std::optional<int> device, std::optional<int> aux_device, std::string bootstrap_address,
    bool start_bootstrap_server, int tp_rank, int tp_size, int cp_rank, int cp_size, int pp_rank,
    int total_kv_heads, py::object engine, double bootstrap_timeout, double transfer_timeout,
    double heartbeat_timeout, bool allow_pull) {
  PrefillConnectorOptions o;
  o.engine = EngineOptionsFromDict(engine);
  o.bootstrap_address = std::move(bootstrap_address);
  o.start_bootstrap_server = start_bootstrap_server;
  o.tp_rank = tp_rank;
  o.tp_size = tp_size;
  o.cp_rank = cp_rank;
  o.cp_size = cp_size;
  o.pp_rank = pp_rank;
  o.total_kv_heads = total_kv_heads;
  o.bootstrap_timeout = Millis(bootstrap_timeout, "bootstrap_timeout");
  o.transfer_timeout = Millis(transfer_timeout, "transfer_timeout");
  o.heartbeat_timeout = Millis(heartbeat_timeout, "heartbeat_timeout");
  o.allow_pull = allow_pull;
  Pools pools = WrapPools(PoolArgsOf(std::move(geometry), page_size, num_pages, std::move(kv_bases),
                                     std::move(aux_field_bytes), std::move(aux_bases), num_aux_rows,
                                     aux_room_field, std::move(state_bases), num_state_slots,
                                     tp_size, device, aux_device));
  o.model = std::string(pools.kv->layout().geometry().name);
  o.state_pool = pools.state.get();
  std::unique_ptr<PrefillConnector> connector;
  {
    py::gil_scoped_release release;
    connector = ValueOrThrow(PrefillConnector::Create(o, pools.kv.get(), pools.aux.get()));
  }
  return std::make_unique<PyPrefill>(std::move(pools), std::move(connector));
}

std::unique_ptr<PyDecode> MakeDecode(
    py::dict geometry, int page_size, int32_t num_pages, std::vector<uint64_t> kv_bases,
    std::vector<uint32_t> aux_field_bytes, std::vector<uint64_t> aux_bases, int32_t num_aux_rows,
    int aux_room_field, std::vector<uint64_t> state_bases, int32_t num_state_slots,
    std::optional<int> device, std::optional<int> aux_device, int tp_rank, int tp_size,
    py::object engine, std::string kv_path, uint64_t staging_bytes, double bootstrap_timeout,
    double waiting_timeout, double heartbeat_interval, bool pull) {
  DecodeConnectorOptions o;
  o.engine = EngineOptionsFromDict(engine);
  o.tp_rank = tp_rank;
  o.tp_size = tp_size;
  o.kv_path = std::move(kv_path);
  o.staging_bytes = staging_bytes;
  o.bootstrap_timeout = Millis(bootstrap_timeout, "bootstrap_timeout");
  o.waiting_timeout = Millis(waiting_timeout, "waiting_timeout");
  o.heartbeat_interval = Millis(heartbeat_interval, "heartbeat_interval");
  o.pull = pull;
  Pools pools = WrapPools(PoolArgsOf(std::move(geometry), page_size, num_pages, std::move(kv_bases),
                                     std::move(aux_field_bytes), std::move(aux_bases), num_aux_rows,
                                     aux_room_field, std::move(state_bases), num_state_slots,
                                     tp_size, device, aux_device));
  o.state_pool = pools.state.get();
  std::unique_ptr<DecodeConnector> connector;
  {
    py::gil_scoped_release release;
    connector = ValueOrThrow(DecodeConnector::Create(o, pools.kv.get(), pools.aux.get()));
  }
  return std::make_unique<PyDecode>(std::move(pools), std::move(connector));
}

RoomState StateArg(int state) {
  if (state < 0 || state > static_cast<int>(RoomState::kFailed)) {
    throw StatusError(
        InvalidArgumentError("room state must be in [0, 4], got " + std::to_string(state)));
  }
  return static_cast<RoomState>(state);
}

// Methods both connectors have, with the same names and semantics.
template <typename Class>
void BindRoomMethods(Class& c) {
  using H = typename Class::type;
  c.def(
       "poll",
       [](H& h, uint64_t room) {
         RoomStatus s = h.Call([&](auto& x) { return ValueOrThrow(x.Poll(room)); });
         return StatusTuple(s);
       },
       py::arg("room"), kPollDoc)
      .def(
          "wait",
          [](H& h, uint64_t room, int state, double timeout) {
            const RoomState target = StateArg(state);
            const RoomStatus s = WaitInSlices(
                std::chrono::steady_clock::now() + Millis(timeout, "timeout"), kWaitSlice,
                [&](milliseconds slice) {
                  return h.Call([&](auto& x) { return ValueOrThrow(x.Wait(room, target, slice)); });
                },
                [&](const RoomStatus& status) { return status.state >= target; });
            return StatusTuple(s);
          },
          py::arg("room"), py::arg("state"), py::arg("timeout"), kWaitDoc)
      .def(
          "abort",
          [](H& h, uint64_t room, const std::string& reason) {
            h.Call([&](auto& x) { ThrowIfError(x.Abort(room, reason)); });
          },
          py::arg("room"), py::arg("reason") = "aborted by the caller", kAbortDoc)
      .def(
          "release",
          [](H& h, uint64_t room) { h.Call([&](auto& x) { ThrowIfError(x.Release(room)); }); },
          py::arg("room"), kReleaseDoc)
      .def(
          "stats", [](H& h) { return StatsDict(h.Call([](auto& x) { return x.stats(); })); },
          kStatsDoc)
      .def(
          "engine_metrics",
          [](H& h) { return MetricsDict(h.Call([](auto& x) { return x.engine_metrics(); })); },
          kEngineMetricsDoc)
      .def_property_readonly(
          "engine_address", [](H& h) { return h.Call([](auto& x) { return x.engine_address(); }); })
      .def("close", &H::Close, kCloseDoc);
}

// The bootstrap server of BootstrapServer: stopped by close() or collection, without the GIL
// either way (stopping waits for the HTTP requests in progress, up to their read timeouts).
class PyBootstrapServer {
 public:
  explicit PyBootstrapServer(std::unique_ptr<BootstrapServer> server)
      : address(server->address()), port(server->port()), server_(std::move(server)) {}
  PyBootstrapServer(const PyBootstrapServer&) = delete;
  PyBootstrapServer& operator=(const PyBootstrapServer&) = delete;
  ~PyBootstrapServer() {
    if (!InterpreterFinalizing() && PyGILState_Check()) Close();
  }

  // Stops the server; a second caller waits until the first has stopped it.
  void Close() {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(close_mu_);
    server_.reset();
  }

  const std::string address;
  const uint16_t port;

 private:
  std::mutex close_mu_;
  std::unique_ptr<BootstrapServer> server_;  // guarded by close_mu_
};

}  // namespace

void BindConnectors(py::module_& m) {
  m.def(
      "geometry_from_hf_config",
      [](const std::string& json_text, const std::string& name) {
        return GeometryDict(ValueOrThrow(ParseHfConfig(json_text, name)));
      },
      py::arg("json_text"), py::arg("name") = "", kGeometryFromHfConfigDoc);

  py::class_<PyBootstrapServer>(m, "BootstrapServer", kBootstrapServerDoc)
      .def(py::init([](const std::string& host, uint16_t port, const std::string& auth_secret,
                       bool insecure) {
             BootstrapServerOptions o;
             o.host = host;
             o.port = port;
             o.auth_secret = auth_secret;
             o.insecure = insecure;
             py::gil_scoped_release release;
             return std::make_unique<PyBootstrapServer>(ValueOrThrow(BootstrapServer::Create(o)));
           }),
           py::arg("host") = "127.0.0.1", py::arg("port") = 0, py::kw_only(),
           py::arg("auth_secret") = "", py::arg("insecure") = false)
      .def_readonly("address", &PyBootstrapServer::address)
      .def_readonly("port", &PyBootstrapServer::port)
      .def("close", &PyBootstrapServer::Close,
           "Stops serving: waits (without the GIL) for the requests in progress. Idempotent.");

  auto prefill = py::class_<PyPrefill>(m, "PrefillConnector", kPrefillDoc);
  prefill
      .def(py::init(&MakePrefill), py::kw_only(), py::arg("geometry"), py::arg("page_size"),
           py::arg("num_pages"), py::arg("kv_bases"), py::arg("aux_field_bytes"),
           py::arg("aux_bases"), py::arg("num_aux_rows"), py::arg("aux_room_field") = -1,
           py::arg("state_bases") = std::vector<uint64_t>{}, py::arg("num_state_slots") = 0,
           py::arg("device") = py::none(), py::arg("aux_device") = py::none(),
           py::arg("bootstrap_address") = "127.0.0.1:0", py::arg("start_bootstrap_server") = false,
           py::arg("tp_rank") = 0, py::arg("tp_size") = 1, py::arg("cp_rank") = 0,
           py::arg("cp_size") = 1, py::arg("pp_rank") = 0, py::arg("total_kv_heads") = 0,
           py::arg("engine") = py::none(), py::arg("bootstrap_timeout") = 60.0,
           py::arg("transfer_timeout") = 60.0, py::arg("heartbeat_timeout") = 30.0,
           py::arg("allow_pull") = false)
      .def_property_readonly(
          "bootstrap_address",
          [](PyPrefill& h) { return h.Call([](auto& x) { return x.bootstrap_address(); }); })
      .def(
          "create_sender",
          [](PyPrefill& h, uint64_t room, int64_t num_pages, int32_t state_slot) {
            h.Call([&](auto& x) { ThrowIfError(x.CreateSender(room, num_pages, state_slot)); });
          },
          py::arg("room"), py::arg("num_pages"), py::arg("state_slot") = -1, kCreateSenderDoc)
      .def(
          "send_chunk",
          [](PyPrefill& h, uint64_t room, int64_t first_page, const I32Array& pages,
             std::optional<int32_t> aux_row) {
            std::span<const int32_t> span = Pages(pages);
            h.Call([&](auto& x) { ThrowIfError(x.SendChunk(room, first_page, span, aux_row)); });
          },
          py::arg("room"), py::arg("first_page"), py::arg("pages"), py::arg("aux_row") = py::none(),
          kSendChunkDoc)
      .def(
          "pending_destinations",
          [](PyPrefill& h, uint64_t room) {
            return h.Call([&](auto& x) { return x.PendingDestinations(room); });
          },
          py::arg("room"), kPendingDestinationsDoc)
      .def(
          "send_range",
          [](PyPrefill& h, int64_t num_pages) {
            PageRange r = h.Call([&](auto& x) { return x.SendRange(num_pages); });
            return py::make_tuple(r.first_page, r.num_pages);
          },
          py::arg("num_pages"), kSendRangeDoc)
      .def(
          "begin_layerwise_pass",
          [](PyPrefill& h, const py::list& chunks) {
            std::vector<PrefillConnector::LayerwiseChunk> list;
            for (py::handle item : chunks) {
              auto t = item.cast<py::tuple>();
              if (t.size() != 4) {
                throw StatusError(InvalidArgumentError(
                    "each layerwise chunk is (room, first_page, pages, aux_row)"));
              }
              PrefillConnector::LayerwiseChunk c;
              c.room = t[0].cast<uint64_t>();
              c.first_page = t[1].cast<int64_t>();
              I32Array pages = t[2].cast<I32Array>();
              std::span<const int32_t> span = Pages(pages);
              c.src_pages.assign(span.begin(), span.end());
              if (!t[3].is_none()) c.aux_row = t[3].cast<int32_t>();
              list.push_back(std::move(c));
            }
            return h.Call([&](auto& x) { return ValueOrThrow(x.BeginLayerwisePass(list)); });
          },
          py::arg("chunks"), kBeginLayerwisePassDoc)
      .def(
          "mark_layer_ready",
          [](PyPrefill& h, uint64_t pass, int layer, std::optional<uintptr_t> cuda_event) {
            h.Call([&](auto& x) {
              if (cuda_event) {
                ThrowIfError(
                    x.MarkLayerReadyOnEvent(pass, layer, reinterpret_cast<void*>(*cuda_event)));
              } else {
                ThrowIfError(x.MarkLayerReady(pass, layer));
              }
            });
          },
          py::arg("pass_id"), py::arg("layer"), py::arg("cuda_event") = py::none(),
          kMarkLayerReadyDoc);
  BindRoomMethods(prefill);

  auto decode = py::class_<PyDecode>(m, "DecodeConnector", kDecodeDoc);
  decode
      .def(py::init(&MakeDecode), py::kw_only(), py::arg("geometry"), py::arg("page_size"),
           py::arg("num_pages"), py::arg("kv_bases"), py::arg("aux_field_bytes"),
           py::arg("aux_bases"), py::arg("num_aux_rows"), py::arg("aux_room_field") = -1,
           py::arg("state_bases") = std::vector<uint64_t>{}, py::arg("num_state_slots") = 0,
           py::arg("device") = py::none(), py::arg("aux_device") = py::none(),
           py::arg("tp_rank") = 0, py::arg("tp_size") = 1, py::arg("engine") = py::none(),
           py::arg("kv_path") = "auto", py::arg("staging_bytes") = uint64_t{1} << 30,
           py::arg("bootstrap_timeout") = 30.0, py::arg("waiting_timeout") = 60.0,
           py::arg("heartbeat_interval") = 2.0, py::arg("pull") = false)
      .def(
          "create_receiver",
          [](PyDecode& h, uint64_t room, const std::string& bootstrap_address,
             const I32Array& pages, int32_t aux_row, int32_t state_slot) {
            std::span<const int32_t> span = Pages(pages);
            h.Call([&](auto& x) {
              ThrowIfError(x.CreateReceiver(room, bootstrap_address, span, aux_row, state_slot));
            });
          },
          py::arg("room"), py::arg("bootstrap_address"), py::arg("pages"), py::arg("aux_row"),
          py::arg("state_slot") = -1, kCreateReceiverDoc);
  BindRoomMethods(decode);
}

}  // namespace kvferry::python
