// Batches that decode pulls (see prefill/pull_sender.h).
#include "disagg/prefill/pull_sender.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "common/logging.h"

namespace kvferry::prefill {
namespace {

BatchStatus Failed(Status why) {
  BatchStatus s;
  s.state = TransferState::kFailed;
  s.error = std::move(why);
  return s;
}

}  // namespace

PullSender::PullSender(BatchSender* batches, std::chrono::milliseconds transfer_timeout)
    : batches_(batches), transfer_timeout_(transfer_timeout) {}

bool PullSender::Fits(std::span<const TransferRequest> requests) {
  return !requests.empty() && requests.size() <= kMaxPullCopies &&
         std::all_of(requests.begin(), requests.end(),
                     [](const TransferRequest& r) { return r.op == TransferOp::kWrite; });
}

void PullSender::Send(const std::shared_ptr<DecodePeer>& decode, uint64_t room,
                      std::vector<TransferRequest> requests, ControlType note,
                      std::function<void(const BatchStatus&)> done) {
  ControlMessage m;
  m.type = ControlType::kPullRequest;
  m.room = room;
  m.note = note;
  m.pulls.reserve(requests.size());
  for (const TransferRequest& r : requests) {
    m.pulls.push_back({reinterpret_cast<uint64_t>(r.local_addr), r.remote_addr, r.length_bytes,
                       r.num_rows, r.local_stride, r.remote_stride});
  }
  m.deadline_ms = static_cast<uint32_t>(
      std::clamp<int64_t>(transfer_timeout_.count(), 1, std::numeric_limits<uint32_t>::max()));
  const auto deadline = [this] {
    return std::chrono::steady_clock::now() + transfer_timeout_ + std::chrono::seconds(2);
  };
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) {
      lock.unlock();
      batches_->Finish(Failed(CancelledError("prefill connector closing")), done);
      return;
    }
    m.pull_id = next_id_++;
    pending_[m.pull_id] = {decode->args.decode_address, room, deadline(), std::move(done), {}};
  }
  batches_->CountPulled(requests);
  const uint64_t id = m.pull_id;
  // Acknowledged once decode's handler took the request and submitted its READs, which then
  // end within the transfer timeout: the wait for the answer counts from here. A send that
  // failed may still have been delivered (a lost acknowledgement): it waits as long.
  batches_->NotifyThen(
      decode->segment, EncodeControl(m), [this, id, deadline](const BatchStatus& s) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = pending_.find(id);
        if (it == pending_.end()) return;
        it->second.deadline = deadline();
        if (s.state != TransferState::kCompleted) {
          it->second.send_error = s.error.WithContext("sending the pull request to decode");
        }
      });
}

bool PullSender::OnPullDone(const std::string& from, const ControlMessage& m) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(m.pull_id);
    if (it == pending_.end() || it->second.decode_address != from || it->second.room != m.room) {
      return false;
    }
  }
  if (m.status_code == 0) {
    BatchStatus ok;
    ok.state = TransferState::kCompleted;
    End(m.pull_id, ok);
  } else {
    End(m.pull_id, Failed(Status(StatusCodeFromInt(m.status_code),
                                 "decode " + from + " pulling: " + m.reason)));
  }
  return true;
}

void PullSender::Expire(std::chrono::steady_clock::time_point now) {
  std::vector<uint64_t> late;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, p] : pending_) {
      if (p.deadline <= now) late.push_back(id);
    }
  }
  for (uint64_t id : late) {
    Status why = DeadlineExceededError("decode did not answer the pull request within " +
                                       std::to_string(transfer_timeout_.count()) + " ms (and 2 s)");
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(id);
      if (it != pending_.end() && !it->second.send_error.ok()) {
        why = it->second.send_error.WithContext(why.message());
      }
    }
    End(id, Failed(why));
  }
}

void PullSender::Close() {
  std::vector<uint64_t> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    for (const auto& [id, p] : pending_) all.push_back(id);
  }
  for (uint64_t id : all) End(id, Failed(CancelledError("prefill connector closing")));
}

void PullSender::End(uint64_t id, const BatchStatus& status) {
  std::function<void(const BatchStatus&)> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return;
    done = std::move(it->second.done);
    pending_.erase(it);
  }
  if (status.state != TransferState::kCompleted) {
    KVF_LOG_DEBUG("prefill: pull {} failed: {}", id, status.error.ToString());
  }
  batches_->Finish(status, done);
}

}  // namespace kvferry::prefill
