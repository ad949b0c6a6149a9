#include "transport/ucx/ucx_am.h"

#include <cstring>
#include <string>

#include "common/logging.h"
#include "common/range_text.h"
#include "kvferry/memory.h"

namespace kvferry::ucx {
namespace {

template <typename T>
bool ReadHeader(const void* header, size_t header_length, T* out) {
  if (header == nullptr || header_length != sizeof(T)) return false;
  std::memcpy(out, header, sizeof(T));
  return true;
}

// A reply's header stays valid until UCX completes its send (UCX 1.13 does not copy it); a
// READ's range stays pinned until then.
struct ReplySend {
  AmReply header;
  MemoryRegistry::Pin pin;
};

// Sends `reply` with `data` (null: none) as rendezvous, or eager (the bytes with the message)
// when `eager`.
void SendReply(ucp_ep_h ep, unsigned id, const AmReply& reply, const void* data,
               size_t length_bytes, ucs_memory_type_t type, MemoryRegistry::Pin pin = {},
               bool eager = false) {
  auto* s = new ReplySend{reply, std::move(pin)};
  ucp_request_param_t p = {};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                   UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  // REPLY: the initiator checks that the answer came on the endpoint its request left on.
  p.flags = UCP_AM_SEND_FLAG_REPLY |
            (data != nullptr && !eager ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER);
  p.memory_type = type;
  p.user_data = s;
  p.cb.send = [](void* request, ucs_status_t status, void* user_data) {
    if (status != UCS_OK) {
      KVF_LOG_DEBUG("ucx: reply to a READ not delivered: {}", UcxStatusText(status));
    }
    delete static_cast<ReplySend*>(user_data);
    ucp_request_free(request);
  };
  ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, &s->header, sizeof(s->header), data,
                                       data != nullptr ? length_bytes : 0, &p);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) {
    if (UCS_PTR_IS_ERR(r)) {
      KVF_LOG_DEBUG("ucx: reply to a READ not sent: {}", UcxStatusText(UCS_PTR_STATUS(r)));
    }
    delete s;
  }
}

void LogRefused(const char* op, const AmRequest& req) {
  KVF_LOG_WARN_LIMITED(
      "ucx: refused a peer's {} of {}: not inside a region registered here with remote {} access",
      op, RangeText(req.addr, req.length), op);
}

// A WRITE being received: its initiator hears kAmDone once the bytes are in place; its range
// stays pinned until then.
struct WriteReceive {
  ucp_ep_h reply_ep = nullptr;
  uint64_t op = 0;
  MemoryRegistry::Pin pin;
};

// Pins [req.addr, + req.length) in the engine's registry for `access` and sets its memory
// type. The registry is the one check: a region registered with remote access is mapped with
// UCX (ucx_rkey set) from its registration until every pin on it is gone, and an Unregister
// waits for the pins, so UCX never writes or reads the range after it was freed. False when
// the range is not inside one region registered with that access and mapped with UCX (or an
// Unregister began), or the context has no registry.
bool PinMapped(UcxWorker* w, const AmRequest& req, uint32_t access, MemoryRegistry::Pin* pin,
               ucs_memory_type_t* type) {
  MemoryRegistry* registry = w->context().registry();
  if (registry == nullptr) return false;
  StatusOr<MemoryRegistry::Pin> p = registry->PinRange(req.addr, req.length, access);
  if (!p.ok() || p->region().ucx_rkey.empty()) return false;
  *type = p->region().kind == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  *pin = std::move(*p);
  return true;
}

// Target: a peer's WRITE. The bytes go into the registered memory, or nowhere.
ucs_status_t OnWrite(void* arg, const void* header, size_t header_length, void* data,
                     size_t length_bytes, const ucp_am_recv_param_t* param) {
  auto* w = static_cast<UcxWorker*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  ucp_ep_h reply_ep =
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
  AmRequest req;
  ucs_memory_type_t type = UCS_MEMORY_TYPE_HOST;
  MemoryRegistry::Pin pin;
  if (!ReadHeader(header, header_length, &req) || req.length != length_bytes ||
      !PinMapped(w, req, kAccessRemoteWrite, &pin, &type)) {
    LogRefused("write", req);
    // Rendezvous: the initiator's send completes with this status, nothing was received.
    if (rndv) return kAmRangeRefused;
    if (reply_ep != nullptr) {
      SendReply(reply_ep, kAmDone, AmReply{req.op, kAmRangeRefused}, nullptr, 0, type);
    }
    return UCS_OK;
  }
  if (!rndv) {
    // Eager: the bytes arrived with the request, in UCX's receive buffer.
    const ucs_status_t s = type == UCS_MEMORY_TYPE_HOST ? UCS_OK : UCS_ERR_UNSUPPORTED;
    if (s == UCS_OK) std::memcpy(reinterpret_cast<void*>(req.addr), data, length_bytes);
    if (reply_ep != nullptr) SendReply(reply_ep, kAmDone, AmReply{req.op, s}, nullptr, 0, type);
    return UCS_OK;
  }
  auto* ctx = new WriteReceive{reply_ep, req.op, std::move(pin)};
  // Received: the bytes are in place, so the initiator may report the WRITE complete. A
  // failed receive is not answered: UCX fails it when the endpoint fails, and the endpoint
  // (and reply_ep with it) may be gone; the initiator's request then fails with its endpoint
  // or at its deadline.
  const ucp_request_param_t p =
      AmReceiveParams(type, ctx, [](void* request, ucs_status_t status, size_t, void* user_data) {
        auto* c = static_cast<WriteReceive*>(user_data);
        if (status == UCS_OK && c->reply_ep != nullptr) {
          SendReply(c->reply_ep, kAmDone, AmReply{c->op, UCS_OK}, nullptr, 0, UCS_MEMORY_TYPE_HOST);
        } else if (status != UCS_OK) {
          KVF_LOG_DEBUG("ucx: a peer's WRITE was not received: {}", UcxStatusText(status));
        }
        delete c;
        ucp_request_free(request);
      });
  ucs_status_ptr_t r =
      ucp_am_recv_data_nbx(w->worker(), data, reinterpret_cast<void*>(req.addr), req.length, &p);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) {
    // Done (or failed) at once, inside this callback: reply_ep is valid here.
    const ucs_status_t s = r == nullptr ? UCS_OK : UCS_PTR_STATUS(r);
    if (reply_ep != nullptr) SendReply(reply_ep, kAmDone, AmReply{req.op, s}, nullptr, 0, type);
    delete ctx;
  }
  return UCS_OK;
}

// The endpoint a received message can be answered on (the one its sender's connection to us
// maps to), or null when the sender gave none.
ucp_ep_h ReplyEndpoint(const ucp_am_recv_param_t* param) {
  return (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
}

// Target: a peer's READ. The bytes go back on the endpoint it came on: eager (the initiator
// copies them out of its receive buffer) for host memory up to the context's eager limit,
// else as a rendezvous.
ucs_status_t OnRead(void* arg, const void* header, size_t header_length, void*, size_t,
                    const ucp_am_recv_param_t* param) {
  auto* w = static_cast<UcxWorker*>(arg);
  AmRequest req;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0 || param->reply_ep == nullptr ||
      !ReadHeader(header, header_length, &req)) {
    KVF_LOG_WARN_LIMITED("ucx: dropped a malformed READ request");
    return UCS_OK;
  }
  ucs_memory_type_t type = UCS_MEMORY_TYPE_HOST;
  MemoryRegistry::Pin pin;
  if (!PinMapped(w, req, kAccessRemoteRead, &pin, &type)) {
    LogRefused("read", req);
    SendReply(param->reply_ep, kAmDone, AmReply{req.op, kAmRangeRefused}, nullptr, 0, type);
    return UCS_OK;
  }
  const bool eager =
      type == UCS_MEMORY_TYPE_HOST && req.length <= w->context().am_eager_max_bytes();
  SendReply(param->reply_ep, kAmReadData, AmReply{req.op, UCS_OK},
            reinterpret_cast<const void*>(req.addr), req.length, type, std::move(pin), eager);
  return UCS_OK;
}

// Initiator: a WRITE landed or failed, or a READ was refused.
ucs_status_t OnDone(void* arg, const void* header, size_t header_length, void*, size_t,
                    const ucp_am_recv_param_t* param) {
  auto* w = static_cast<UcxWorker*>(arg);
  AmReply reply;
  if (!ReadHeader(header, header_length, &reply)) return UCS_OK;
  if (AmClient* client = w->FindAmOp(reply.op, ReplyEndpoint(param))) {
    client->OnAmDone(reply.op, static_cast<ucs_status_t>(reply.status));
  }
  return UCS_OK;
}

// Initiator: the bytes of a READ.
ucs_status_t OnReadData(void* arg, const void* header, size_t header_length, void* data,
                        size_t length_bytes, const ucp_am_recv_param_t* param) {
  auto* w = static_cast<UcxWorker*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  AmReply reply;
  AmClient* client = ReadHeader(header, header_length, &reply)
                         ? w->FindAmOp(reply.op, ReplyEndpoint(param))
                         : nullptr;
  // No longer waited for (abandoned), or not from the peer asked: nothing lands.
  if (client == nullptr) return RefuseAmData(rndv, UCS_ERR_CANCELED);
  return client->OnAmReadData(reply.op, data, length_bytes, rndv);
}

}  // namespace

Status SetAmHandlers(UcxWorker* worker) {
  const std::pair<unsigned, ucp_am_recv_callback_t> handlers[] = {
      {kAmWrite, OnWrite}, {kAmRead, OnRead}, {kAmReadData, OnReadData}, {kAmDone, OnDone}};
  for (const auto& [id, cb] : handlers) {
    ucp_am_handler_param_t p = {};
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                   UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    p.id = id;
    p.flags = UCP_AM_FLAG_WHOLE_MSG;
    p.cb = cb;
    p.arg = worker;
    ucs_status_t s = ucp_worker_set_am_recv_handler(worker->worker(), &p);
    if (s != UCS_OK) return UnavailableError("UCX active-message handler: " + UcxStatusText(s));
  }
  return OkStatus();
}

}  // namespace kvferry::ucx
