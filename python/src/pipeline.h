// The blocking transfers TransferEngine.write / read: the request columns are read from their
// Python objects in groups of requests, and each group is submitted as its own engine batch as
// soon as it is read, so the first bytes move while later groups are still being read (a list
// of 8192 Python ints takes about as long to read as NVLink takes to move 8192 x 16 KiB). The
// call then waits for every batch and succeeds only when all completed.
//
// Groups: kFirstGroupRequests requests, then twice as many each time up to
// kMaxGroupRequests (256, 512, 1024, 2048, 4096, 4096, ...): the first copies start after a
// few microseconds of reading, and large calls are not cut into many small batches.
//
// GIL: the calling thread holds it while it reads the columns (lists and tuples are read
// element by element) and releases it once, for the wait. The groups of a call of more than one
// group are submitted meanwhile by the engine's GroupSubmitter thread, without the GIL: the
// reading thread never gives the GIL up between groups, so other Python threads cannot make it
// wait for the GIL back (up to the interpreter's switch interval, 5 ms) in the middle of a call.
//
// Thread-safety: a call may run concurrently with any other engine call; the column objects
// must not be resized by another thread during it (that is detected and refused).
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine_holder.h"
#include "kvferry/engine.h"

namespace kvferry::python {

namespace py = pybind11;

inline constexpr size_t kFirstGroupRequests = 256;
inline constexpr size_t kMaxGroupRequests = 4096;

// One column of requests (addresses, lengths, rows or strides) as the caller passed it: a list
// or tuple of ints (read element by element, with the GIL), a numpy integer array (converted to
// uint64 once, in C), or an int (or numpy integer scalar, or an array of one element) that
// stands for every request. Other objects are converted with numpy.asarray first.
class ColumnReader {
 public:
  // Throws StatusError (kInvalidArgument naming `name`) for an object that is no column of
  // ints: a numpy array of another dtype, a negative scalar or array element, an int >= 2^64.
  // Elements of lists and tuples are checked as they are read (Read). Needs the GIL.
  ColumnReader(py::handle obj, std::string name);

  // Values per request; 1 when one value stands for every request.
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

  // Writes the values of requests [first, first + count) to `out`. Needs the GIL.
  // REQUIRES: first + count <= the call's request count; size() is 1 or covers it.
  // Throws StatusError (kInvalidArgument) naming the element (e.g. "lengths[5000]") that is not
  // an int in [0, 2^64), or the column when a list changed size since construction.
  void Read(size_t first, size_t count, uint64_t* out) const;

 private:
  enum class Kind { kScalar, kSequence, kArray };
  [[noreturn]] void BadElement(size_t index, py::handle item) const;

  std::string name_;
  Kind kind_ = Kind::kScalar;
  size_t size_ = 1;
  uint64_t scalar_ = 0;
  py::object owner_;                 // the list or tuple, or the uint64 array
  const uint64_t* array_ = nullptr;  // kArray: the array's values
};

struct PipelineOptions {
  // The whole call's deadline from its start; groups are submitted with what is left of it.
  std::chrono::milliseconds deadline{0};
  // Seconds added to the deadline per byte moved. Each group's batch gets the deadline of the
  // bytes read so far (the last group's is the whole call's): the engine needs a batch's
  // deadline at its submission, before later groups are read.
  double seconds_per_byte = 0;
  // Sent with the requests: then every request is read first and they go as one batch (the
  // peer gets the notification after every one of them landed).
  std::optional<std::string> notification;
  void* start_after_event = nullptr;
};

// One engine's submitting thread for calls of several groups: it submits the groups that
// reading threads hand over, in the order they come, without the GIL. Started by the first
// such call; it sleeps while there is nothing to submit.
class GroupSubmitter {
 public:
  struct Job;
  explicit GroupSubmitter(std::shared_ptr<EngineHolder> holder);
  GroupSubmitter(const GroupSubmitter&) = delete;
  GroupSubmitter& operator=(const GroupSubmitter&) = delete;
  // Joins the thread. Call it without the GIL, once no call uses it.
  ~GroupSubmitter();

  // A request buffer of a finished job, or an empty vector.
  std::vector<TransferRequest> TakeBuffer();
  void Enqueue(std::unique_ptr<Job> job);

 private:
  void Run();
  void Recycle(std::vector<TransferRequest> buffer);

  std::shared_ptr<EngineHolder> holder_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::unique_ptr<Job>> queue_;
  std::vector<std::vector<TransferRequest>> buffers_;  // for reuse: no page faults per call
  bool stop_ = false;
  std::thread thread_;
};

// Reads the columns (local addresses, remote addresses, lengths, and optionally num_rows, local
// strides, remote strides), submits them to `segment` in groups, waits for every group's batch
// and releases them. Returns the bytes moved. Needs the GIL (released while the engine works).
// `submitter`: the engine's GroupSubmitter, made here by the first call of several groups.
//
// Throws StatusError before anything is submitted: kInvalidArgument (columns of different
// lengths other than 1, no request, a bad element found in the first group), and the
// submission errors of the first group. Once groups are in flight, a failure (a group's
// batch failing or refused at submission, a bad element in a later group, Ctrl-C) cancels the
// groups still pending, waits until they are final, releases them all and throws: the error
// of the first failed request in the caller's order, its message starting "request I of N: "
// (I in the caller's numbering), or the KeyboardInterrupt. A failed call may have moved
// some of the bytes (as any failed WRITE).
uint64_t TransferPipelined(const std::shared_ptr<EngineHolder>& holder,
                           std::unique_ptr<GroupSubmitter>& submitter, SegmentHandle segment,
                           TransferOp op, const std::vector<ColumnReader>& columns,
                           const PipelineOptions& options);

// A column argument of write() / read(), taken as the object itself (ColumnReader reads it);
// its type caster accepts any object and names it "ArrayLike[int]" in signatures.
struct ColumnArg {
  py::object object;
};

}  // namespace kvferry::python

namespace pybind11::detail {

template <>
struct type_caster<kvferry::python::ColumnArg> {
  PYBIND11_TYPE_CASTER(kvferry::python::ColumnArg, const_name("ArrayLike[int]"));

  bool load(handle src, bool) {
    value.object = reinterpret_borrow<object>(src);
    return true;
  }
};

}  // namespace pybind11::detail
