#include "transport/transport_set.h"

#include "common/checks.h"
#include "common/logging.h"

namespace kvferry {

std::vector<std::string> TransportSet::KnownNames() { return {"auto", "nvlink", "tcp", "ucx"}; }

StatusOr<std::unique_ptr<TransportSet>> TransportSet::Create(const TransportSetOptions& options,
                                                             MemoryRegistry* registry) {
  const std::vector<std::string> known = KnownNames();
  if (std::find(known.begin(), known.end(), options.transport) == known.end()) {
    std::string list;
    for (const std::string& name : known) list += (list.empty() ? "" : ", ") + name;
    return InvalidArgumentError("unknown transport '" + options.transport + "' (known: " + list +
                                ")");
  }
  std::unique_ptr<TransportSet> set(new TransportSet());
  if (options.transport != "auto") set->forced_ = options.transport;
  ASSIGN_OR_RETURN(set->tcp_, tcp::TcpTransport::Create(options.tcp, registry));

  // Data transports in preference order. One that cannot start here is left out, unless it
  // was forced.
  NvlinkTransportOptions nvlink = options.nvlink;
  nvlink.listen_port = set->tcp_->listen_port();
  // Bad NVLink options (kInvalidArgument) refuse the engine whichever transport is forced, as
  // bad UCX options do below.
  auto made = NvlinkTransport::Create(nvlink, registry);
  if (made.ok()) {
    set->data_.push_back(std::move(*made));
  } else if (set->forced_ == "nvlink" || made.status().code() == StatusCode::kUnavailable ||
             made.status().code() == StatusCode::kInvalidArgument) {
    return made.status();
  }
  UcxTransportOptions ucx = options.ucx;
  ucx.same_node = ucx.same_node || set->forced_ == "ucx";
  if (set->forced_ == "ucx" || (set->forced_.empty() && options.ucx_in_auto)) {
    auto ucx_made = CreateUcxTransport(ucx, registry);
    if (ucx_made.ok()) {
      set->data_.push_back(std::move(*ucx_made));
    } else if (ucx_made.status().code() == StatusCode::kInvalidArgument) {
      return ucx_made.status();  // bad options, forced or not
    } else if (set->forced_ == "ucx") {
      return FailedPreconditionError(ucx_made.status().message());
    } else if (ucx_made.status().code() != StatusCode::kUnimplemented) {
      KVF_LOG_WARN("UCX transport not started: {}", ucx_made.status().ToString());
    }
  }

  for (const auto& t : set->data_) set->preference_.push_back(t.get());
  set->preference_.push_back(set->tcp_.get());
  if (!set->forced_.empty()) {
    std::erase_if(set->preference_,
                  [&](const Transport* t) { return t->capabilities().name != set->forced_; });
  }
  if (options.faults.active()) {
    set->faults_ = std::make_shared<FaultInjector>(options.faults);
    for (Transport*& t : set->preference_) {
      set->fault_wrappers_.push_back(std::make_unique<FaultTransport>(t, set->faults_));
      t = set->fault_wrappers_.back().get();
    }
  }
  return set;
}

std::shared_ptr<PeerChannel> TransportSet::NotifyChannel(
    std::shared_ptr<PeerChannel> control) const {
  if (faults_ == nullptr) return control;
  return std::make_shared<FaultChannel>(std::move(control), faults_, /*host_memory=*/true);
}

std::vector<uint64_t> TransportSet::LaneBytes(std::string_view name) const {
  for (const auto& t : data_) {
    if (t->capabilities().name == name) return t->LaneBytes();
  }
  return {};
}

void TransportSet::Describe(SegmentDescriptor* self) const {
  tcp_->Describe(self);
  for (const auto& t : data_) t->Describe(self);
}

StatusOr<Transport*> TransportSet::Pick(MemoryKind local_kind, const SegmentDescriptor& self,
                                        const SegmentDescriptor& peer) const {
  std::string why;
  for (Transport* t : preference_) {
    const TransportCapabilities& caps = t->capabilities();
    if ((caps.local_memory & MemoryKindBit(local_kind)) == 0) {
      why = "does not move local " + std::string(MemoryKindName(local_kind)) + " memory";
    } else if (caps.same_node_only && peer.node_id != self.node_id) {
      why = "reaches only peers on this node, and " + peer.Address() + " is on another";
    } else if (!t->CanReach(self, peer)) {
      why = "cannot reach peer " + peer.Address() + " (it does not offer " + caps.name + ")";
    } else {
      return t;
    }
  }
  if (!forced_.empty()) return FailedPreconditionError("transport '" + forced_ + "' " + why);
  return FailedPreconditionError("no transport moves local " +
                                 std::string(MemoryKindName(local_kind)) + " memory to peer " +
                                 peer.Address());
}

}  // namespace kvferry
