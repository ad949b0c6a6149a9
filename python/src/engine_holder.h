// What the Python objects of one engine share: the engine itself (closed explicitly, by the
// last Python reference, or at interpreter exit), the batches to release once final, and
// Python callables called from engine threads.
//
// GIL rules: every call into the engine is made without the GIL (engine threads take it to run
// Python callbacks, and may hold engine locks meanwhile); the engine is destroyed without it.
//
// Engine threads never stop their own engine: Python code run by a callback (PyCallback) may
// close an engine or drop its last reference, and an engine's destructor joins its threads.
// Such closes run on a thread of their own (RunAside) instead, and finish after the callback.
//
// Thread-safety: EngineHolder's methods may be called from any thread.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <utility>
#include <vector>

#include "kvferry/engine.h"

namespace kvferry::python {

namespace py = pybind11;

// True once the interpreter is shutting down: taking the GIL from another thread then stops
// that thread, so engine threads must not try.
bool InterpreterFinalizing();

// True while this thread runs Python code for an engine: a PyCallback's call or the release of
// its callable.
bool InPythonCallback();

// Runs `work` on a new thread, which JoinAside (the interpreter's exit hook) joins. For closes
// that must not run on the calling engine thread.
void RunAside(std::function<void()> work);
// Joins every thread RunAside started. Without the GIL (their work may take it).
void JoinAside();

class EngineHolder : public std::enable_shared_from_this<EngineHolder> {
 public:
  explicit EngineHolder(std::unique_ptr<TransferEngine> engine) : engine_(std::move(engine)) {}
  EngineHolder(const EngineHolder&) = delete;
  EngineHolder& operator=(const EngineHolder&) = delete;
  // Closes the engine (without the GIL).
  ~EngineHolder();

  // The engine for the duration of one call. Throws StatusError (kFailedPrecondition) once the
  // engine is closing or closed. Acquire it without the GIL: it waits while Close() runs.
  class Lease {
   public:
    TransferEngine* operator->() const { return engine_; }
    TransferEngine& operator*() const { return *engine_; }

   private:
    friend class EngineHolder;
    Lease(std::shared_lock<std::shared_mutex> lock, TransferEngine* engine)
        : lock_(std::move(lock)), engine_(engine) {}
    std::shared_lock<std::shared_mutex> lock_;
    TransferEngine* engine_;
  };
  Lease Acquire();

  // Destroys the engine: pending batches fail with kCancelled (their callbacks run), threads
  // are joined. Waits for calls in progress and for a close already under way; new calls fail
  // from the start. Idempotent. Without the GIL.
  // From a Python callback (InPythonCallback) it only starts the close, on a RunAside thread:
  // new calls fail at once, and the engine stops once the callback has returned.
  void Close();
  bool closed() const { return closing_.load(); }

  // A batch whose Python object went away before it was released: released once final, by
  // the next SweepOrphans (each submission runs one).
  void Orphan(BatchId id);
  void SweepOrphans(TransferEngine& engine);

 private:
  void CloseHere();

  std::atomic<bool> closing_{false};
  std::shared_mutex mu_;  // shared by calls, exclusive by Close
  std::unique_ptr<TransferEngine> engine_;
  std::mutex stopped_mu_;
  std::condition_variable stopped_cv_;
  bool stopped_ = false;  // the engine is destroyed (guarded by stopped_mu_)
  std::mutex orphans_mu_;
  std::vector<BatchId> orphans_;
};

// A Python callable that engine threads call: Call takes the GIL, runs `invoke(callable)` and
// reports an exception it raises as unraisable (sys.unraisablehook) rather than letting it
// reach the engine. Dropping the last reference also takes the GIL. Once the interpreter is
// finalizing, calls are skipped and the callable is leaked.
class PyCallback {
 public:
  explicit PyCallback(py::object callable)
      : callable_(std::make_unique<py::object>(std::move(callable))) {}
  PyCallback(const PyCallback&) = delete;
  PyCallback& operator=(const PyCallback&) = delete;
  ~PyCallback();

  template <typename Invoke>
  void Call(Invoke&& invoke) const {
    if (InterpreterFinalizing()) return;
    Scope scope;
    py::gil_scoped_acquire gil;
    try {
      invoke(*callable_);
    } catch (py::error_already_set& error) {
      error.discard_as_unraisable("kvferry callback");
    } catch (const std::exception& error) {
      PyErr_SetString(PyExc_RuntimeError, error.what());
      PyErr_WriteUnraisable(callable_->ptr());
    }
  }

 private:
  // Marks the thread as running Python code for an engine (InPythonCallback).
  class Scope {
   public:
    Scope();
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
  };

  std::unique_ptr<py::object> callable_;
};

}  // namespace kvferry::python
