// PrefillPairing: bootstrap lookup of prefill ranks and the register handshake
// (decode/pairing.h).
#include "disagg/decode/pairing.h"

#include <algorithm>
#include <map>
#include <utility>

#include "common/checks.h"
#include "common/logging.h"
#include "kvferry/bootstrap.h"

namespace kvferry {

PrefillPairing::PrefillPairing(const DecodeConnectorOptions& options, const KvPool& pool,
                               const AuxBuffer& aux, TransferEngine& engine,
                               const DoneMailbox* mailbox, StagingReceiver* staging)
    : options_(options),
      pool_(pool),
      aux_(aux),
      engine_(engine),
      mailbox_(mailbox),
      staging_(staging),
      node_id_(engine.LocalDescriptor().node_id) {}

StatusOr<std::shared_ptr<PrefillGroup>> PrefillPairing::GroupFor(
    const std::string& bootstrap_address) {
  std::shared_ptr<PrefillGroup> group;
  {
    std::lock_guard<std::mutex> lock(groups_mu_);
    auto& slot = groups_[bootstrap_address];
    if (slot == nullptr) {
      slot = std::make_shared<PrefillGroup>();
      slot->bootstrap_address = bootstrap_address;
    }
    group = slot;
  }
  std::lock_guard<std::mutex> setup(group->setup_mu);
  if (group->ready.load(std::memory_order_acquire)) return group;
  BootstrapClient client(bootstrap_address, options_.bootstrap_timeout,
                         options_.engine.auth_secret);
  ASSIGN_OR_RETURN(PrefillTopology topology,
                   client.WaitForTopology(options_.bootstrap_timeout, &cancelled_));
  const KvLayout& layout = pool_.layout();
  RETURN_IF_ERROR(CheckPairing(topology, layout.page_size(), DTypeName(layout.geometry().dtype)));
  if (topology.pp_size != 1) {
    return UnimplementedError("prefill PP " + std::to_string(topology.pp_size) +
                              " is not supported yet");
  }
  const AttentionKind attention = layout.geometry().attention;
  const int total_heads =
      attention == AttentionKind::kMla
          ? 1
          : (topology.num_kv_heads > 0 ? topology.num_kv_heads : layout.heads_per_token());
  ASSIGN_OR_RETURN(TpPlan plan,
                   PlanHeadSlices(total_heads, topology.tp_size, options_.tp_size, attention));
  if (attention != AttentionKind::kMla && plan.decode_heads != layout.heads_per_token()) {
    return FailedPreconditionError(
        "decode rank holds " + std::to_string(layout.heads_per_token()) + " KV heads, but " +
        std::to_string(total_heads) + " heads at decode attention TP " +
        std::to_string(options_.tp_size) + " need " + std::to_string(plan.decode_heads));
  }
  // Every context-parallel rank sends its share of the pages: one entry per (slice, CP rank).
  std::vector<HeadSlice> slices;
  std::vector<int> cp_ranks;
  for (int cp = 0; cp < topology.cp_size; ++cp) {
    for (const HeadSlice& slice : plan.ForDecodeRank(options_.tp_rank)) {
      slices.push_back(slice);
      cp_ranks.push_back(cp);
    }
  }
  if (slices.empty()) {
    return FailedPreconditionError("decode TP rank " + std::to_string(options_.tp_rank) +
                                   " is outside decode attention TP " +
                                   std::to_string(options_.tp_size));
  }
  ControlMessage reg;
  reg.type = ControlType::kRegisterDecode;
  reg.decode_address = engine_.LocalDescriptor().Address();
  DecodeKvArgs& a = reg.kv_args;
  a.decode_address = reg.decode_address;
  a.tp_rank = options_.tp_rank;
  a.tp_size = options_.tp_size;
  a.heads_per_token = layout.heads_per_token();
  a.page_size = layout.page_size();
  a.kv_dtype = std::string(DTypeName(layout.geometry().dtype));
  a.page_bytes = layout.page_bytes();
  a.num_pages = pool_.num_pages();
  for (int b = 0; b < layout.num_buffers(); ++b) {
    a.buffer_bases.push_back(reinterpret_cast<uint64_t>(pool_.BufferBase(b)));
  }
  for (int f = 0; f < aux_.layout().num_fields(); ++f) {
    a.aux_fields.push_back({reinterpret_cast<uint64_t>(aux_.FieldBase(f)), aux_.FieldStride(f),
                            aux_.layout().fields()[static_cast<size_t>(f)].size_bytes});
  }
  a.aux_packed_row_bytes = aux_.packed() ? aux_.layout().row_bytes() : 0;
  a.aux_room_field = aux_.layout().room_field();
  a.num_aux_rows = aux_.num_rows();
  if (const StatePool* state = options_.state_pool; state != nullptr) {
    for (int b = 0; b < state->layout().num_buffers(); ++b) {
      a.state_bases.push_back(reinterpret_cast<uint64_t>(state->BufferBase(b)));
      a.state_slot_bytes.push_back(state->layout().slot_bytes(b));
    }
    a.num_state_slots = state->num_slots();
  }
  a.node_id = node_id_;
  if (mailbox_ != nullptr) a.done_mailbox = mailbox_->name();
  auto is_whole = [&](const HeadSlice& slice) {
    return slice.src_head_start == 0 && slice.dst_head_start == 0 &&
           slice.num_heads == plan.prefill_heads && slice.num_heads == plan.decode_heads;
  };
  // NVLink copies a strided request's rows in one kernel pass, whichever side runs it.
  auto RouteIsNvlink = [&](SegmentHandle segment) {
    auto route = engine_.DescribeRoute(segment, pool_.location().kind);
    return route.ok() && route->rfind("nvlink", 0) == 0;
  };
  bool need_ring = false;
  for (const HeadSlice& slice : slices) need_ring = need_ring || (!is_whole(slice) && slice.sends);
  const bool staged_group = staging_ != nullptr && need_ring;
  if (staged_group) RETURN_IF_ERROR(staging_->EnsureRing());
  if (staged_group) {
    a.staging_base = reinterpret_cast<uint64_t>(staging_->ring_data());
    a.staging_bytes = options_.staging_bytes;
    a.watermark_addr = reinterpret_cast<uint64_t>(staging_->watermark_cell());
  }
  // Per-slice fields are built here and assigned together once every rank answered, so that
  // an attempt that fails part-way leaves nothing behind for the next one to append to.
  std::vector<std::shared_ptr<PrefillPeer>> peers;
  std::vector<int> decode_ranks_of_prefill;
  std::vector<bool> staged, pulled;
  std::vector<SliceInfo> state;
  std::map<std::pair<int, int>, std::shared_ptr<PrefillPeer>> by_rank;  // (tp, cp)
  for (size_t e = 0; e < slices.size(); ++e) {
    const HeadSlice& slice = slices[e];
    auto& peer = by_rank[{slice.prefill_rank, cp_ranks[e]}];
    if (peer == nullptr) {
      ASSIGN_OR_RETURN(PrefillRankInfo rank, client.GetRank(slice.prefill_rank, cp_ranks[e], 0));
      ASSIGN_OR_RETURN(SegmentHandle segment, engine_.OpenSegment(rank.engine_address));
      RETURN_IF_ERROR(
          engine_.SendNotification(segment, EncodeControl(reg), options_.bootstrap_timeout));
      peer = std::make_shared<PrefillPeer>();
      peer->bootstrap_address = bootstrap_address;
      peer->prefill_rank = slice.prefill_rank;
      peer->engine_address = rank.engine_address;
      peer->segment = segment;
      auto descriptor = engine_.GetSegmentDescriptor(segment);
      peer->same_node = descriptor.ok() && descriptor->node_id == node_id_;
      if (options_.pull) {
        // Pulling reads this rank's pools: open the channel and map them now, off the room's
        // bootstrap (opening takes milliseconds, mapping tens), not when its first KV is ready.
        setup_.Post([this, segment, address = rank.engine_address] {
          Status prepared = engine_.PrepareTransfers(segment, pool_.BufferBase(0));
          if (!prepared.ok()) {
            KVF_LOG_DEBUG("decode: prefill {}: no early transfer setup: {}", address,
                          prepared.message());
          }
        });
      }
    }
    peers.push_back(peer);
    decode_ranks_of_prefill.push_back(
        static_cast<int>(plan.ForPrefillRank(slice.prefill_rank).size()));
    staged.push_back(staged_group && !is_whole(slice) && slice.sends);
    pulled.push_back(options_.pull && !staged.back() &&
                     (is_whole(slice) || RouteIsNvlink(peer->segment)));
    state.push_back(StateSlice(topology.tp_size, slice.prefill_rank, cp_ranks[e]));
  }
  group->aux_slice = 0;  // the first sending slice of CP rank 0 (entries start with CP rank 0)
  for (size_t i = 0; i < slices.size(); ++i) {
    if (slices[i].sends && cp_ranks[i] == 0) {
      group->aux_slice = static_cast<int>(i);
      break;
    }
  }
  group->slices = std::move(slices);
  group->peers = std::move(peers);
  group->decode_ranks_of_prefill = std::move(decode_ranks_of_prefill);
  group->staged = std::move(staged);
  group->pulled = std::move(pulled);
  group->state = std::move(state);
  group->ready.store(true, std::memory_order_release);
  return group;
}

SliceInfo PrefillPairing::StateSlice(int prefill_tp, int prefill_rank, int cp_rank) const {
  SliceInfo s;
  s.sends_state = options_.state_pool != nullptr && cp_rank == 0;
  const int decode_tp = options_.tp_size;
  if (prefill_tp > decode_tp) {
    s.state_dst_parts = prefill_tp / decode_tp;
    s.state_dst_part = prefill_rank % s.state_dst_parts;
  } else if (prefill_tp < decode_tp) {
    s.state_src_parts = decode_tp / prefill_tp;
    s.state_src_part = options_.tp_rank % s.state_src_parts;
  }
  return s;
}

std::vector<std::shared_ptr<PrefillPeer>> PrefillPairing::Peers() {
  std::vector<std::shared_ptr<PrefillPeer>> peers;
  std::lock_guard<std::mutex> lock(groups_mu_);
  for (auto& [addr, g] : groups_) {
    // A group still pairing is being written under its setup_mu: only ready ones are read.
    if (!g->ready.load(std::memory_order_acquire)) continue;
    for (auto& p : g->peers) {
      if (std::find(peers.begin(), peers.end(), p) == peers.end()) peers.push_back(p);
    }
  }
  return peers;
}

void PrefillPairing::Forget(const std::string& bootstrap_address,
                            const std::shared_ptr<PrefillGroup>& only) {
  std::lock_guard<std::mutex> lock(groups_mu_);
  auto it = groups_.find(bootstrap_address);
  if (it != groups_.end() && (only == nullptr || it->second == only)) groups_.erase(it);
}

}  // namespace kvferry
