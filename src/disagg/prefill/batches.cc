// The prefill connector's engine submissions (see prefill/batches.h).
#include "disagg/prefill/batches.h"

#include <thread>

namespace kvferry::prefill {

BatchSender::BatchSender(TransferEngine* engine, TaskQueue* control, TaskQueue* completion,
                         std::chrono::milliseconds transfer_timeout)
    : engine_(engine),
      control_(control),
      completion_(completion),
      transfer_timeout_(transfer_timeout) {}

BatchId BatchSender::SubmitThen(std::vector<TransferRequest> requests, std::string notification,
                                std::shared_ptr<void> keepalive,
                                std::function<void(const BatchStatus&)> done,
                                std::function<void()> refused, bool inline_success,
                                std::function<void()> on_landed, void* start_after_event) {
  uint64_t bytes = 0;
  for (const auto& r : requests) bytes += r.total_bytes();  // every row of a strided one
  transfer_requests_ += requests.size();
  bytes_ += bytes;
  BatchOptions o;
  o.deadline = transfer_timeout_;
  o.notification = std::move(notification);
  o.on_landed = std::move(on_landed);
  o.start_after_event = start_after_event;
  o.on_complete = [this, done, keepalive, inline_success](BatchId id, const BatchStatus& status) {
    Complete(id, status, done, keepalive, inline_success);
  };
  auto id = engine_->SubmitBatch(requests, o);
  if (!id.ok()) {
    if (refused) refused();
    BatchStatus failed;
    failed.state = TransferState::kFailed;
    failed.error = id.status();
    completion_->Post([done, failed] { done(failed); });
    return BatchId{};
  }
  return *id;
}

void BatchSender::NotifyThen(SegmentHandle segment, std::string notification,
                             std::function<void(const BatchStatus&)> done,
                             std::chrono::milliseconds deadline) {
  BatchOptions o;
  o.deadline = deadline.count() > 0 ? deadline : transfer_timeout_;
  o.on_complete = [this, done](BatchId id, const BatchStatus& status) {
    Complete(id, status, done, nullptr, /*inline_success=*/true);
  };
  auto id = engine_->SubmitNotification(segment, std::move(notification), o);
  if (!id.ok()) {
    BatchStatus failed;
    failed.state = TransferState::kFailed;
    failed.error = id.status();
    completion_->Post([done, failed] { done(failed); });
  }
}

void BatchSender::Complete(BatchId id, const BatchStatus& status,
                           const std::function<void(const BatchStatus&)>& done,
                           const std::shared_ptr<void>& keepalive, bool inline_success) {
  if (inline_success && status.state == TransferState::kCompleted && EnterInline()) {
    engine_->ReleaseBatch(id).IgnoreError();
    done(status);
    LeaveInline();
    return;
  }
  completion_->Post([this, done, id, status, keepalive] {
    engine_->ReleaseBatch(id).IgnoreError();
    done(status);
  });
}

void BatchSender::Finish(const BatchStatus& status,
                         const std::function<void(const BatchStatus&)>& done) {
  if (status.state == TransferState::kCompleted && EnterInline()) {
    done(status);
    LeaveInline();
    return;
  }
  completion_->Post([done, status] { done(status); });
}

void BatchSender::CountPulled(std::span<const TransferRequest> requests) {
  uint64_t bytes = 0;
  for (const auto& r : requests) bytes += r.total_bytes();
  transfer_requests_ += requests.size();
  bytes_ += bytes;
}

Status BatchSender::TransferNow(const TransferRequest& request) {
  Status s = TransferSync(*engine_, std::span(&request, 1));
  ++transfer_requests_;
  bytes_ += request.total_bytes();
  return s;
}

void BatchSender::Tell(const std::shared_ptr<DecodePeer>& decode, const ControlMessage& m) {
  if (decode == nullptr || decode->segment.value == 0) return;  // never connected
  // Submitted from the control queue, so that the notice leaves after the cancels posted
  // before it ended (CancelLater); not waited for there, so that notices to a peer that does
  // not answer wait out their deadlines side by side instead of one after another.
  control_->Post([this, segment = decode->segment, text = EncodeControl(m)] {
    NotifyThen(
        segment, text, [](const BatchStatus&) {}, std::chrono::milliseconds(2000));
  });
}

void BatchSender::CancelLater(std::vector<BatchId> ids) {
  control_->Post([this, ids = std::move(ids)] {
    for (BatchId id : ids) engine_->CancelBatch(id).IgnoreError();  // kNotFound once released
  });
}

void BatchSender::StopInline() {
  inline_stopping_.store(true);
  while (inline_active_.load() > 0) std::this_thread::yield();
}

bool BatchSender::EnterInline() {
  inline_active_.fetch_add(1);
  if (!inline_stopping_.load()) return true;
  inline_active_.fetch_sub(1);
  return false;
}

}  // namespace kvferry::prefill
