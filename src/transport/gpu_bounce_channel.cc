#include "transport/gpu_bounce_channel.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/checks.h"
#include "cuda/device_ops.h"

namespace kvferry {
namespace {

class GpuBounceChannel : public PeerChannel, public WorkOwner {
 public:
  GpuBounceChannel(const GpuBounceOptions& options, std::unique_ptr<cuda::BounceBuffers> bounce)
      : options_(options), bounce_(std::move(bounce)) {
    buffers_.resize(static_cast<size_t>(bounce_->count()));
    thread_ = std::thread([this] { Loop(); });
  }
  ~GpuBounceChannel() override { Close(); }

  void Submit(std::shared_ptr<WorkItem> item) override {
    if (item->kind != WorkItem::Kind::kWrite && item->kind != WorkItem::Kind::kRead) {
      options_.host->Submit(std::move(item));  // notifications and queries carry no GPU bytes
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!closed_) {
        auto job = std::make_shared<Job>();
        job->item = std::move(item);
        queued_.push_back(std::move(job));
        cv_.notify_one();
        return;
      }
    }
    item->Complete(UnavailableError("GPU bounce channel closed"));
  }

  void Abandon(WorkItem* item, const Status& why) override {
    std::shared_ptr<Job> unstarted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = queued_.begin(); it != queued_.end(); ++it) {
        if ((*it)->item.get() == item) {
          unstarted = std::move(*it);
          queued_.erase(it);
          break;
        }
      }
      if (unstarted == nullptr) {
        // Taken by the loop: it stops the job's chunks (it submitted them, so they are on the
        // host channel by then). One not among them has completed: nothing to do.
        auto it = taken_.find(item);
        if (it != taken_.end()) {
          abandons_.push_back({it->second, why});
          cv_.notify_one();
        }
        return;
      }
    }
    unstarted->item->Complete(why);  // outside the lock: the owner takes its own
  }

  // Fails what is queued; chunks in flight finish or fail through the host channel (close it
  // first, so that nothing waits on the network), then the thread stops.
  void Close() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_ && !thread_.joinable()) return;
      closed_ = true;
      cv_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
  }

  void OnWorkDone(WorkItem* sub, const Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    finished_.push_back({static_cast<int>(sub->request_index), status});
    cv_.notify_one();
  }

 private:
  struct Job {
    std::shared_ptr<WorkItem> item;
    uint64_t next = 0;    // bytes handed to chunks so far
    int outstanding = 0;  // chunks not finished
    int on_caller = 0;    // chunks whose device copy (caller's memory) is running
    Status error;         // first failure
    Status abandoned;     // set by Abandon / Close
    bool completed = false;
    bool write() const { return item->kind == WorkItem::Kind::kWrite; }
  };
  struct Buffer {
    enum State { kFree, kFromDevice, kTcp, kToDevice } state = kFree;
    std::shared_ptr<Job> job;
    uint64_t offset = 0;
    uint64_t length = 0;
    std::shared_ptr<WorkItem> sub;  // the chunk's host-channel item while kTcp
  };

  void Loop() {
    std::vector<std::pair<int, Status>> finished;
    std::vector<std::pair<std::shared_ptr<Job>, Status>> abandons;
    bool close_seen = false;  // after the round that saw Close, only chunk results wake us
    while (true) {
      bool closing = false;
      {
        std::unique_lock<std::mutex> lock(mu_);
        auto has_work = [&] {
          return (closed_ && !close_seen) || !queued_.empty() || !finished_.empty() ||
                 !abandons_.empty();
        };
        if (copies_running_ > 0) {
          cv_.wait_for(lock, std::chrono::microseconds(20), has_work);
        } else {
          cv_.wait(lock, [&] { return has_work() || (closed_ && Idle()); });
        }
        closing = closed_;
        close_seen = closed_;
        while (!queued_.empty()) {
          // Taken: the engine may no longer complete it as queued (a cancelled batch
          // completes queued items itself). One it already completed is dropped.
          uint8_t expected = WorkItem::kQueued;
          if (queued_.front()->item->state.compare_exchange_strong(expected, WorkItem::kTaken)) {
            taken_[queued_.front()->item.get()] = queued_.front();
            active_.push_back(std::move(queued_.front()));
          }
          queued_.pop_front();
        }
        finished.swap(finished_);
        abandons.swap(abandons_);
      }
      for (auto& [job, why] : abandons) StopJob(*job, why);
      abandons.clear();
      if (closing) {
        for (auto& job : active_) {
          if (job->abandoned.ok()) job->abandoned = UnavailableError("GPU bounce channel closed");
        }
      }
      for (auto& [index, status] : finished) OnChunkSent(index, status);
      finished.clear();
      PollCopies();
      if (!closing) StartChunks();
      CompleteJobs();
      if (closing && active_.empty() && Idle()) return;
    }
  }

  bool Idle() const {
    return std::all_of(buffers_.begin(), buffers_.end(),
                       [](const Buffer& b) { return b.state == Buffer::kFree; });
  }

  void Free(int i) {
    Buffer& b = buffers_[static_cast<size_t>(i)];
    --b.job->outstanding;
    b = Buffer{};
  }

  // Abandons a job (loop thread): no chunk of it starts any more, and its chunks on the host
  // channel, which only touch bounce buffers but hold them, are interrupted.
  void StopJob(Job& job, const Status& why) {
    if (!job.abandoned.ok() || job.completed) return;
    job.abandoned = why;
    for (const Buffer& b : buffers_) {
      // Abandon may complete the chunk at once (OnWorkDone only queues its result).
      if (b.state == Buffer::kTcp && b.job.get() == &job) options_.host->Abandon(b.sub.get(), why);
    }
  }

  void Fail(Job& job, const Status& s) {
    if (job.error.ok()) job.error = s;
  }

  // A chunk's host-channel item finished: a WRITE chunk is done; a READ chunk goes to the device.
  void OnChunkSent(int i, const Status& status) {
    Buffer& b = buffers_[static_cast<size_t>(i)];
    Job& job = *b.job;
    b.sub.reset();
    if (!status.ok()) Fail(job, status);
    if (job.write() || !status.ok() || !job.error.ok() || !job.abandoned.ok()) {
      Free(i);
      return;
    }
    Status s = bounce_->StartToDevice(i, job.item->local + b.offset, b.length);
    if (!s.ok()) {
      Fail(job, s);
      Free(i);
      return;
    }
    SetState(i, Buffer::kToDevice);
    ++job.on_caller;
  }

  void SetState(int i, Buffer::State state) {
    Buffer& b = buffers_[static_cast<size_t>(i)];
    if (b.state == Buffer::kFromDevice || b.state == Buffer::kToDevice) --copies_running_;
    b.state = state;
    if (state == Buffer::kFromDevice || state == Buffer::kToDevice) ++copies_running_;
  }

  void PollCopies() {
    for (int i = 0; i < static_cast<int>(buffers_.size()); ++i) {
      Buffer& b = buffers_[static_cast<size_t>(i)];
      if (b.state != Buffer::kFromDevice && b.state != Buffer::kToDevice) continue;
      StatusOr<bool> ready = bounce_->Ready(i);
      if (ready.ok() && !*ready) continue;
      Job& job = *b.job;
      --job.on_caller;
      const bool to_wire =
          b.state == Buffer::kFromDevice && ready.ok() && job.error.ok() && job.abandoned.ok();
      if (!ready.ok()) Fail(job, ready.status());
      if (!to_wire) {
        SetState(i, Buffer::kFree);
        Free(i);
        continue;
      }
      SendChunk(i, WorkItem::Kind::kWrite);
    }
  }

  void SendChunk(int i, WorkItem::Kind kind) {
    Buffer& b = buffers_[static_cast<size_t>(i)];
    auto sub = std::make_shared<WorkItem>();
    sub->kind = kind;
    sub->local = bounce_->host(i);
    sub->remote_addr = b.job->item->remote_addr + b.offset;
    sub->length = b.length;
    sub->owner = this;
    sub->request_index = static_cast<uint32_t>(i);
    b.sub = sub;
    SetState(i, Buffer::kTcp);
    options_.host->Submit(std::move(sub));
  }

  // Hands free buffers to the next bytes of the oldest jobs.
  void StartChunks() {
    int free_index = 0;
    auto next_free = [&]() -> int {
      while (free_index < static_cast<int>(buffers_.size()) &&
             buffers_[static_cast<size_t>(free_index)].state != Buffer::kFree) {
        ++free_index;
      }
      return free_index < static_cast<int>(buffers_.size()) ? free_index : -1;
    };
    for (auto& job : active_) {
      while (job->next < job->item->length && job->error.ok() && job->abandoned.ok()) {
        const int i = next_free();
        if (i < 0) return;
        Buffer& b = buffers_[static_cast<size_t>(i)];
        const uint64_t n = std::min(bounce_->bytes(), job->item->length - job->next);
        b.job = job;
        b.offset = job->next;
        b.length = n;
        job->next += n;
        ++job->outstanding;
        if (!job->write()) {
          SendChunk(i, WorkItem::Kind::kRead);
          continue;
        }
        Status s = bounce_->StartFromDevice(i, job->item->local + b.offset, n);
        if (!s.ok()) {
          Fail(*job, s);
          Free(i);
          continue;
        }
        SetState(i, Buffer::kFromDevice);
        ++job->on_caller;
      }
    }
  }

  // A job completes once no copy touches the caller's memory and, unless abandoned, every
  // chunk finished. Chunks of an abandoned job may still be on the wire (bounce memory only).
  void CompleteJobs() {
    for (auto it = active_.begin(); it != active_.end();) {
      Job& job = **it;
      const bool stopped = !job.error.ok() || !job.abandoned.ok();
      const bool all_sent = job.next >= job.item->length;
      if (!job.completed && job.on_caller == 0 &&
          ((stopped && (!job.abandoned.ok() || job.outstanding == 0)) ||
           (all_sent && job.outstanding == 0))) {
        job.completed = true;
        job.item->Complete(!job.abandoned.ok() ? job.abandoned : job.error);
      }
      if (job.completed && job.outstanding == 0) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          taken_.erase(job.item.get());
        }
        it = active_.erase(it);
      } else {
        ++it;
      }
    }
  }

  const GpuBounceOptions options_;
  std::unique_ptr<cuda::BounceBuffers> bounce_;  // used by the loop thread only
  std::thread thread_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool closed_ = false;
  std::deque<std::shared_ptr<Job>> queued_;
  std::vector<std::pair<int, Status>> finished_;  // (buffer, status) of chunks' host-channel items
  // Jobs the loop took, by item, until it drops them (Abandon finds them here).
  std::unordered_map<WorkItem*, std::shared_ptr<Job>> taken_;
  std::vector<std::pair<std::shared_ptr<Job>, Status>> abandons_;
  // Loop thread only (also the wait predicate's Idle, which runs on it).
  std::vector<Buffer> buffers_;
  int copies_running_ = 0;

  std::deque<std::shared_ptr<Job>> active_;  // loop thread only
};

}  // namespace

StatusOr<std::unique_ptr<PeerChannel>> CreateGpuBounceChannel(const GpuBounceOptions& options) {
  if (options.host == nullptr)
    return InvalidArgumentError("GPU bounce channel needs a host channel");
  if (options.num_buffers < 1 || options.buffer_bytes == 0) {
    return InvalidArgumentError("GPU bounce channel needs at least one buffer of at least a byte");
  }
  ASSIGN_OR_RETURN(
      auto bounce,
      cuda::BounceBuffers::Create(options.local_device, options.num_buffers, options.buffer_bytes));
  return std::unique_ptr<PeerChannel>(new GpuBounceChannel(options, std::move(bounce)));
}

}  // namespace kvferry
