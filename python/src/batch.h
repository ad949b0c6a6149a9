// kvferry.Batch: one submitted transfer batch, and the status values it reports.
//
// Thread-safety: a Batch may be used from several Python threads; its blocking methods
// release the GIL.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>

#include "engine_holder.h"
#include "kvferry/engine.h"

namespace kvferry::python {

namespace py = pybind11;

class PyBatch {
 public:
  PyBatch(std::shared_ptr<EngineHolder> holder, BatchId id, size_t num_requests)
      : holder_(std::move(holder)), id_(id), num_requests_(num_requests) {}
  PyBatch(const PyBatch&) = delete;
  PyBatch& operator=(const PyBatch&) = delete;
  // A batch not released by then is released by the engine once final (EngineHolder::Orphan).
  ~PyBatch();

  uint64_t id() const { return id_.value; }
  size_t num_requests() const { return num_requests_; }
  BatchStatus Poll();
  // Blocks until the batch is final or `timeout_s` passed (None: until final; it ends at the
  // batch's deadline at the latest). Returns the status, pending when the timeout passed.
  // Ctrl-C interrupts it (KeyboardInterrupt).
  BatchStatus Wait(std::optional<double> timeout_s);
  // Wait, then raise the batch's error when it failed or was cancelled, TimeoutError when
  // still pending; releases the batch when `release` and final.
  BatchStatus Result(std::optional<double> timeout_s, bool release);
  void Cancel();
  TransferStatus RequestStatus(size_t index);
  void Release();

 private:
  void CheckNotReleased() const;

  std::shared_ptr<EngineHolder> holder_;
  BatchId id_;
  size_t num_requests_;
  std::mutex release_mu_;  // serialises Release()
  std::atomic<bool> released_{false};
};

void BindBatch(py::module_& m);

}  // namespace kvferry::python
