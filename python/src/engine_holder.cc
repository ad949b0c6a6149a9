#include "engine_holder.h"

#include <algorithm>
#include <thread>

#include "errors.h"

namespace kvferry::python {
namespace {

thread_local int t_callback_depth = 0;

struct AsideThread {
  AsideThread(std::thread t, std::shared_ptr<std::atomic<bool>> d)
      : thread(std::move(t)), done(std::move(d)) {}
  AsideThread(AsideThread&&) = default;
  AsideThread& operator=(AsideThread&&) = default;
  // One started after the exit hook joined the others is still running when the list is
  // destroyed at static destruction: it is let go there, not joined (std::terminate).
  ~AsideThread() {
    if (thread.joinable()) thread.detach();
  }
  std::thread thread;
  std::shared_ptr<std::atomic<bool>> done;
};
std::mutex g_aside_mu;
std::vector<AsideThread> g_aside;

}  // namespace

bool InPythonCallback() { return t_callback_depth > 0; }

PyCallback::Scope::Scope() { ++t_callback_depth; }
PyCallback::Scope::~Scope() { --t_callback_depth; }

void RunAside(std::function<void()> work) {
  std::lock_guard<std::mutex> lock(g_aside_mu);
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread thread([work = std::move(work), done] {
    work();
    done->store(true);
  });
  // Threads whose work is over are joined here (they are returning), so the list stays short.
  for (AsideThread& t : g_aside) {
    if (t.done->load()) t.thread.join();
  }
  std::erase_if(g_aside, [](const AsideThread& t) { return !t.thread.joinable(); });
  g_aside.push_back(AsideThread{std::move(thread), std::move(done)});
}

void JoinAside() {
  while (true) {
    std::vector<AsideThread> threads;
    {
      std::lock_guard<std::mutex> lock(g_aside_mu);
      threads.swap(g_aside);
    }
    if (threads.empty()) return;
    for (AsideThread& t : threads) t.thread.join();
  }
}

bool InterpreterFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

EngineHolder::~EngineHolder() {
  if (InPythonCallback()) {
    // Nothing else refers to this holder any more: no call is in progress.
    closing_.store(true);
    std::shared_ptr<TransferEngine> engine = std::move(engine_);
    if (engine != nullptr) RunAside([engine]() mutable { engine.reset(); });
    return;
  }
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
  if (InPythonCallback()) {
    RunAside([self = shared_from_this()] { self->Close(); });
    return;
  }
  CloseHere();
}

void EngineHolder::CloseHere() {
  std::unique_ptr<TransferEngine> engine;
  {
    std::unique_lock<std::shared_mutex> lock(mu_);
    engine = std::move(engine_);
  }
  if (engine != nullptr) {
    engine.reset();
    {
      std::lock_guard<std::mutex> lock(orphans_mu_);
      orphans_.clear();
    }
    std::lock_guard<std::mutex> lock(stopped_mu_);
    stopped_ = true;
    stopped_cv_.notify_all();
    return;
  }
  // Another thread took the engine: wait until it is destroyed.
  std::unique_lock<std::mutex> lock(stopped_mu_);
  stopped_cv_.wait(lock, [&] { return stopped_; });
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
  Scope scope;  // the callable's release may drop the last reference to an engine
  py::gil_scoped_acquire gil;
  callable_.reset();
}

}  // namespace kvferry::python
