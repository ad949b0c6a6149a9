#include "transport/tcp/tcp_peer.h"

#include <fmt/format.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>

#include "common/checks.h"
#include "common/logging.h"
#include "transport/tcp/tcp_common.h"

namespace kvferry::tcp {

// TCP's stages of a WorkItem between WorkItem::kQueued and kDone, in order. kSending: a lane
// thread is writing it. kSent: written, the answer not yet read. kReceiving: the lane's reader
// is completing it. kAcked: the peer answered while the sending thread was still inside its
// write call (the bytes are in the kernel, but the call has not returned); that thread
// completes the item with acked_status once it returns, so nothing frees the item's memory
// under it.
enum TcpStage : uint8_t {
  kSending = WorkItem::kTaken,
  kSent,
  kReceiving,
  kAcked,
};

// One connection with its two threads. Items move queue_ -> inflight_ -> completed.
class TcpLane : public std::enable_shared_from_this<TcpLane> {
 public:
  TcpLane(const TcpPeerOptions& options, PeerIdentity& identity, int index)
      : options_(options), identity_(identity), index_(index) {}
  ~TcpLane() { Join(); }

  // Starts the lane on an already connected socket, or connects first (in the sender thread).
  void Start(std::unique_ptr<asio::io_context> io, std::unique_ptr<asio::ip::tcp::socket> socket) {
    connect_first_ = socket == nullptr;
    io_ = connect_first_ ? std::make_unique<asio::io_context>() : std::move(io);
    socket_ = connect_first_ ? std::make_unique<asio::ip::tcp::socket>(*io_) : std::move(socket);
    auto self = shared_from_this();
    threads_started_.fetch_add(1);
    sender_ = std::thread([self] {
      self->SenderMain();
      self->threads_returned_.fetch_add(1, std::memory_order_release);
    });
  }

  // Queues `item` for the sender thread, or, with `allow_inline` when the lane is idle
  // (connected, nothing queued, nobody sending) and the frame is small, sends it from the
  // calling thread: an idle sender thread takes ~150 us to wake on some hosts, more than the
  // frame takes to travel. The inline send goes only where the kernel's send queue has room
  // for the frame twice over, so a slow peer does not hold the caller.
  void Enqueue(std::shared_ptr<WorkItem> item, bool allow_inline) {
    std::unique_lock<std::mutex> lock(mu_);
    if (broken_) {
      lock.unlock();
      item->Complete(broken_reason());
      return;
    }
    item->carrier.store(this);
    outstanding_bytes_ += item->length + 64;
    // Only on a lane with nothing in flight either: a peer busy answering earlier requests
    // may not be reading, and this thread may be one that drains answers.
    if (allow_inline && connected_ && !sending_ && queue_.empty() && inflight_.empty() &&
        InlineSize(*item) && SendQueueHasRoom()) {
      uint8_t expected = WorkItem::kQueued;
      if (item->state.compare_exchange_strong(expected, kSending)) {
        sending_ = true;
        inflight_.push_back(item);
        lock.unlock();
        std::vector<std::shared_ptr<WorkItem>> one{std::move(item)};
        SendFrames(one, /*inline_caller=*/true);
        lock.lock();
        sending_ = false;
        cv_.notify_all();  // the sender thread (queued work, early answers) or ThreadExit
        return;
      }
      outstanding_bytes_ -= item->length + 64;  // abandoned already
      return;
    }
    queue_.push_back(std::move(item));
    cv_.notify_one();
  }

  // Interrupts both threads; the last one to exit completes what is left with `why`.
  // `connection_lost`: counted in the peer's lost connections (not an abandon or a close).
  void Fail(const Status& why, bool connection_lost = true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_) return;
      broken_ = true;
      reason_ = why;
      if (connection_lost) identity_.CountLaneFailure();
      cv_.notify_all();
      // Under the lock: ThreadExit marks the socket closed before closing it, so the number
      // cannot belong to another socket by now. This also ends a connect or handshake in
      // progress; before the socket opened the descriptor is -1 (shutdown refuses it) and
      // SenderMain's connect then never opens it (it opens under this lock, unless broken_).
      if (!socket_closed_) ::shutdown(socket_->native_handle(), SHUT_RDWR);
    }
  }

  bool broken() const {
    std::lock_guard<std::mutex> lock(mu_);
    return broken_;
  }
  // Every thread this lane started has returned from its work (what is left of it is
  // releasing its reference): Join() then does not wait.
  bool threads_returned() const {
    return threads_returned_.load(std::memory_order_acquire) == threads_started_.load();
  }
  uint64_t outstanding_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return outstanding_bytes_;
  }
  Status broken_reason() const {
    std::lock_guard<std::mutex> lock(mu_);
    return reason_;
  }

  // Joins both threads. When the last reference drops on a lane thread itself, that thread
  // is detached instead (it is about to return).
  void Join() {
    for (std::thread* t : {&sender_, &receiver_}) {
      if (!t->joinable()) continue;
      if (t->get_id() == std::this_thread::get_id()) {
        t->detach();
      } else {
        t->join();
      }
    }
  }

 private:
  void SenderMain() {
    if (connect_first_) {
      Status s = broken_reason();  // failed before it began
      SegmentDescriptor reached;
      if (s.ok()) {
        // Opens and closes the socket under mu_, where Fail shuts it down, and not at all
        // once Fail ran: no shutdown can reach a closed number, and no connect outlives Fail.
        auto guard = [this](const std::function<void()>& op) {
          std::lock_guard<std::mutex> lock(mu_);
          if (broken_) return false;
          op();
          return true;
        };
        s = ConnectAndHello(*socket_, options_.address, options_.self, options_.auth_secret,
                            options_.connect_timeout, options_.max_body_bytes, &reached, guard);
        if (s.ok()) s = identity_.Check(reached);
      }
      if (!s.ok()) {
        Fail(s);
        {
          std::lock_guard<std::mutex> lock(mu_);
          threads_alive_ = 1;
        }
        ThreadExit();
        return;
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_) {  // failed while connecting
        threads_alive_ = 1;
      } else {
        auto self = shared_from_this();
        threads_started_.fetch_add(1);
        receiver_ = std::thread([self] {
          self->ReceiverMain();
          self->threads_returned_.fetch_add(1, std::memory_order_release);
        });
        socklen_t len = sizeof(send_capacity_);
        if (::getsockopt(socket_->native_handle(), SOL_SOCKET, SO_SNDBUF, &send_capacity_, &len) !=
            0) {
          send_capacity_ = 0;  // unknown: never inline
        }
        connected_ = true;
      }
    }
    SendLoop();
    ThreadExit();
  }

  // Frames small enough to send from the calling thread (Enqueue).
  static bool InlineSize(const WorkItem& item) {
    switch (item.kind) {
      case WorkItem::Kind::kNotify:
        return item.message.size() <= kInlineBytes;
      case WorkItem::Kind::kRead:
      case WorkItem::Kind::kDescribe:
        return true;
      case WorkItem::Kind::kWrite:
        return item.rows == 1 && item.length <= kInlineBytes;
    }
    return false;
  }
  // Whether the socket's send queue has room for an inline frame twice over (SIOCOUTQ
  // against SO_SNDBUF), so that the send completes without waiting.
  bool SendQueueHasRoom() const {
    int queued = 0;
    if (::ioctl(socket_->native_handle(), SIOCOUTQ, &queued) != 0) return false;
    return queued + 2 * static_cast<int>(kInlineBytes + wire::kFrameHeaderBytes) <= send_capacity_;
  }

  void SendLoop() {
    // Gathers up to kMaxGather items or kMaxGatherBytes into one writev.
    constexpr size_t kMaxGather = 64;
    constexpr uint64_t kMaxGatherBytes = 1ull << 20;
    std::vector<std::shared_ptr<WorkItem>> batch;
    batch.reserve(kMaxGather);
    while (true) {
      batch.clear();
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] {
          return broken_ || !acked_early_.empty() || (!queue_.empty() && !sending_);
        });
        if (broken_) return;
        if (!acked_early_.empty()) {
          // Answered before an inline sender's write returned: completed here, not on the
          // caller's thread (completion callbacks run on lane threads).
          std::vector<std::shared_ptr<WorkItem>> early;
          early.swap(acked_early_);
          lock.unlock();
          for (auto& item : early) item->Complete(item->acked_status);
          continue;
        }
        uint64_t bytes = 0;
        while (!queue_.empty() && batch.size() < kMaxGather &&
               (batch.empty() || bytes + queue_.front()->length <= kMaxGatherBytes)) {
          std::shared_ptr<WorkItem> item = std::move(queue_.front());
          queue_.pop_front();
          uint8_t expected = WorkItem::kQueued;
          if (!item->state.compare_exchange_strong(expected, kSending)) {
            outstanding_bytes_ -= item->length + 64;  // abandoned while queued
            continue;
          }
          bytes += item->length;
          inflight_.push_back(item);
          batch.push_back(std::move(item));
        }
        if (batch.empty()) continue;
        sending_ = true;
      }
      const bool sent = SendFrames(batch);
      std::lock_guard<std::mutex> lock(mu_);
      sending_ = false;
      if (!sent) return;
    }
  }

  // Writes the frames of `batch` (already in inflight_, in this order) to the socket. The
  // caller holds the sending turn (sending_). Returns false when the connection failed (the
  // lane is then failed). Items answered before the write returned (kAcked) are completed
  // here by the sender thread; an `inline_caller` hands them to the sender thread instead.
  bool SendFrames(std::vector<std::shared_ptr<WorkItem>>& batch, bool inline_caller = false) {
    std::vector<wire::HeaderBytes>& headers = send_headers_;
    std::vector<std::array<uint8_t, wire::kStridedBodyBytes>>& bodies = send_bodies_;
    std::vector<asio::const_buffer>& buffers = send_buffers_;
    headers.clear();
    bodies.clear();
    buffers.clear();
    for (const auto& item : batch) {
      wire::FrameHeader h;
      h.request_id = next_request_id_++;
      switch (item->kind) {
        case WorkItem::Kind::kWrite:
          h.type = wire::FrameType::kWrite;
          h.addr = item->remote_addr;
          h.length = item->length;
          if (item->rows > 1) {
            h.flags = wire::kFlagStrided;
            h.body_bytes = wire::kStridedBodyBytes;
            bodies.push_back(
                wire::EncodeStridedWrite({item->rows, item->row_bytes, item->remote_stride}));
          }
          break;
        case WorkItem::Kind::kRead:
          h.type = wire::FrameType::kRead;
          h.addr = item->remote_addr;
          h.length = item->length;
          break;
        case WorkItem::Kind::kNotify:
          h.type = wire::FrameType::kNotify;
          h.body_bytes = static_cast<uint32_t>(item->message.size());
          break;
        case WorkItem::Kind::kDescribe:
          h.type = wire::FrameType::kDescribe;
          break;
      }
      headers.push_back(wire::EncodeFrameHeader(h));
    }
    size_t body = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      const auto& item = batch[i];
      buffers.push_back(asio::buffer(headers[i]));
      if (item->kind == WorkItem::Kind::kNotify && !item->message.empty()) {
        buffers.push_back(asio::buffer(item->message));
      } else if (item->kind == WorkItem::Kind::kWrite && item->rows > 1) {
        buffers.push_back(asio::buffer(bodies[body++]));
        for (uint32_t r = 0; r < item->rows; ++r) {
          buffers.push_back(asio::buffer(item->local + r * item->local_stride, item->row_bytes));
        }
      } else if (item->kind == WorkItem::Kind::kWrite) {
        buffers.push_back(asio::buffer(item->local, item->length));
      }
    }
    asio::error_code ec;
    WriteAll(*socket_, buffers, ec);
    // Each item leaves kSending here, as it does on success: an answer the receiving thread
    // reads from now on completes it itself, and one it read already (kAcked) is this thread's
    // to complete. (Only reading the state let an answer read after this loop, from bytes
    // buffered before the failure, leave its item kAcked with nobody to complete it.)
    for (const auto& item : batch) {
      uint8_t expected = kSending;
      if (!item->state.compare_exchange_strong(expected, kSent) && expected == kAcked) {
        CompleteAcked(item, inline_caller);  // answered while write() had not returned
      }
    }
    if (ec) {
      Fail(UnavailableError("connection to peer " + options_.address + " (lane " +
                            std::to_string(index_) + ") failed while sending: " + ec.message()));
      return false;
    }
    return true;
  }

  void CompleteAcked(const std::shared_ptr<WorkItem>& item, bool inline_caller) {
    if (!inline_caller) {
      item->Complete(item->acked_status);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (threads_alive_ > 0) {
        // The sender thread (notified by Enqueue), or the last lane thread to exit, completes it.
        acked_early_.push_back(item);
        return;
      }
    }
    item->Complete(item->acked_status);  // no lane thread left: nobody else will
  }

  void ReceiverMain() {
    ReceiveLoop();
    ThreadExit();
  }

  void ReceiveLoop() {
    std::vector<uint8_t> scratch;
    while (true) {
      asio::error_code ec;
      auto header = ReadHeader(*socket_, options_.max_body_bytes, ec);
      if (ec) {
        Fail(UnavailableError("connection to peer " + options_.address + " lost: " + ec.message()));
        return;
      }
      if (!header.ok()) {
        Fail(UnavailableError("peer " + options_.address +
                              " sent a malformed frame: " + header.status().message()));
        return;
      }
      std::shared_ptr<WorkItem> item;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!inflight_.empty()) {
          item = std::move(inflight_.front());
          inflight_.pop_front();
          outstanding_bytes_ -= item->length + 64;
        }
      }
      if (item == nullptr) {
        Fail(UnavailableError("peer " + options_.address + " sent an unsolicited " +
                              std::string(wire::FrameTypeName(header->type))));
        return;
      }
      wire::FrameType want = wire::FrameType::kWriteAck;
      switch (item->kind) {
        case WorkItem::Kind::kWrite:
          want = wire::FrameType::kWriteAck;
          break;
        case WorkItem::Kind::kRead:
          want = wire::FrameType::kReadData;
          break;
        case WorkItem::Kind::kNotify:
          want = wire::FrameType::kNotifyAck;
          break;
        case WorkItem::Kind::kDescribe:
          want = wire::FrameType::kDescribeAck;
          break;
      }
      if (header->type != want || (header->type == wire::FrameType::kReadData &&
                                   header->status == 0 && header->length != item->length)) {
        Status s = UnavailableError("peer " + options_.address + " answered with " +
                                    std::string(wire::FrameTypeName(header->type)) + " where " +
                                    std::string(wire::FrameTypeName(want)) +
                                    " of the same length was due");
        Fail(s);
        FinishAfterTransfer(item.get(), s);
        return;
      }
      std::vector<uint8_t> body(header->body_bytes);
      if (!body.empty()) {
        asio::read(*socket_, asio::buffer(body), ec);
        if (ec) {
          Status s =
              UnavailableError("connection to peer " + options_.address + " lost: " + ec.message());
          Fail(s);
          FinishAfterTransfer(item.get(), s);
          return;
        }
      }
      Status status =
          header->status == 0
              ? OkStatus()
              : Status(StatusCodeFromInt(header->status),
                       "peer " + options_.address + ": " + std::string(body.begin(), body.end()));
      if (header->type == wire::FrameType::kReadData && header->status == 0) {
        // Claim the item before touching its memory; an abandoned item's bytes are drained.
        uint8_t s = item->state.load();
        bool claimed = false;
        while ((s == kSending || s == kSent) &&
               !(claimed = item->state.compare_exchange_weak(s, kReceiving))) {
        }
        if (claimed) {
          asio::read(*socket_, asio::buffer(item->local, item->length), ec);
        } else {
          Discard(*socket_, header->length, ec);
        }
        if (ec) {
          Status lost = UnavailableError("connection to peer " + options_.address +
                                         " lost mid-READ: " + ec.message());
          Fail(lost);
          FinishAfterTransfer(item.get(), lost);
          return;
        }
      }
      if (item->kind == WorkItem::Kind::kDescribe) item->reply_body = std::move(body);
      if (header->type != wire::FrameType::kReadData) {
        // An answer can overtake the sending thread's return from write(): let that thread
        // complete the item, so its memory is not released while the call still runs.
        item->acked_status = status;
        uint8_t expected = kSending;
        if (item->state.compare_exchange_strong(expected, kAcked)) continue;
      }
      FinishAfterTransfer(item.get(), status);
    }
  }

  // Completes an item the receiver owns (state kSending/kSent/kReceiving/kDone).
  static void FinishAfterTransfer(WorkItem* item, const Status& status) { item->Complete(status); }

  void ThreadExit() {
    std::deque<std::shared_ptr<WorkItem>> leftover;
    std::vector<std::shared_ptr<WorkItem>> answered;  // acknowledged: complete as answered
    Status why;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (--threads_alive_ > 0) return;
      // An inline sender (Enqueue) may still be writing: its item's memory and the socket are
      // in use until it hands the turn back.
      cv_.wait(lock, [&] { return !sending_; });
      answered.swap(acked_early_);
      leftover.insert(leftover.end(), std::make_move_iterator(queue_.begin()),
                      std::make_move_iterator(queue_.end()));
      queue_.clear();
      for (auto& item : inflight_) leftover.push_back(std::move(item));
      inflight_.clear();
      outstanding_bytes_ = 0;
      socket_closed_ = true;  // closed below: Fail must not shut the number down any more
      why = reason_.ok() ? UnavailableError("lane to " + options_.address + " closed") : reason_;
    }
    for (auto& item : answered) item->Complete(item->acked_status);
    for (auto& item : leftover) item->Complete(why);
    asio::error_code ignored;
    socket_->close(ignored);
  }

  const TcpPeerOptions& options_;
  // The TcpPeer's. Like options_, it outlives the lane's threads, which TcpPeer::Close joins
  // (a lane thread that drops the last reference itself detaches, about to return).
  PeerIdentity& identity_;
  const int index_;
  // Set by Start, before the lane's threads run; not reassigned after.
  bool connect_first_ = false;
  std::unique_ptr<asio::io_context> io_;
  std::unique_ptr<asio::ip::tcp::socket> socket_;
  std::thread sender_;
  std::thread receiver_;
  // The sending turn's (sending_): the next frame id and scratch for building frames.
  uint64_t next_request_id_ = 1;
  std::vector<wire::HeaderBytes> send_headers_;
  std::vector<std::array<uint8_t, wire::kStridedBodyBytes>> send_bodies_;
  std::vector<asio::const_buffer> send_buffers_;
  static constexpr uint64_t kInlineBytes = 16 << 10;  // frames Enqueue may send itself

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<WorkItem>> queue_;
  std::deque<std::shared_ptr<WorkItem>> inflight_;
  uint64_t outstanding_bytes_ = 0;
  bool connected_ = false;      // the sender thread connected the socket
  bool socket_closed_ = false;  // ThreadExit is closing the socket
  int send_capacity_ = 0;       // SO_SNDBUF, read once connected
  bool sending_ = false;        // a thread (the sender, or an inline Enqueue) is writing frames
  // Items an inline sender saw answered before its write returned, for the sender thread.
  std::vector<std::shared_ptr<WorkItem>> acked_early_;
  bool broken_ = false;
  Status reason_;
  int threads_alive_ = 2;
  std::atomic<int> threads_started_{0};   // sender, then receiver once connected
  std::atomic<int> threads_returned_{0};  // of those, returned from SenderMain / ReceiverMain
};

void PeerIdentity::Set(const SegmentDescriptor& first) {
  name_ = first.name;
  incarnation_ = first.incarnation;
}

Status PeerIdentity::Check(const SegmentDescriptor& now) {
  if (now.incarnation == incarnation_ && now.name == name_) return OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  if (!restarted_.load(std::memory_order_relaxed)) {
    restart_ = UnavailableError(fmt::format(
        "peer {} restarted: the segment was opened to engine '{}' (incarnation {:016x}), and the "
        "address now reaches engine '{}' (pid {}, incarnation {:016x}); nothing is sent to it "
        "through this segment: open the segment again",
        address_, name_, incarnation_, now.name, now.pid, now.incarnation));
    restarted_.store(true, std::memory_order_release);
  }
  return restart_;
}

Status PeerIdentity::restart_status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return restart_;
}

StatusOr<std::unique_ptr<TcpPeer>> TcpPeer::Create(const TcpPeerOptions& options) {
  if (options.num_lanes < 1 || options.num_lanes > 64) {
    return InvalidArgumentError("TCP lanes per peer must be in 1..64, got " +
                                std::to_string(options.num_lanes));
  }
  std::unique_ptr<TcpPeer> peer(new TcpPeer(options));
  auto io = std::make_unique<asio::io_context>();
  auto socket = std::make_unique<asio::ip::tcp::socket>(*io);
  RETURN_IF_ERROR(ConnectAndHello(*socket, options.address, options.self, options.auth_secret,
                                  options.connect_timeout, options.max_body_bytes,
                                  &peer->descriptor_));
  peer->identity_.Set(peer->descriptor_);
  peer->lanes_.resize(static_cast<size_t>(options.num_lanes));
  auto lane = std::make_shared<TcpLane>(peer->options_, peer->identity_, 0);
  lane->Start(std::move(io), std::move(socket));
  peer->lanes_[0] = std::move(lane);
  return peer;
}

TcpPeer::TcpPeer(const TcpPeerOptions& options)
    : PeerChannel(ChannelTraits{.slice_bytes = options.slice_bytes,
                                .max_rows_per_item = wire::kMaxStridedRows,
                                .takes_bulk = false}),
      options_(options) {}

TcpPeer::~TcpPeer() { Close(); }

std::shared_ptr<TcpLane> TcpPeer::PickLane(std::vector<std::shared_ptr<TcpLane>>* reaped) {
  // Failed lanes whose threads have returned go (joined by the caller, outside mu_): a peer
  // that keeps failing lanes must not keep two exited threads and their buffers per lane.
  for (auto it = retired_.begin(); it != retired_.end();) {
    if ((*it)->threads_returned()) {
      reaped->push_back(std::move(*it));
      it = retired_.erase(it);
    } else {
      ++it;
    }
  }
  // Least outstanding bytes; open an unused lane when every open one is busy.
  std::shared_ptr<TcpLane> best;
  uint64_t best_bytes = UINT64_MAX;
  int free_slot = -1;
  for (size_t i = 0; i < lanes_.size(); ++i) {
    auto& lane = lanes_[i];
    if (lane != nullptr && lane->broken()) {
      retired_.push_back(std::move(lane));
      lane = nullptr;
    }
    if (lane == nullptr) {
      if (free_slot < 0) free_slot = static_cast<int>(i);
      continue;
    }
    uint64_t bytes = lane->outstanding_bytes();
    if (bytes < best_bytes) {
      best = lane;
      best_bytes = bytes;
    }
  }
  if (free_slot >= 0 && (best == nullptr || best_bytes > 0)) {
    auto lane = std::make_shared<TcpLane>(options_, identity_, free_slot);
    lane->Start(nullptr, nullptr);
    lanes_[static_cast<size_t>(free_slot)] = lane;
    return lane;
  }
  return best;
}

void TcpPeer::Submit(std::shared_ptr<WorkItem> item) { SubmitOne(std::move(item), true); }

// Several items go to the sender threads, which gather them into few system calls; a lone
// small item may be sent by the caller (TcpLane::Enqueue).
void TcpPeer::SubmitMany(std::vector<std::shared_ptr<WorkItem>>&& items) {
  const bool allow_inline = items.size() == 1;
  for (auto& item : items) SubmitOne(std::move(item), allow_inline);
}

void TcpPeer::SubmitOne(std::shared_ptr<WorkItem> item, bool allow_inline) {
  if (identity_.restarted()) {  // no new connection to the new process
    item->Complete(identity_.restart_status());
    return;
  }
  std::shared_ptr<TcpLane> lane;
  std::vector<std::shared_ptr<TcpLane>> reaped;  // released (and joined) outside mu_
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!closed_) lane = PickLane(&reaped);
  }
  reaped.clear();
  if (lane == nullptr) {
    item->Complete(UnavailableError("segment " + options_.address + " is closed"));
    return;
  }
  lane->Enqueue(std::move(item), allow_inline);
}

void TcpPeer::Abandon(WorkItem* item, const Status& why) {
  uint8_t s = item->state.load();
  while (s == WorkItem::kQueued || s == kSent) {
    // Not touching local memory now: complete at once. A late response is drained.
    if (item->state.compare_exchange_weak(s, WorkItem::kDone)) {
      item->owner->OnWorkDone(item, why);
      return;
    }
  }
  if (s == WorkItem::kDone || s == kAcked) return;  // completes in a moment
  // Bytes are moving: interrupt the lane; its threads complete the item once they stopped.
  // An item no lane of ours carried (another transport's) is not ours to stop.
  auto* lane = static_cast<TcpLane*>(item->carrier.load());
  if (lane == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& l : lanes_) {
    if (l != nullptr && l.get() == lane) l->Fail(why, /*connection_lost=*/false);
  }
}

void TcpPeer::Close() {
  std::vector<std::shared_ptr<TcpLane>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    for (auto& l : lanes_) {
      if (l != nullptr) all.push_back(std::move(l));
    }
    lanes_.clear();
    for (auto& l : retired_) all.push_back(std::move(l));
    retired_.clear();
  }
  for (auto& l : all) {
    l->Fail(UnavailableError("segment " + options_.address + " closed"), /*connection_lost=*/false);
  }
  for (auto& l : all) l->Join();
}

}  // namespace kvferry::tcp
