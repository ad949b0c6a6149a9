#include "pipeline.h"

#include <pybind11/numpy.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <span>
#include <utility>

#include "buffers.h"
#include "errors.h"

namespace kvferry::python {
namespace {

using Clock = std::chrono::steady_clock;

// Wait slices: short enough that Ctrl-C and Close() are noticed promptly.
constexpr std::chrono::milliseconds kWaitSlice{100};

constexpr const char* kIntRange = "an int in [0, 2^64)";

[[noreturn]] void Invalid(const std::string& message) {
  throw StatusError(InvalidArgumentError(message));
}

// "request K: rest" -> K and rest; false when `message` does not start so.
bool SplitRequestPrefix(const std::string& message, size_t* index, std::string* rest) {
  static constexpr std::string_view kPrefix = "request ";
  if (message.compare(0, kPrefix.size(), kPrefix) != 0) return false;
  size_t i = kPrefix.size();
  size_t value = 0;
  const size_t digits_start = i;
  while (i < message.size() && message[i] >= '0' && message[i] <= '9') {
    value = value * 10 + static_cast<size_t>(message[i] - '0');
    ++i;
  }
  if (i == digits_start || message.compare(i, 2, ": ") != 0) return false;
  *index = value;
  *rest = message.substr(i + 2);
  return true;
}

std::string RequestPrefix(size_t index, size_t num_requests) {
  return "request " + std::to_string(index) + " of " + std::to_string(num_requests) + ": ";
}

// A submission error of the group starting at `first`: the engine names requests by their
// index in the group; the caller knows them by their index in the call.
Status InCallerNumbering(const Status& error, size_t first, size_t num_requests) {
  size_t index = 0;
  std::string rest;
  if (!SplitRequestPrefix(error.message(), &index, &rest)) return error;
  return Status(error.code(), RequestPrefix(first + index, num_requests) + rest);
}

struct Group {
  BatchId id;
  size_t first = 0;  // index of its first request in the call
  size_t count = 0;
  bool released = false;
};

// The batches of one call. Those not released by the end are handed to the engine holder,
// which releases them once final (the engine was closing and refused the release).
class Groups {
 public:
  explicit Groups(EngineHolder& holder) : holder_(holder) {}
  Groups(const Groups&) = delete;
  Groups& operator=(const Groups&) = delete;
  ~Groups() {
    for (const Group& g : groups_) {
      if (!g.released) holder_.Orphan(g.id);
    }
  }

  void Add(const Group& group) { groups_.push_back(group); }
  size_t size() const { return groups_.size(); }
  Group& operator[](size_t k) { return groups_[k]; }

  // Cancels the batches still pending, waits until they are final (CancelBatch blocks so) and
  // releases every batch not released yet. Without the GIL; never throws.
  void Abort() {
    for (Group& g : groups_) {
      if (g.released) continue;
      try {
        auto engine = holder_.Acquire();
        engine->CancelBatch(g.id).IgnoreError();  // kNotFound only: then release fails too
        g.released = engine->ReleaseBatch(g.id).ok();
      } catch (const StatusError&) {
        // The engine is closing: it fails pending batches; the destructor orphans them.
      }
    }
  }

 private:
  EngineHolder& holder_;
  std::vector<Group> groups_;
};

// What the reading thread and the submitting thread share during one call.
struct CallState {
  size_t num_requests = 0;
  std::optional<std::string> notification;
  void* start_after_event = nullptr;
  std::atomic<bool> failed{false};  // a submission failed (error): read no further
  std::atomic<bool> stop{false};    // the call is failing: submit nothing more
  std::mutex mu;
  std::condition_variable processed_changed;
  size_t processed = 0;          // jobs submitted or skipped (guarded by mu)
  std::vector<Group> submitted;  // in order (guarded by mu)
  Status error;                  // the first submission error (guarded by mu)
};

// The error a failed group's batch raises: the batch's first error, its message naming the
// first request (in the caller's order) that failed with that code.
Status FirstFailure(TransferEngine& engine, const Group& group, const BatchStatus& status,
                    size_t num_requests) {
  Status error = status.error;
  if (error.ok()) {
    error = status.state == TransferState::kCancelled
                ? CancelledError("batch cancelled")
                : Status(StatusCode::kUnknown, "batch failed without a reason");
  }
  for (size_t j = 0; j < group.count; ++j) {
    StatusOr<TransferStatus> request = engine.GetTransferStatus(group.id, j);
    if (!request.ok() || request->state == TransferState::kCompleted ||
        request->state == TransferState::kPending || request->error.code() != error.code()) {
      continue;
    }
    size_t ignored = 0;
    std::string rest = request->error.message();
    SplitRequestPrefix(rest, &ignored, &rest);
    return Status(error.code(), RequestPrefix(group.first + j, num_requests) + rest);
  }
  return error;
}

uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  return a > std::numeric_limits<uint64_t>::max() - b ? std::numeric_limits<uint64_t>::max()
                                                      : a + b;
}

}  // namespace

ColumnReader::ColumnReader(py::handle obj, std::string name) : name_(std::move(name)) {
  PyObject* o = obj.ptr();
  if (PyList_Check(o) || PyTuple_Check(o)) {
    size_ = static_cast<size_t>(PySequence_Fast_GET_SIZE(o));
    owner_ = py::reinterpret_borrow<py::object>(obj);
    kind_ = Kind::kSequence;
    if (size_ == 1) {  // one value for every request
      Read(0, 1, &scalar_);
      kind_ = Kind::kScalar;
      owner_ = py::object();
    }
    return;
  }
  if (PyLong_Check(o)) {
    if (!IndexToU64(o, &scalar_))
      Invalid(name_ + " must be " + kIntRange + ", got " + Describe(obj));
    return;
  }
  py::array array;
  if (py::isinstance<py::array>(obj)) {
    array = py::reinterpret_borrow<py::array>(obj);
  } else {
    try {
      array = py::module_::import("numpy").attr("asarray")(obj);
    } catch (py::error_already_set& error) {
      Invalid(name_ + ": cannot read " + Describe(obj) + " as integers (" + error.what() + ")");
    }
  }
  const char kind = array.dtype().kind();
  if (kind != 'i' && kind != 'u') {
    Invalid(name_ + " must hold ints: got " + Describe(obj) + " of dtype " +
            py::str(array.dtype()).cast<std::string>());
  }
  size_ = static_cast<size_t>(array.size());
  if (kind == 'i') {
    using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
    I64Array values = I64Array::ensure(array);
    if (!values) throw py::error_already_set();
    const int64_t* data = values.data();
    for (size_t i = 0; i < size_; ++i) {
      if (data[i] < 0) {
        Invalid(name_ + "[" + std::to_string(i) + "] must be " + kIntRange + ", got " +
                std::to_string(data[i]));
      }
    }
    array_ = reinterpret_cast<const uint64_t*>(data);  // the same bits: all >= 0
    owner_ = std::move(values);
  } else {
    U64Array values = U64Array::ensure(array);
    if (!values) throw py::error_already_set();
    array_ = values.data();
    owner_ = std::move(values);
  }
  kind_ = Kind::kArray;
  if (size_ == 1) {
    scalar_ = array_[0];
    kind_ = Kind::kScalar;
  }
}

void ColumnReader::BadElement(size_t index, py::handle item) const {
  Invalid(name_ + "[" + std::to_string(index) + "] must be " + kIntRange + ", got " +
          Describe(item));
}

void ColumnReader::Read(size_t first, size_t count, uint64_t* out) const {
  switch (kind_) {
    case Kind::kScalar:
      std::fill(out, out + count, scalar_);
      return;
    case Kind::kArray:
      std::memcpy(out, array_ + first, count * sizeof(uint64_t));
      return;
    case Kind::kSequence:
      break;
  }
  PyObject* sequence = owner_.ptr();
  // The list may have changed while the GIL was released (between groups) or while an
  // element's __index__ ran: its size is checked and its items looked up again then.
  auto items = [&] {
    if (static_cast<size_t>(PySequence_Fast_GET_SIZE(sequence)) != size_) {
      Invalid(name_ + " changed size during the call (from " + std::to_string(size_) + " to " +
              std::to_string(PySequence_Fast_GET_SIZE(sequence)) + " elements)");
    }
    return PySequence_Fast_ITEMS(sequence);
  };
  PyObject** item = items();
  for (size_t i = first; i < first + count; ++i) {
    PyObject* value = item[i];
    if (PyLong_Check(value)) {
      if (!LongToU64(value, &out[i - first])) BadElement(i, value);
      continue;
    }
    auto held = py::reinterpret_borrow<py::object>(value);  // alive while __index__ runs
    if (!IndexToU64(value, &out[i - first])) BadElement(i, held);
    item = items();
  }
}

struct GroupSubmitter::Job {
  std::shared_ptr<CallState> call;
  std::vector<TransferRequest> requests;  // the group's
  size_t first = 0;                       // index of its first request in the call
  Clock::time_point limit;                // its deadline
};

namespace {

// Submits one group's batch and records it, or the error, in its call. Without the GIL.
void SubmitGroup(EngineHolder& holder, GroupSubmitter::Job& job) {
  CallState& call = *job.call;
  Status error;
  std::optional<BatchId> id;
  if (!call.stop.load() && !call.failed.load()) {
    BatchOptions options;
    options.start_after_event = call.start_after_event;
    if (call.notification) options.notification = *call.notification;
    options.deadline = std::chrono::ceil<std::chrono::milliseconds>(job.limit - Clock::now());
    if (options.deadline.count() <= 0) {
      error = DeadlineExceededError("the call's deadline passed before " +
                                    RequestPrefix(job.first, call.num_requests) + "was submitted");
    } else {
      try {
        auto engine = holder.Acquire();
        if (job.first == 0) holder.SweepOrphans(*engine);
        StatusOr<BatchId> submitted = engine->SubmitBatch(job.requests, options);
        if (submitted.ok()) {
          id = *submitted;
        } else {
          error = InCallerNumbering(submitted.status(), job.first, call.num_requests);
        }
      } catch (const StatusError& closed) {
        error = closed.status();
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(call.mu);
    if (id) call.submitted.push_back({*id, job.first, job.requests.size()});
    if (!error.ok() && call.error.ok()) {
      call.error = error;
      call.failed.store(true);
    }
    ++call.processed;
  }
  call.processed_changed.notify_all();
}

}  // namespace

GroupSubmitter::GroupSubmitter(std::shared_ptr<EngineHolder> holder)
    : holder_(std::move(holder)), thread_([this] { Run(); }) {}

GroupSubmitter::~GroupSubmitter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

std::vector<TransferRequest> GroupSubmitter::TakeBuffer() {
  std::lock_guard<std::mutex> lock(mu_);
  if (buffers_.empty()) return {};
  std::vector<TransferRequest> buffer = std::move(buffers_.back());
  buffers_.pop_back();
  return buffer;
}

void GroupSubmitter::Recycle(std::vector<TransferRequest> buffer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (buffers_.size() < 8) buffers_.push_back(std::move(buffer));
}

void GroupSubmitter::Enqueue(std::unique_ptr<Job> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(job));
  }
  wake_.notify_one();
}

void GroupSubmitter::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping
    std::unique_ptr<Job> job = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    SubmitGroup(*holder_, *job);
    Recycle(std::move(job->requests));
    job.reset();
    lock.lock();
  }
}

uint64_t TransferPipelined(const std::shared_ptr<EngineHolder>& holder,
                           std::unique_ptr<GroupSubmitter>& submitter, SegmentHandle segment,
                           TransferOp op, const std::vector<ColumnReader>& columns,
                           const PipelineOptions& options) {
  const Clock::time_point start = Clock::now();
  size_t n = 0;
  for (const ColumnReader& c : columns) n = std::max(n, c.size());
  for (const ColumnReader& c : columns) {
    if (c.size() == 0) Invalid("no requests: " + c.name() + " is empty");
    if (c.size() != n && c.size() != 1) {
      Invalid("columns must have the same length (or length 1): " + c.name() + " has " +
              std::to_string(c.size()) + ", another " + std::to_string(n));
    }
  }
  const bool strided = columns.size() == 6;
  const size_t max_group = options.notification ? n : std::min(n, kMaxGroupRequests);
  size_t group_size = options.notification ? n : std::min(n, kFirstGroupRequests);
  const bool single = group_size == n;  // submitted by this thread
  if (!single && !submitter) submitter = std::make_unique<GroupSubmitter>(holder);
  auto call = std::make_shared<CallState>();
  call->num_requests = n;
  call->notification = options.notification;
  call->start_after_event = options.start_after_event;
  std::vector<std::vector<uint64_t>> values(columns.size(), std::vector<uint64_t>(max_group));
  Groups groups(*holder);
  size_t enqueued = 0;
  std::unique_ptr<GroupSubmitter::Job> own_job;
  uint64_t bytes_read = 0;
  // Without the GIL: waits until every job handed over is submitted or skipped.
  auto drain = [&] {
    std::unique_lock<std::mutex> lock(call->mu);
    call->processed_changed.wait(lock, [&] { return call->processed == enqueued; });
    for (const Group& g : call->submitted) groups.Add(g);
    call->submitted.clear();
  };
  try {
    for (size_t first = 0, count = 0; first < n && !call->failed.load(); first += count) {
      count = std::min(group_size, n - first);
      group_size = std::min(group_size * 2, max_group);
      auto job = std::make_unique<GroupSubmitter::Job>();
      job->call = call;
      job->first = first;
      if (!single) job->requests = submitter->TakeBuffer();
      job->requests.resize(count);
      try {
        for (size_t c = 0; c < columns.size(); ++c) {
          columns[c].Read(first, count, values[c].data());
        }
        for (size_t j = 0; j < count; ++j) {
          TransferRequest& r = job->requests[j];
          r.op = op;
          r.segment = segment;
          r.local_addr = reinterpret_cast<const void*>(values[0][j]);
          r.remote_addr = values[1][j];
          r.length_bytes = values[2][j];
          if (strided) {
            if (values[3][j] > std::numeric_limits<uint32_t>::max()) {
              Invalid(columns[3].name() + "[" + std::to_string(first + j) + "] above 2^32 - 1");
            }
            r.num_rows = static_cast<uint32_t>(values[3][j]);
            r.local_stride = values[4][j];
            r.remote_stride = values[5][j];
          } else {  // a recycled buffer may hold a strided call's requests
            r.num_rows = 1;
            r.local_stride = 0;
            r.remote_stride = 0;
          }
          bytes_read = SaturatingAdd(bytes_read, r.total_bytes());
        }
      } catch (const StatusError& error) {
        if (enqueued == 0) throw;
        throw StatusError(Status(error.status().code(),
                                 error.status().message() +
                                     " (the requests before it were cancelled, those already "
                                     "submitted waited for: some of their bytes may have "
                                     "moved)"));
      }
      job->limit = AddSeconds(start + options.deadline,
                              options.seconds_per_byte * static_cast<double>(bytes_read));
      if (single) {
        own_job = std::move(job);
      } else {
        submitter->Enqueue(std::move(job));
        ++enqueued;
      }
    }
    py::gil_scoped_release release;
    if (own_job) {
      ++enqueued;
      SubmitGroup(*holder, *own_job);
    }
    drain();
    if (call->failed.load()) throw StatusError(call->error);
    uint64_t moved = 0;
    for (size_t k = 0; k < groups.size(); ++k) {
      Group& group = groups[k];
      while (true) {
        Status failure;
        {
          auto engine = holder->Acquire();
          BatchStatus status = ValueOrThrow(engine->WaitBatch(group.id, kWaitSlice));
          if (status.state == TransferState::kCompleted) {
            ThrowIfError(engine->ReleaseBatch(group.id));
            group.released = true;
            moved += status.transferred_bytes;
            break;
          }
          if (status.state != TransferState::kPending) {
            failure = FirstFailure(*engine, group, status, n);
          }
        }
        if (!failure.ok()) throw StatusError(failure);
        py::gil_scoped_acquire gil;
        if (PyErr_CheckSignals() != 0) throw py::error_already_set();
      }
    }
    return moved;
  } catch (...) {
    py::gil_scoped_release release;
    call->stop.store(true);
    drain();
    groups.Abort();
    throw;
  }
}

}  // namespace kvferry::python
