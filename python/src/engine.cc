#include "engine.h"

#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

#include "batch.h"
#include "buffers.h"
#include "engine_docs.h"
#include "engine_holder.h"
#include "errors.h"
#include "metrics.h"
#include "pipeline.h"

namespace kvferry::python {
namespace {

using std::chrono::milliseconds;

// Engines still open at interpreter exit are closed by an atexit hook, while engine threads
// can still take the GIL to finish their callbacks.
std::mutex g_open_mu;
std::vector<std::weak_ptr<EngineHolder>> g_open;

void CloseAllAtExit() {
  std::vector<std::shared_ptr<EngineHolder>> open;
  {
    std::lock_guard<std::mutex> lock(g_open_mu);
    for (auto& weak : g_open) {
      if (auto holder = weak.lock()) open.push_back(std::move(holder));
    }
    g_open.clear();
  }
  py::gil_scoped_release release;
  for (auto& holder : open) holder->Close();
  JoinAside();
}

// True for an address given as a number: a Python int (not a bool) or a numpy integer scalar
// (numpy.integer; its buffer is the scalar's own 8 bytes, never meant as the memory).
bool IsAddress(py::handle obj) {
  if (PyLong_Check(obj.ptr())) return !PyBool_Check(obj.ptr());
  PyObject* numpy = PyImport_GetModule(py::str("numpy").ptr());  // only when already imported
  if (numpy == nullptr) {
    PyErr_Clear();
    return false;
  }
  py::object module = py::reinterpret_steal<py::object>(numpy);
  return py::isinstance(obj, module.attr("integer"));
}

// `obj` (an int, or a numpy integer scalar) as a uint64. Throws StatusError (kInvalidArgument
// naming `what`) for anything else or a value outside [0, 2^64).
uint64_t U64Arg(py::handle obj, const char* what) {
  uint64_t value = 0;
  if (PyBool_Check(obj.ptr()) || !IndexToU64(obj.ptr(), &value))
    throw StatusError(InvalidArgumentError(std::string(what) +
                                           " must be an int in [0, 2^64), got " + Describe(obj)));
  return value;
}

struct PySegment {
  SegmentHandle handle;
  std::string address;
};

py::dict DescriptorDict(const SegmentDescriptor& d) {
  py::list regions;
  for (const RegionDescriptor& r : d.regions) {
    py::dict region;
    region["address"] = r.base;
    region["length_bytes"] = r.length_bytes;
    region["device"] = r.kind == MemoryKind::kCuda ? py::object(py::int_(r.device_id)) : py::none();
    region["access"] = r.access;
    regions.append(std::move(region));
  }
  py::dict out;
  out["name"] = d.name;
  out["address"] = d.Address();
  out["host"] = d.host;
  out["port"] = d.port;
  out["node_id"] = d.node_id;
  out["pid"] = d.pid;
  out["incarnation"] = d.incarnation;
  out["transports"] = d.transports;
  out["regions"] = std::move(regions);
  return out;
}

class PyEngine {
 public:
  PyEngine() = default;
  PyEngine(const PyEngine&) = delete;
  PyEngine& operator=(const PyEngine&) = delete;

  static std::unique_ptr<PyEngine> Create(EngineOptions options) {
    std::unique_ptr<TransferEngine> engine;
    {
      py::gil_scoped_release release;
      engine = ValueOrThrow(TransferEngine::Create(options));
    }
    auto self = std::make_unique<PyEngine>();
    self->descriptor_ = engine->LocalDescriptor();
    self->default_deadline_ = options.default_deadline;
    self->holder_ = std::make_shared<EngineHolder>(std::move(engine));
    std::lock_guard<std::mutex> lock(g_open_mu);
    std::erase_if(g_open, [](const auto& weak) { return weak.expired(); });
    g_open.push_back(self->holder_);
    return self;
  }

  // Batches keep their engine object alive (keep_alive in the bindings), so this runs after
  // them: the engine stops before the memory of registered objects is let go.
  ~PyEngine() {
    Close();
    if (InPythonCallback()) {  // joined on a thread of its own, after the engine stopped
      auto submitter = std::make_shared<std::unique_ptr<GroupSubmitter>>(std::move(submitter_));
      RunAside([holder = holder_, submitter] {
        holder->Close();
        submitter->reset();
      });
      return;
    }
    py::gil_scoped_release release;
    submitter_.reset();  // joins its thread
  }

  // Called from a Python callback (an engine thread), it starts the close on a thread of its
  // own (EngineHolder::Close) and hands that thread the held objects, let go once the engine
  // stopped. The submitter stays: another thread's write() may be using it.
  void Close() {
    if (InPythonCallback()) {
      auto parts = std::make_shared<Parts>(Parts{holder_, std::move(held_)});
      holder_->Close();  // new calls fail from now on
      RunAside([parts] {
        parts->holder->Close();
        if (InterpreterFinalizing()) {
          for (auto& [address, hold] : parts->held) (void)hold.release();  // leaked
          return;
        }
        py::gil_scoped_acquire gil;
        parts->held.clear();
      });
      return;
    }
    {
      py::gil_scoped_release release;
      holder_->Close();
    }
    held_.clear();
  }

  bool closed() const { return holder_->closed(); }
  const SegmentDescriptor& descriptor() const { return descriptor_; }

  py::dict LocalDescriptor() {
    SegmentDescriptor d;
    {
      py::gil_scoped_release release;
      d = holder_->Acquire()->LocalDescriptor();
    }
    return DescriptorDict(d);
  }

  py::dict Metrics() {
    EngineMetrics m;
    {
      py::gil_scoped_release release;
      m = holder_->Acquire()->Metrics();
    }
    return MetricsDict(m);
  }

  uint64_t Register(py::handle buffer, py::handle length_arg, py::handle device_arg,
                    uint32_t access) {
    std::optional<uint64_t> length;
    if (!length_arg.is_none()) length = U64Arg(length_arg, "length");
    std::optional<int> device;
    if (!device_arg.is_none()) {
      const uint64_t d = U64Arg(device_arg, "device");
      if (d > static_cast<uint64_t>(std::numeric_limits<int>::max())) {
        throw StatusError(
            InvalidArgumentError("device " + std::to_string(d) + " is no CUDA ordinal"));
      }
      device = static_cast<int>(d);
    }
    BufferSpan span;
    std::unique_ptr<HeldBuffer> hold;
    if (IsAddress(buffer)) {
      if (!length) {
        throw StatusError(InvalidArgumentError("an int address needs length (bytes)"));
      }
      span.address = U64Arg(buffer, "address");
      span.length_bytes = *length;
      if (device) span.location = MemoryLocation{MemoryKind::kCuda, *device};
    } else {
      DescribedBuffer described = DescribeBuffer(buffer);
      span = described.span;
      hold = std::move(described.hold);
      if (length && *length != span.length_bytes) {
        throw StatusError(InvalidArgumentError(
            "length " + std::to_string(*length) + " differs from the object's " +
            std::to_string(span.length_bytes) + " bytes (omit it for objects)"));
      }
      if (device &&
          (span.location.kind != MemoryKind::kCuda || span.location.device_id != *device)) {
        throw StatusError(
            InvalidArgumentError("device " + std::to_string(*device) +
                                 " differs from where the object's memory is (omit it for "
                                 "objects)"));
      }
      if (span.read_only && (access & kAccessRemoteWrite) != 0) {
        throw StatusError(InvalidArgumentError(
            "the object's memory is read-only: register it with access=Access.REMOTE_READ"));
      }
    }
    {
      py::gil_scoped_release release;
      ThrowIfError(holder_->Acquire()->RegisterMemory(reinterpret_cast<void*>(span.address),
                                                      span.length_bytes, span.location, access));
    }
    // Kept even when close() began meanwhile: the engine may still use the region until it
    // stopped; a hold added after close() let go of the others goes with the engine object.
    if (hold) held_[span.address] = std::move(hold);
    return span.address;
  }

  void Unregister(py::handle buffer) {
    uint64_t address = 0;
    if (IsAddress(buffer)) {
      address = U64Arg(buffer, "address");
    } else {
      address = DescribeBuffer(buffer).span.address;
    }
    auto it = held_.find(address);
    const HeldBuffer* before = it == held_.end() ? nullptr : it->second.get();
    {
      py::gil_scoped_release release;
      ThrowIfError(holder_->Acquire()->UnregisterMemory(reinterpret_cast<void*>(address)));
    }
    // Only the hold of the registration just undone: another thread may have registered the
    // address again meanwhile (its hold is kept).
    it = held_.find(address);
    if (it != held_.end() && it->second.get() == before) held_.erase(it);
  }

  PySegment Open(const std::string& address) {
    py::gil_scoped_release release;
    return PySegment{ValueOrThrow(holder_->Acquire()->OpenSegment(address)), address};
  }

  // A Segment, or a "host:port" opened on the spot (the engine reuses an open one).
  SegmentHandle Resolve(py::handle segment) {
    if (py::isinstance<PySegment>(segment)) return segment.cast<const PySegment&>().handle;
    if (py::isinstance<py::str>(segment)) return Open(segment.cast<std::string>()).handle;
    throw StatusError(InvalidArgumentError("segment must be a kvferry.Segment or a 'host:port'"));
  }

  void CloseSegment(py::handle segment) {
    SegmentHandle handle = Resolve(segment);
    py::gil_scoped_release release;
    ThrowIfError(holder_->Acquire()->CloseSegment(handle));
  }

  py::dict Descriptor(py::handle segment, bool refresh) {
    SegmentHandle handle = Resolve(segment);
    kvferry::SegmentDescriptor d;
    {
      py::gil_scoped_release release;
      auto engine = holder_->Acquire();
      d = ValueOrThrow(refresh ? engine->RefreshSegment(handle)
                               : engine->GetSegmentDescriptor(handle));
    }
    return DescriptorDict(d);
  }

  void Prepare(py::handle segment, uint64_t local_address) {
    SegmentHandle handle = Resolve(segment);
    py::gil_scoped_release release;
    ThrowIfError(
        holder_->Acquire()->PrepareTransfers(handle, reinterpret_cast<const void*>(local_address)));
  }

  struct SubmitArgs {
    std::optional<double> deadline;
    std::optional<std::string> notification;
    std::optional<py::function> on_complete;
    std::optional<U64Array> num_rows;
    std::optional<U64Array> local_strides;
    std::optional<U64Array> remote_strides;
    std::optional<uint64_t> start_after_event;
  };

  std::unique_ptr<PyBatch> Submit(TransferOp op, py::handle segment, const U64Values& local,
                                  const U64Values& remote, const U64Values& lengths,
                                  const SubmitArgs& args) {
    SegmentHandle handle = Resolve(segment);
    BatchOptions options;
    if (args.deadline) options.deadline = Millis(*args.deadline, "deadline");
    if (args.notification) options.notification = *args.notification;
    if (args.on_complete) {
      auto callback = std::make_shared<PyCallback>(*args.on_complete);
      options.on_complete = [callback](BatchId id, const BatchStatus& status) {
        callback->Call([&](py::object& fn) { fn(id.value, status); });
      };
    }
    if (args.start_after_event) {
      options.start_after_event = reinterpret_cast<void*>(*args.start_after_event);
    }
    std::vector<Column> columns = {Column(local), Column(remote), Column(lengths)};
    const bool strided = args.num_rows || args.local_strides || args.remote_strides;
    if (strided) {
      for (const auto* a : {&args.num_rows, &args.local_strides, &args.remote_strides}) {
        if (!*a) {
          throw StatusError(InvalidArgumentError(
              "strided requests need num_rows, local_strides and remote_strides"));
        }
        columns.emplace_back(**a);
      }
    }
    size_t n = 0;
    for (const Column& c : columns) n = std::max(n, c.size());
    for (const Column& c : columns) {
      if (c.size() != n && c.size() != 1) {
        throw StatusError(InvalidArgumentError(
            "columns of a batch must have the same length (or length 1): got " +
            std::to_string(c.size()) + " and " + std::to_string(n)));
      }
    }
    if (n == 0 || columns[0].size() == 0) throw StatusError(InvalidArgumentError("empty batch"));
    BatchId id;
    {
      py::gil_scoped_release release;
      std::vector<TransferRequest> requests(n);
      for (size_t i = 0; i < n; ++i) {
        TransferRequest& r = requests[i];
        r.op = op;
        r.segment = handle;
        r.local_addr = reinterpret_cast<const void*>(columns[0][i]);
        r.remote_addr = columns[1][i];
        r.length_bytes = columns[2][i];
        if (strided) {
          if (columns[3][i] > std::numeric_limits<uint32_t>::max()) {
            throw StatusError(
                InvalidArgumentError("request " + std::to_string(i) + ": num_rows above 2^32 - 1"));
          }
          r.num_rows = static_cast<uint32_t>(columns[3][i]);
          r.local_stride = columns[4][i];
          r.remote_stride = columns[5][i];
        }
      }
      auto engine = holder_->Acquire();
      holder_->SweepOrphans(*engine);
      id = ValueOrThrow(engine->SubmitBatch(requests, options));
    }
    return std::make_unique<PyBatch>(holder_, id, n);
  }

  struct TransferArgs {
    std::optional<double> deadline;
    double deadline_per_gb = 0;
    std::optional<std::string> notification;
    std::optional<ColumnArg> num_rows;
    std::optional<ColumnArg> local_strides;
    std::optional<ColumnArg> remote_strides;
    std::optional<uint64_t> start_after_event;
  };

  // write() / read(): the columns read and submitted in groups (pipeline.h), then waited for.
  uint64_t Transfer(TransferOp op, py::handle segment, const ColumnArg& local,
                    const ColumnArg& remote, const ColumnArg& lengths, const TransferArgs& args) {
    PipelineOptions options;
    options.deadline = args.deadline ? Millis(*args.deadline, "deadline") : default_deadline_;
    if (!std::isfinite(args.deadline_per_gb) || args.deadline_per_gb < 0) {
      throw StatusError(InvalidArgumentError("deadline_per_gb must be >= 0 seconds (got " +
                                             std::to_string(args.deadline_per_gb) + ")"));
    }
    options.seconds_per_byte = args.deadline_per_gb / 1e9;
    options.notification = args.notification;
    if (args.start_after_event) {
      options.start_after_event = reinterpret_cast<void*>(*args.start_after_event);
    }
    std::vector<ColumnReader> columns;
    columns.reserve(6);
    columns.emplace_back(local.object, "local_addresses");
    columns.emplace_back(remote.object, "remote_addresses");
    columns.emplace_back(lengths.object, "lengths");
    const int strided = args.num_rows.has_value() + args.local_strides.has_value() +
                        args.remote_strides.has_value();
    if (strided != 0 && strided != 3) {
      throw StatusError(
          InvalidArgumentError("strided requests need num_rows, local_strides and remote_strides"));
    }
    if (strided == 3) {
      columns.emplace_back(args.num_rows->object, "num_rows");
      columns.emplace_back(args.local_strides->object, "local_strides");
      columns.emplace_back(args.remote_strides->object, "remote_strides");
    }
    SegmentHandle handle = Resolve(segment);
    return TransferPipelined(holder_, submitter_, handle, op, columns, options);
  }

  std::unique_ptr<PyBatch> SubmitNotification(py::handle segment, const std::string& message,
                                              std::optional<double> deadline,
                                              std::optional<py::function> on_complete) {
    SegmentHandle handle = Resolve(segment);
    BatchOptions options;
    if (deadline) options.deadline = Millis(*deadline, "deadline");
    if (on_complete) {
      auto callback = std::make_shared<PyCallback>(*on_complete);
      options.on_complete = [callback](BatchId id, const BatchStatus& status) {
        callback->Call([&](py::object& fn) { fn(id.value, status); });
      };
    }
    BatchId id;
    {
      py::gil_scoped_release release;
      id = ValueOrThrow(holder_->Acquire()->SubmitNotification(handle, message, options));
    }
    return std::make_unique<PyBatch>(holder_, id, 0);
  }

  void SendNotification(py::handle segment, const std::string& message, double timeout) {
    SegmentHandle handle = Resolve(segment);
    milliseconds timeout_ms = Millis(timeout, "timeout");
    py::gil_scoped_release release;
    ThrowIfError(holder_->Acquire()->SendNotification(handle, message, timeout_ms));
  }

  void SetHandler(std::optional<py::function> handler) {
    TransferEngine::NotificationHandler fn;
    if (handler) {
      auto callback = std::make_shared<PyCallback>(*handler);
      fn = [callback](const Notification& n) { callback->Call([&](py::object& f) { f(n); }); };
    }
    py::gil_scoped_release release;
    holder_->Acquire()->SetNotificationHandler(std::move(fn));
  }

  std::vector<Notification> PollNotifications() {
    py::gil_scoped_release release;
    return holder_->Acquire()->PollNotifications();
  }

 private:
  struct Parts {
    std::shared_ptr<EngineHolder> holder;
    std::unordered_map<uint64_t, std::unique_ptr<HeldBuffer>> held;
  };

  std::shared_ptr<EngineHolder> holder_;
  kvferry::SegmentDescriptor descriptor_;       // as created: name, host, port
  std::chrono::milliseconds default_deadline_;  // as created
  // Submits the groups of write() / read() calls of several groups; made by the first one
  // (guarded by the GIL).
  std::unique_ptr<GroupSubmitter> submitter_;
  // Objects registered through their interfaces, by address (guarded by the GIL).
  std::unordered_map<uint64_t, std::unique_ptr<HeldBuffer>> held_;
};

}  // namespace

void BindEngine(py::module_& m) {
  py::module_::import("atexit").attr("register")(py::cpp_function(&CloseAllAtExit));
  // Docstrings live as long as the module.
  static const std::string submit_write_doc = std::string(kSubmitWriteFirstLine) + kSubmitDoc;
  static const std::string submit_read_doc = std::string(kSubmitReadFirstLine) + kSubmitDoc;

  py::enum_<TransferOp>(m, "TransferOp", "Direction of a request.")
      .value("WRITE", TransferOp::kWrite, "local memory -> the peer's")
      .value("READ", TransferOp::kRead, "the peer's memory -> local");
  py::enum_<AccessFlags>(m, "Access", py::arithmetic(), "What peers may do with a region.")
      .value("NONE", kAccessNone, "local side of requests only; not published to peers")
      .value("REMOTE_READ", kAccessRemoteRead)
      .value("REMOTE_WRITE", kAccessRemoteWrite)
      .value("REMOTE_READ_WRITE", kAccessRemoteReadWrite);

  py::class_<Notification>(m, "Notification", "A message received from a peer engine.")
      .def_readonly("peer_name", &Notification::peer_name, "the sender's segment name")
      .def_readonly("peer_address", &Notification::peer_address, "host:port the sender listens on")
      .def_property_readonly(
          "message", [](const Notification& n) { return py::bytes(n.message); }, "bytes")
      .def("__repr__", [](const Notification& n) {
        return "Notification(peer_name='" + n.peer_name + "', peer_address='" + n.peer_address +
               "', " + std::to_string(n.message.size()) + " bytes)";
      });

  py::class_<PySegment>(m, "Segment",
                        "A peer engine's segment, opened by TransferEngine.open_segment.")
      .def_readonly("address", &PySegment::address, "host:port it was opened by")
      .def_property_readonly("handle", [](const PySegment& s) { return s.handle.value; })
      .def(
          "__eq__", [](const PySegment& a, const PySegment& b) { return a.handle == b.handle; },
          py::is_operator())
      .def("__hash__", [](const PySegment& s) { return std::hash<uint64_t>()(s.handle.value); })
      .def("__repr__", [](const PySegment& s) {
        return "Segment('" + s.address + "', handle=" + std::to_string(s.handle.value) + ")";
      });

  auto submit = [](TransferOp op) {
    return [op](PyEngine& e, py::handle segment, const U64Values& local, const U64Values& remote,
                const U64Values& lengths, std::optional<double> deadline,
                std::optional<std::string> notification, std::optional<py::function> on_complete,
                std::optional<U64Array> num_rows, std::optional<U64Array> local_strides,
                std::optional<U64Array> remote_strides, std::optional<uint64_t> start_after_event) {
      return e.Submit(
          op, segment, local, remote, lengths,
          {deadline, std::move(notification), std::move(on_complete), std::move(num_rows),
           std::move(local_strides), std::move(remote_strides), start_after_event});
    };
  };
  auto sync = [](TransferOp op) {
    return [op](PyEngine& e, py::handle segment, const ColumnArg& local, const ColumnArg& remote,
                const ColumnArg& lengths, std::optional<double> deadline, double deadline_per_gb,
                std::optional<std::string> notification, std::optional<ColumnArg> num_rows,
                std::optional<ColumnArg> local_strides, std::optional<ColumnArg> remote_strides,
                std::optional<uint64_t> start_after_event) {
      return e.Transfer(op, segment, local, remote, lengths,
                        {deadline, deadline_per_gb, std::move(notification), std::move(num_rows),
                         std::move(local_strides), std::move(remote_strides), start_after_event});
    };
  };
  py::class_<PyEngine>(m, "TransferEngine", kEngineDoc)
      .def(py::init([](std::optional<std::string> name, std::optional<std::string> listen_host,
                       uint16_t listen_port, std::string transport, double default_deadline,
                       double connect_timeout, std::optional<std::string> auth_secret,
                       bool insecure, std::optional<int> tcp_lanes_per_peer,
                       std::optional<uint64_t> tcp_slice_bytes, std::string faults) {
             EngineOptions o;
             if (name) o.name = *name;
             if (listen_host) o.listen_host = *listen_host;
             o.listen_port = listen_port;
             o.transport = std::move(transport);
             o.default_deadline = Millis(default_deadline, "default_deadline");
             o.connect_timeout = Millis(connect_timeout, "connect_timeout");
             if (auth_secret) o.auth_secret = *auth_secret;
             o.insecure = insecure;
             if (tcp_lanes_per_peer) o.tcp_lanes_per_peer = *tcp_lanes_per_peer;
             if (tcp_slice_bytes) o.tcp_slice_bytes = *tcp_slice_bytes;
             StatusOr<FaultPlan> plan = ParseFaultPlan(faults);
             if (!plan.ok()) throw StatusError(plan.status());
             o.faults = std::move(*plan);
             return PyEngine::Create(std::move(o));
           }),
           py::kw_only(), py::arg("name") = py::none(), py::arg("listen_host") = py::none(),
           py::arg("listen_port") = 0, py::arg("transport") = "auto",
           py::arg("default_deadline") = 30.0, py::arg("connect_timeout") = 5.0,
           py::arg("auth_secret") = py::none(), py::arg("insecure") = false,
           py::arg("tcp_lanes_per_peer") = py::none(), py::arg("tcp_slice_bytes") = py::none(),
           py::arg("faults") = "", kInitDoc)
      .def_property_readonly(
          "address", [](const PyEngine& e) { return e.descriptor().Address(); },
          "host:port peers open this engine's segment by.")
      .def_property_readonly("name", [](const PyEngine& e) { return e.descriptor().name; })
      .def_property_readonly("host", [](const PyEngine& e) { return e.descriptor().host; })
      .def_property_readonly("port", [](const PyEngine& e) { return e.descriptor().port; })
      .def_property_readonly("closed", &PyEngine::closed)
      .def("local_descriptor", &PyEngine::LocalDescriptor, kLocalDescriptorDoc)
      .def("metrics", &PyEngine::Metrics, kMetricsDoc)
      .def("register_memory", &PyEngine::Register, py::arg("buffer"),
           py::arg("length").none(true) = py::none(), py::arg("device").none(true) = py::none(),
           py::arg("access") = static_cast<uint32_t>(kAccessRemoteReadWrite), kRegisterDoc)
      .def("unregister_memory", &PyEngine::Unregister, py::arg("buffer"), kUnregisterDoc)
      .def("open_segment", &PyEngine::Open, py::arg("address"), kOpenSegmentDoc)
      .def("close_segment", &PyEngine::CloseSegment, py::arg("segment"), kCloseSegmentDoc)
      .def("segment_descriptor", &PyEngine::Descriptor, py::arg("segment"),
           py::arg("refresh") = false, kSegmentDescriptorDoc)
      .def("prepare_transfers", &PyEngine::Prepare, py::arg("segment"), py::arg("local_address"),
           kPrepareDoc)
      .def("submit_write", submit(TransferOp::kWrite), py::keep_alive<0, 1>(), py::arg("segment"),
           py::arg("local_addresses"), py::arg("remote_addresses"), py::arg("lengths"),
           py::kw_only(), py::arg("deadline") = py::none(), py::arg("notification") = py::none(),
           py::arg("on_complete") = py::none(), py::arg("num_rows") = py::none(),
           py::arg("local_strides") = py::none(), py::arg("remote_strides") = py::none(),
           py::arg("start_after_event") = py::none(), submit_write_doc.c_str())
      .def("submit_read", submit(TransferOp::kRead), py::keep_alive<0, 1>(), py::arg("segment"),
           py::arg("local_addresses"), py::arg("remote_addresses"), py::arg("lengths"),
           py::kw_only(), py::arg("deadline") = py::none(), py::arg("notification") = py::none(),
           py::arg("on_complete") = py::none(), py::arg("num_rows") = py::none(),
           py::arg("local_strides") = py::none(), py::arg("remote_strides") = py::none(),
           py::arg("start_after_event") = py::none(), submit_read_doc.c_str())
      .def("write", sync(TransferOp::kWrite), py::arg("segment"), py::arg("local_addresses"),
           py::arg("remote_addresses"), py::arg("lengths"), py::kw_only(),
           py::arg("deadline") = py::none(), py::arg("deadline_per_gb") = 0.0,
           py::arg("notification") = py::none(), py::arg("num_rows") = py::none(),
           py::arg("local_strides") = py::none(), py::arg("remote_strides") = py::none(),
           py::arg("start_after_event") = py::none(), kWriteDoc)
      .def("read", sync(TransferOp::kRead), py::arg("segment"), py::arg("local_addresses"),
           py::arg("remote_addresses"), py::arg("lengths"), py::kw_only(),
           py::arg("deadline") = py::none(), py::arg("deadline_per_gb") = 0.0,
           py::arg("notification") = py::none(), py::arg("num_rows") = py::none(),
           py::arg("local_strides") = py::none(), py::arg("remote_strides") = py::none(),
           py::arg("start_after_event") = py::none(), kReadDoc)
      .def("send_notification", &PyEngine::SendNotification, py::arg("segment"), py::arg("message"),
           py::arg("timeout") = 5.0, kSendNotificationDoc)
      .def("submit_notification", &PyEngine::SubmitNotification, py::keep_alive<0, 1>(),
           py::arg("segment"), py::arg("message"), py::kw_only(), py::arg("deadline") = py::none(),
           py::arg("on_complete") = py::none(), kSubmitNotificationDoc)
      .def("set_notification_handler", &PyEngine::SetHandler, py::arg("handler"), kSetHandlerDoc)
      .def("poll_notifications", &PyEngine::PollNotifications, kPollNotificationsDoc)
      .def("close", &PyEngine::Close, kCloseDoc)
      .def("__enter__", [](PyEngine& e) -> PyEngine& { return e; })
      .def("__exit__", [](PyEngine& e, py::args) { e.Close(); })
      .def("__repr__", [](const PyEngine& e) {
        return "TransferEngine(name='" + e.descriptor().name + "', address='" +
               e.descriptor().Address() + "'" + (e.closed() ? ", closed" : "") + ")";
      });
}

}  // namespace kvferry::python
