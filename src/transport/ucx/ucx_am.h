// Active messages between kvferry's UCX workers: WRITE and READ of large rows as UCX active
// messages (eager or rendezvous). Where UCX emulates put and get in software (tcp) each byte
// is copied in user space on both sides (into a send segment, out of a receive segment); a
// rendezvous is sent from the source memory itself (UCX 1.13 over tcp with PEER error handling
// still copies out of the receive segment on the receiving side), and, unlike one-sided put and
// get, the target checks every request against its registered memory.
//
// Protocol (ids below; headers little-endian host structs, both ends kvferry):
//   WRITE  initiator -> target  kAmWrite, header AmRequest{op, addr, length}, the row's bytes
//          as rendezvous (UCP_AM_SEND_FLAG_RNDV | UCP_AM_SEND_FLAG_REPLY), or, for rows up to
//          UcxContext::am_eager_max_bytes, eager (UCP_AM_SEND_FLAG_EAGER: the bytes come
//          with the request). The target receives them into [addr, addr + length) if that lies
//          inside one region it mapped with remote write access (an eager row is copied there
//          from UCX's receive buffer), else refuses: a rendezvous's send completes with
//          UCS_ERR_OUT_OF_RANGE, an eager row is answered kAmDone, AmReply{op,
//          UCS_ERR_OUT_OF_RANGE}; nothing is written. Once received, the target answers
//          kAmDone, AmReply{op, UCS_OK}: the bytes are in its memory (the send completing only
//          says they left; with PEER error handling UCX 1.13 carries rendezvous data over tcp
//          as active-message fragments, which no flush waits for).
//   READ   initiator -> target  kAmRead, header AmRequest, no data (UCP_AM_SEND_FLAG_REPLY);
//          target -> initiator  kAmReadData, header AmReply{op, UCS_OK}, the bytes of
//          [addr, addr + length) on the reply endpoint (the endpoint the request came on): as
//          rendezvous, received straight into the initiator's memory, or, for host memory up to
//          the target's UcxContext::am_eager_max_bytes, eager (copied there out of UCX's
//          receive buffer); or, when the range is not
//          inside a region mapped with remote read access, kAmDone, AmReply{op,
//          UCS_ERR_OUT_OF_RANGE}.
// Replies are sent with UCP_AM_SEND_FLAG_REPLY. The initiator matches them by op and by the
// endpoint they came on, which must be the one the request left on (UcxWorker::AddAmOp): another
// peer of the worker cannot answer for this one. A reply to an op it no longer waits for, or
// from another endpoint, is dropped (rendezvous data refused, eager data discarded). Engines of
// kProtocolVersion 6 and later speak this; the handshake refuses others.
//
// Only the .cc files of src/transport/ucx/ include this header.
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>

#include "kvferry/status.h"
#include "transport/ucx/ucx_worker.h"

namespace kvferry::ucx {

enum AmId : unsigned {
  kAmWrite = 0x4b01,
  kAmRead = 0x4b02,
  kAmReadData = 0x4b03,
  kAmDone = 0x4b04,
};

struct AmRequest {
  uint64_t op = 0;
  uint64_t addr = 0;  // in the target's memory
  uint64_t length = 0;
};

struct AmReply {
  uint64_t op = 0;
  int64_t status = 0;  // ucs_status_t
};

// The status a target answers a request outside its registered memory with.
inline constexpr ucs_status_t kAmRangeRefused = UCS_ERR_OUT_OF_RANGE;

// Parameters of ucp_am_recv_data_nbx receiving into memory of `type`, calling `done` with
// `user_data` when the receive completes (or fails) later.
inline ucp_request_param_t AmReceiveParams(ucs_memory_type_t type, void* user_data,
                                           ucp_am_recv_data_nbx_callback_t done) {
  ucp_request_param_t p = {};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  p.memory_type = type;
  p.user_data = user_data;
  p.cb.recv_am = done;
  return p;
}

// What an active-message callback answers to refuse data it does not receive: `why` for a
// rendezvous (the sender's send completes with it), UCS_OK for eager data, which UCX then
// drops with its buffer (UCX allows an error only for a rendezvous; its assertion-enabled
// builds, Debian's among them, abort on one).
inline ucs_status_t RefuseAmData(bool rndv, ucs_status_t why) { return rndv ? why : UCS_OK; }

// Sets the worker's handlers for the four ids. Errors: kUnavailable with UCX's reason.
Status SetAmHandlers(UcxWorker* worker);

}  // namespace kvferry::ucx
