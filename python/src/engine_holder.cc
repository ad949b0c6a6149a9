#include "engine_holder.h"

#include <algorithm>

#include "errors.h"

namespace kvferry::python {

bool InterpreterFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

EngineHolder::~EngineHolder() {
  // The last reference may go from Python code (GIL held) or an engine thread (not held).
  if (!InterpreterFinalizing() && PyGILState_Check()) {
    py::gil_scoped_release release;
    Close();
  } else {
    Close();
  }
}

EngineHolder::Lease EngineHolder::Acquire() {
  if (closing_.load()) throw StatusError(FailedPreconditionError("the engine is closed"));
  std::shared_lock<std::shared_mutex> lock(mu_);
  if (engine_ == nullptr) throw StatusError(FailedPreconditionError("the engine is closed"));
  return Lease(std::move(lock), engine_.get());
}

void EngineHolder::Close() {
  closing_.store(true);  // new calls fail at once, so the calls in progress drain
  std::unique_ptr<TransferEngine> engine;
  {
    std::unique_lock<std::shared_mutex> lock(mu_);
    engine = std::move(engine_);
  }
  engine.reset();
  std::lock_guard<std::mutex> lock(orphans_mu_);
  orphans_.clear();
}

void EngineHolder::Orphan(BatchId id) {
  if (closing_.load()) return;  // the engine released (or will release) every batch
  std::lock_guard<std::mutex> lock(orphans_mu_);
  orphans_.push_back(id);
}

void EngineHolder::SweepOrphans(TransferEngine& engine) {
  std::vector<BatchId> orphans;
  {
    std::lock_guard<std::mutex> lock(orphans_mu_);
    if (orphans_.empty()) return;
    orphans.swap(orphans_);
  }
  auto still_pending = std::remove_if(orphans.begin(), orphans.end(), [&](BatchId id) {
    StatusOr<BatchStatus> status = engine.GetBatchStatus(id);
    if (status.ok() && status->state == TransferState::kPending) return false;
    engine.ReleaseBatch(id).IgnoreError();  // final, or already gone
    return true;
  });
  orphans.erase(still_pending, orphans.end());
  if (orphans.empty()) return;
  std::lock_guard<std::mutex> lock(orphans_mu_);
  orphans_.insert(orphans_.end(), orphans.begin(), orphans.end());
}

PyCallback::~PyCallback() {
  if (InterpreterFinalizing()) {
    (void)callable_.release();  // leaked: taking the GIL now would stop this thread
    return;
  }
  py::gil_scoped_acquire gil;
  callable_.reset();
}

}  // namespace kvferry::python
