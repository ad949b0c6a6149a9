#include "batch.h"

#include <chrono>
#include <cmath>
#include <string>

#include "errors.h"
#include "wait_slices.h"

namespace kvferry::python {
namespace {

using Clock = std::chrono::steady_clock;

// Wait slices: short enough that Ctrl-C and Close() are noticed promptly.
constexpr std::chrono::milliseconds kWaitSlice{100};

bool IsFinal(const BatchStatus& status) { return status.state != TransferState::kPending; }

std::string StateName(TransferState state) { return std::string(TransferStateName(state)); }

}  // namespace

PyBatch::~PyBatch() {
  if (!released_) holder_->Orphan(id_);
}

void PyBatch::CheckNotReleased() const {
  if (released_) {
    throw StatusError(NotFoundError("batch " + std::to_string(id_.value) + " was released"));
  }
}

BatchStatus PyBatch::Poll() {
  CheckNotReleased();
  py::gil_scoped_release release;
  return ValueOrThrow(holder_->Acquire()->GetBatchStatus(id_));
}

BatchStatus PyBatch::Wait(std::optional<double> timeout_s) {
  CheckNotReleased();
  if (timeout_s && (std::isnan(*timeout_s) || *timeout_s < 0)) {
    throw StatusError(InvalidArgumentError("timeout must be >= 0 seconds or None (got " +
                                           std::to_string(*timeout_s) + ")"));
  }
  std::optional<Clock::time_point> until;
  if (timeout_s && !std::isinf(*timeout_s)) until = AddSeconds(Clock::now(), *timeout_s);
  return WaitInSlices(
      until, kWaitSlice,
      [&](std::chrono::milliseconds slice) {
        py::gil_scoped_release release;
        return ValueOrThrow(holder_->Acquire()->WaitBatch(id_, slice));
      },
      IsFinal);
}

BatchStatus PyBatch::Result(std::optional<double> timeout_s, bool release) {
  BatchStatus status = Wait(timeout_s);
  if (!IsFinal(status)) {
    PyErr_SetString(
        PyExc_TimeoutError,
        ("batch " + std::to_string(id_.value) + " still pending after the timeout").c_str());
    throw py::error_already_set();
  }
  if (release) Release();
  if (status.state != TransferState::kCompleted) {
    Status error = status.error;
    if (error.ok()) {
      error = status.state == TransferState::kCancelled
                  ? CancelledError("batch cancelled")
                  : Status(StatusCode::kUnknown, "batch failed without a reason");
    }
    throw StatusError(error);
  }
  return status;
}

void PyBatch::Cancel() {
  CheckNotReleased();
  py::gil_scoped_release release;
  ThrowIfError(holder_->Acquire()->CancelBatch(id_));
}

TransferStatus PyBatch::RequestStatus(size_t index) {
  CheckNotReleased();
  py::gil_scoped_release release;
  return ValueOrThrow(holder_->Acquire()->GetTransferStatus(id_, index));
}

void PyBatch::Release() {
  py::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(release_mu_);  // a second caller waits for the first
  if (released_.load()) return;
  ThrowIfError(holder_->Acquire()->ReleaseBatch(id_));  // refuses a pending batch
  released_.store(true);
}

void BindBatch(py::module_& m) {
  py::enum_<TransferState>(m, "TransferState", "State of a request or a batch.")
      .value("PENDING", TransferState::kPending, "submitted, not final")
      .value("COMPLETED", TransferState::kCompleted,
             "every byte delivered (a WRITE: acknowledged by the peer)")
      .value("FAILED", TransferState::kFailed, "failed: see `error`")
      .value("CANCELLED", TransferState::kCancelled, "cancelled before it was put on the wire");

  py::class_<TransferStatus>(m, "TransferStatus", "The status of one request of a batch.")
      .def_readonly("state", &TransferStatus::state)
      .def_readonly("transferred_bytes", &TransferStatus::transferred_bytes)
      .def_property_readonly(
          "error", [](const TransferStatus& s) { return ErrorObject(s.error); },
          "The kvferry.Error of a failed or cancelled request, else None.")
      .def("__repr__", [](const TransferStatus& s) {
        return "TransferStatus(state=" + StateName(s.state) +
               ", transferred_bytes=" + std::to_string(s.transferred_bytes) + ")";
      });

  py::class_<BatchStatus>(m, "BatchStatus",
                          "The status of a batch: COMPLETED only when every request is.")
      .def_readonly("state", &BatchStatus::state)
      .def_readonly("num_requests", &BatchStatus::num_requests)
      .def_readonly("num_completed", &BatchStatus::num_completed)
      .def_readonly("num_failed", &BatchStatus::num_failed, "failed or cancelled requests")
      .def_readonly("transferred_bytes", &BatchStatus::transferred_bytes)
      .def_property_readonly(
          "error", [](const BatchStatus& s) { return ErrorObject(s.error); },
          "The kvferry.Error of the first failure, else None.")
      .def_property_readonly(
          "done", [](const BatchStatus& s) { return IsFinal(s); },
          "True once the batch is final (completed, failed or cancelled).")
      .def_property_readonly(
          "ok", [](const BatchStatus& s) { return s.state == TransferState::kCompleted; },
          "True when every request completed.")
      .def("__repr__", [](const BatchStatus& s) {
        std::string text = "BatchStatus(state=" + StateName(s.state) +
                           ", completed=" + std::to_string(s.num_completed) + "/" +
                           std::to_string(s.num_requests) +
                           ", failed=" + std::to_string(s.num_failed) +
                           ", transferred_bytes=" + std::to_string(s.transferred_bytes);
        if (!s.error.ok()) text += ", error='" + s.error.ToString() + "'";
        return text + ")";
      });

  py::class_<PyBatch>(m, "Batch",
                      "A submitted batch of transfer requests (TransferEngine.submit_write, "
                      "submit_read, submit_notification). Release it when done with it; a "
                      "batch dropped before that is released by the engine once final.")
      .def_property_readonly("id", &PyBatch::id, "The engine's id of the batch (an int > 0).")
      .def_property_readonly("num_requests", &PyBatch::num_requests)
      .def("poll", &PyBatch::Poll,
           "The batch's status now; never blocks on the network.\n\n"
           "Raises NotFoundError (released) or FailedPreconditionError (engine closed).")
      .def("wait", &PyBatch::Wait, py::arg("timeout") = py::none(),
           "Blocks (without the GIL) until the batch is final or `timeout` seconds passed "
           "(None or math.inf: until final, which its deadline bounds) and returns its "
           "BatchStatus, PENDING when the timeout passed first. Does not raise the batch's error "
           "(see result()).\n\nRaises NotFoundError (released), FailedPreconditionError "
           "(engine closed), KeyboardInterrupt.")
      .def("result", &PyBatch::Result, py::arg("timeout") = py::none(), py::arg("release") = true,
           "Waits like wait(), then returns the BatchStatus of a completed batch or raises the "
           "kvferry.Error of its first failure (e.g. UnavailableError, "
           "DeadlineExceededError, FailedPreconditionError, CancelledError); releases a "
           "final batch when `release`.\n\nRaises TimeoutError when the batch is still "
           "pending after `timeout` seconds.")
      .def("cancel", &PyBatch::Cancel,
           "Cancels the requests not yet on the wire (they turn CANCELLED); those already "
           "sent finish with their real outcome (FAILED when cut part-way), and the batch's "
           "notification, unless already sent, is not sent. Blocks until the batch is "
           "final.\n\n"
           "Raises NotFoundError (released).")
      .def("request_status", &PyBatch::RequestStatus, py::arg("index"),
           "The TransferStatus of request `index` (0-based).\n\nRaises OutOfRangeError, "
           "NotFoundError (released).")
      .def("release", &PyBatch::Release,
           "Forgets a final batch (later calls raise NotFoundError). Idempotent.\n\n"
           "Raises FailedPreconditionError while it is still pending.")
      .def("__repr__", [](const PyBatch& b) {
        return "Batch(id=" + std::to_string(b.id()) +
               ", num_requests=" + std::to_string(b.num_requests()) + ")";
      });
}

}  // namespace kvferry::python
