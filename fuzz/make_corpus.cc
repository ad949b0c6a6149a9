// Writes the fuzzers' seed corpora: real messages made by kvferry's own encoders, one file per
// message, under <dir>/<fuzzer>/ (the checked-in fuzz/corpus/). Run after a wire format
// changes: build-fuzz/fuzz/make_fuzz_corpus fuzz/corpus. Other files there (the regress_*
// inputs that once made a fuzzer fail) are left as they are.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "disagg/bootstrap_wire.h"
#include "disagg/control_message.h"
#include "transport/tcp/wire.h"

namespace kvferry {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class Corpus {
 public:
  explicit Corpus(fs::path root) : root_(std::move(root)) {}

  void Add(const std::string& fuzzer, const std::string& name, const std::string& bytes) {
    fs::create_directories(root_ / fuzzer);
    std::ofstream out(root_ / fuzzer / name, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ++files_;
  }
  template <typename Range>
  void AddBytes(const std::string& fuzzer, const std::string& name, const Range& bytes) {
    Add(fuzzer, name, std::string(bytes.begin(), bytes.end()));
  }
  int files() const { return files_; }

 private:
  fs::path root_;
  int files_ = 0;
};

std::string Le(uint64_t v, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
  return out;
}

SegmentDescriptor SampleDescriptor() {
  SegmentDescriptor d;
  d.name = "prefill-tp0";
  d.host = "127.0.0.1";
  d.port = 17001;
  d.node_id = "node-5f3a";
  d.pid = 4242;
  d.incarnation = 0x9e3779b97f4a7c15;
  d.transports = {"tcp", "nvlink"};
  d.ipc_socket = "kvferry-fd-4242";
  RegionDescriptor host{0x7f0000001000,         256 << 20,         MemoryKind::kHost, -1,
                        kAccessRemoteReadWrite, 0x1122334455667788};
  RegionDescriptor ipc{0x7e0000000000, 1ull << 30, MemoryKind::kCuda, 0, kAccessRemoteWrite, 9};
  ipc.share_type = ShareHandleType::kCudaIpc;
  ipc.share_handle.assign(64, 0xab);
  ipc.alloc_offset = 4096;
  ipc.alloc_bytes = (1ull << 30) + 4096;
  RegionDescriptor fd{0x7d0000000000, 2 << 20, MemoryKind::kCuda, 1, kAccessRemoteRead, 10};
  fd.share_type = ShareHandleType::kPosixFd;
  fd.alloc_bytes = 2 << 20;
  d.regions = {host, ipc, fd};
  return d;
}

void FrameHeaders(Corpus& c) {
  struct Seed {
    const char* name;
    wire::FrameHeader h;
  };
  using wire::FrameType;
  const uint32_t descriptor =
      static_cast<uint32_t>(wire::EncodeDescriptor(SampleDescriptor()).size());
  const std::vector<Seed> seeds = {
      {"hello", {FrameType::kHello, 0, 1, 0, 0, descriptor, 0}},
      {"hello_ack", {FrameType::kHelloAck, 0, 1, 0, 0, descriptor, 0}},
      {"hello_ack_refused", {FrameType::kHelloAck, 0, 1, 0, 0, 31, 3}},
      {"write", {FrameType::kWrite, 0, 2, 0x7f0000001000, 65536, 0, 0}},
      {"write_strided",
       {FrameType::kWrite, wire::kFlagStrided, 3, 0x7f0000001000, 16 * 256, wire::kStridedBodyBytes,
        0}},
      {"write_ack", {FrameType::kWriteAck, 0, 2, 0, 0, 0, 0}},
      {"write_ack_error", {FrameType::kWriteAck, 0, 2, 0, 0, 48, 9}},
      {"read", {FrameType::kRead, 0, 4, 0x7f0000002000, 4096, 0, 0}},
      {"read_data", {FrameType::kReadData, 0, 4, 0, 4096, 0, 0}},
      {"read_data_error", {FrameType::kReadData, 0, 4, 0, 0, 40, 9}},
      {"notify", {FrameType::kNotify, 0, 5, 0, 0, 120, 0}},
      {"notify_ack", {FrameType::kNotifyAck, 0, 5, 0, 0, 0, 0}},
      {"describe", {FrameType::kDescribe, 0, 6, 0, 0, 0, 0}},
      {"describe_ack", {FrameType::kDescribeAck, 0, 6, 0, 0, descriptor, 0}},
      {"challenge", {FrameType::kChallenge, 0, 0, 0, 0, wire::kAuthChallengeBytes, 0}},
      {"auth",
       {FrameType::kAuth, 0, 0, 0, 0, static_cast<uint32_t>(kAuthProofBytes) + descriptor, 0}},
  };
  for (const Seed& s : seeds) c.AddBytes("frame_header", s.name, wire::EncodeFrameHeader(s.h));
  // With an explicit body limit after the header (the fuzzer's optional 4 bytes).
  const auto hello = wire::EncodeFrameHeader(seeds[0].h);
  c.Add("frame_header", "hello_limit_1k", std::string(hello.begin(), hello.end()) + Le(1024, 4));
}

// A control message as its fuzzer reads it: without the 8-byte checksum trailer.
void AddControl(Corpus& c, const std::string& name, const ControlMessage& m) {
  const std::string encoded = EncodeControl(m);
  c.Add("control_message", name, encoded.substr(0, encoded.size() - 8));
}

void AuthBodies(Corpus& c) {
  wire::AuthHello hello;
  wire::AuthChallenge challenge;
  for (size_t i = 0; i < hello.client_nonce.size(); ++i) {
    hello.client_nonce[i] = static_cast<uint8_t>(i * 7 + 1);
    challenge.server_nonce[i] = static_cast<uint8_t>(i * 13 + 5);
  }
  for (size_t i = 0; i < challenge.server_proof.size(); ++i) {
    challenge.server_proof[i] = static_cast<uint8_t>(255 - i);
  }
  // The selector byte first (even: HELLO, odd: CHALLENGE), as the fuzzer reads it.
  for (uint8_t flags : {uint8_t{0}, wire::kAuthFlagSecret}) {
    hello.flags = flags;
    challenge.flags = flags;
    const auto h = wire::EncodeAuthHello(hello);
    const auto ch = wire::EncodeAuthChallenge(challenge);
    const std::string suffix = flags ? "_secret" : "_no_secret";
    c.Add("auth_handshake", "hello" + suffix,
          std::string(1, '\0') + std::string(h.begin(), h.end()));
    c.Add("auth_handshake", "challenge" + suffix,
          std::string(1, '\1') + std::string(ch.begin(), ch.end()));
  }
}

void Descriptors(Corpus& c) {
  c.AddBytes("descriptor", "three_regions", wire::EncodeDescriptor(SampleDescriptor()));
  SegmentDescriptor decode = SampleDescriptor();
  decode.name = "decode-tp1";
  decode.transports = {"tcp"};
  decode.regions.resize(1);
  c.AddBytes("descriptor", "one_host_region", wire::EncodeDescriptor(decode));
  c.AddBytes("descriptor", "empty", wire::EncodeDescriptor(SegmentDescriptor{}));
  SegmentDescriptor ucx = decode;
  ucx.name = "decode-ucx";
  ucx.transports = {"tcp", "ucx"};
  ucx.ucx_addresses = {std::vector<uint8_t>(180, 0x2A), std::vector<uint8_t>(180, 0x2B)};
  ucx.regions[0].ucx_rkey = std::vector<uint8_t>(36, 0x7E);
  c.AddBytes("descriptor", "ucx_worker_and_rkey", wire::EncodeDescriptor(ucx));
}

void StridedWrites(Corpus& c) {
  struct Seed {
    const char* name;
    uint64_t addr;
    wire::StridedWrite s;
  };
  const std::vector<Seed> seeds = {
      {"head_slice", 0x7f0000001000, {16, 256, 1024}},
      {"one_row", 0x7f0000001000, {1, 4096, 4096}},
      {"max_rows", 0x7f0000001000, {wire::kMaxStridedRows, 128, 512}},
      {"near_top", UINT64_MAX - 4 * 1024 + 1, {4, 256, 1024}},
  };
  for (const Seed& s : seeds) {
    const auto body = wire::EncodeStridedWrite(s.s);
    c.Add("strided_write", s.name,
          Le(s.addr, 8) + Le(uint64_t{s.s.rows} * s.s.row_bytes, 8) +
              std::string(body.begin(), body.end()));
  }
}

void ControlMessages(Corpus& c) {
  ControlMessage m;
  m.room = 12345;
  m.decode_address = "127.0.0.1:17002";

  ControlMessage reg = m;
  reg.type = ControlType::kRegisterDecode;
  DecodeKvArgs& a = reg.kv_args;
  a.decode_address = m.decode_address;
  a.tp_rank = 1;
  a.page_size = 16;
  a.kv_dtype = "bfloat16";
  a.page_bytes = 16 * 8 * 128 * 2;
  a.num_pages = 4096;
  a.buffer_bases = {0x7f0000000000, 0x7f0010000000, 0x7f0020000000, 0x7f0030000000};
  // Packed rows of 64 bytes: three fields and the room.
  a.aux_fields = {{0x7f1000000000, 64, 4},
                  {0x7f1000000004, 64, 12},
                  {0x7f1000000010, 64, 0},
                  {0x7f1000000018, 64, 8}};
  a.aux_packed_row_bytes = 64;
  a.aux_room_field = 3;
  a.num_aux_rows = 1024;
  a.tp_size = 2;
  a.heads_per_token = 4;
  a.staging_base = 0x7f2000000000;
  a.staging_bytes = 1 << 30;
  a.watermark_addr = 0x7f3000000000;
  a.state_bases = {0x7f4000000000, 0x7f4010000000};
  a.state_slot_bytes = {1 << 20, 1 << 16};
  a.num_state_slots = 8;
  a.node_id = "node-5f3a";
  a.done_mailbox = "/kvferry-done-4243";
  AddControl(c, "register_decode", reg);

  ControlMessage info = m;
  info.type = ControlType::kTransferInfo;
  info.dst_pages = {7, 3, 1024, 9, 10, 11};
  info.aux_row = 17;
  info.state_slot = 2;
  info.slice = {2, 0, 4, true, true, 2, false, false, true, 1, 2, 0, 1};
  AddControl(c, "transfer_info", info);
  info.slice.staging = true;
  info.slice.sends_state = false;
  info.state_slot = -1;
  AddControl(c, "transfer_info_staging", info);
  info.slice.staging = false;
  info.slice.fused = true;
  info.slice.pull = true;
  AddControl(c, "transfer_info_pull", info);

  ControlMessage pull = m;
  pull.type = ControlType::kPullRequest;
  pull.pull_id = 91;
  pull.note = ControlType::kRoomDone;
  pull.deadline_ms = 60000;
  pull.pulls = {{0x7f0000001000, 0x7e0000000400, 1024, 64, 2048, 4096},
                {0x7f0000400000, 0x7e0000800000, 8192, 1, 0, 0}};
  AddControl(c, "pull_request", pull);
  ControlMessage answer = m;
  answer.type = ControlType::kPullDone;
  answer.pull_id = 91;
  answer.status_code = static_cast<uint32_t>(StatusCode::kInvalidArgument);
  answer.reason = "copy 1: destination outside this decode rank's KV pool";
  AddControl(c, "pull_done", answer);

  ControlMessage abort = m;
  abort.type = ControlType::kAbort;
  abort.status_code = static_cast<uint32_t>(StatusCode::kAborted);
  abort.reason = "decode gave up waiting";
  AddControl(c, "abort", abort);
  ControlMessage failed = abort;
  failed.type = ControlType::kRoomFailed;
  failed.status_code = static_cast<uint32_t>(StatusCode::kOutOfRange);
  failed.reason = "decode page 5000 outside its pool of 4096";
  AddControl(c, "room_failed", failed);

  for (auto [type, name] : {std::pair{ControlType::kHeartbeat, "heartbeat"},
                            std::pair{ControlType::kChunkLanded, "chunk_landed"},
                            std::pair{ControlType::kRoomDone, "room_done"}}) {
    ControlMessage plain = m;
    plain.type = type;
    AddControl(c, name, plain);
  }

  ControlMessage staging = m;
  staging.chunk = {64, 32, 32 * 16384, 3, 1 << 20, 77, 4, 4, 8, 4};
  for (auto [type, name] : {std::pair{ControlType::kStagingRequest, "staging_request"},
                            std::pair{ControlType::kStagingGrant, "staging_grant"},
                            std::pair{ControlType::kStagingReady, "staging_ready"},
                            std::pair{ControlType::kStagingCancel, "staging_cancel"}}) {
    staging.type = type;
    AddControl(c, name, staging);
  }
}

void BootstrapBodies(Corpus& c) {
  PrefillRegistration reg;
  reg.rank = {1, 0, 0, "127.0.0.1:17001", "prefill-tp1"};
  reg.tp_size = 2;
  reg.page_size = 16;
  reg.kv_dtype = "bfloat16";
  reg.model = "llama-3.1-8b";
  reg.num_kv_heads = 8;
  c.Add("bootstrap", "put_route", bootstrap_wire::RegistrationToJson(reg).dump());
  c.Add("bootstrap", "get_rank", bootstrap_wire::RankToJson(reg.rank).dump());

  PrefillTopology topology;
  topology.tp_size = 2;
  topology.page_size = 16;
  topology.kv_dtype = "bfloat16";
  topology.model = "llama-3.1-8b";
  topology.num_kv_heads = 8;
  topology.ranks = {{0, 0, 0, "127.0.0.1:17000", "prefill-tp0"}, reg.rank};
  c.Add("bootstrap", "get_route_complete", bootstrap_wire::TopologyToJson(topology).dump());
  topology.pp_size = 2;
  c.Add("bootstrap", "get_route_incomplete", bootstrap_wire::TopologyToJson(topology).dump(2));
  c.Add("bootstrap", "get_route_empty", bootstrap_wire::TopologyToJson(PrefillTopology{}).dump());
}

void InstanceRequests(Corpus& c) {
  c.Add("instance_request", "prefill", json{{"room", 42}, {"input_length", 8192}}.dump());
  c.Add(
      "instance_request", "decode",
      json{{"room", 42}, {"input_length", 8192}, {"bootstrap_address", "127.0.0.1:18000"}}.dump());
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR (e.g. fuzz/corpus)\n", argv[0]);
    return 2;
  }
  kvferry::Corpus corpus(argv[1]);
  kvferry::FrameHeaders(corpus);
  kvferry::AuthBodies(corpus);
  kvferry::Descriptors(corpus);
  kvferry::StridedWrites(corpus);
  kvferry::ControlMessages(corpus);
  kvferry::BootstrapBodies(corpus);
  kvferry::InstanceRequests(corpus);
  std::printf("wrote %d seed files under %s\n", corpus.files(), argv[1]);
  return 0;
}
