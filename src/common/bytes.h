// Little-endian byte writer and bounds-checked reader for kvferry's binary codecs (wire
// frames' bodies, connector control messages). The reader never reads past its input, and
// bounds every string before allocating it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kvferry {

class ByteWriter {
 public:
  void U8(uint8_t v) { out_.push_back(v); }
  void U16(uint16_t v) { Put(v, 2); }
  void U32(uint32_t v) { Put(v, 4); }
  void U64(uint64_t v) { Put(v, 8); }
  void Str(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    out_.insert(out_.end(), s.begin(), s.end());
  }
  void Bytes(std::span<const uint8_t> b) { out_.insert(out_.end(), b.begin(), b.end()); }
  // What was written so far.
  std::span<const uint8_t> bytes() const { return out_; }
  std::vector<uint8_t> Take() { return std::move(out_); }

 private:
  void Put(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  std::vector<uint8_t> out_;
};

// Reads little-endian values; the first failure sticks and is described by error().
class ByteReader {
 public:
  ByteReader(std::span<const uint8_t> in, uint32_t max_string_bytes)
      : in_(in), max_string_bytes_(max_string_bytes) {}
  bool U8(uint8_t* v) { return Get(v, 1); }
  bool U16(uint16_t* v) { return Get(v, 2); }
  bool U32(uint32_t* v) { return Get(v, 4); }
  bool U64(uint64_t* v) { return Get(v, 8); }
  bool Str(std::string* s, const char* what) {
    uint32_t n = 0;
    if (!U32(&n)) return false;
    if (n > max_string_bytes_) {
      return Fail(std::string(what) + " length " + std::to_string(n) + " exceeds " +
                  std::to_string(max_string_bytes_));
    }
    if (in_.size() - pos_ < n) return Fail(std::string(what) + " truncated");
    s->assign(reinterpret_cast<const char*>(in_.data() + pos_), n);
    pos_ += n;
    return true;
  }
  // Fills `out` completely from the input.
  bool Bytes(std::span<uint8_t> out) {
    if (in_.size() - pos_ < out.size()) return Fail("truncated at byte " + std::to_string(pos_));
    for (size_t i = 0; i < out.size(); ++i) out[i] = in_[pos_ + i];
    pos_ += out.size();
    return true;
  }
  // Checks that `count` items of `item_bytes` each can still follow, before resizing.
  bool Fits(uint64_t count, uint64_t item_bytes, const char* what) {
    if (count * item_bytes > remaining()) return Fail(std::string(what) + " truncated");
    return true;
  }
  bool Fail(std::string why) {
    if (error_.empty()) error_ = std::move(why);
    return false;
  }
  size_t remaining() const { return in_.size() - pos_; }
  const std::string& error() const { return error_; }

 private:
  template <typename T>
  bool Get(T* v, int n) {
    if (in_.size() - pos_ < static_cast<size_t>(n)) {
      return Fail("truncated at byte " + std::to_string(pos_));
    }
    uint64_t x = 0;
    for (int i = 0; i < n; ++i) x |= static_cast<uint64_t>(in_[pos_ + i]) << (8 * i);
    *v = static_cast<T>(x);
    pos_ += n;
    return true;
  }
  std::span<const uint8_t> in_;
  uint32_t max_string_bytes_;
  size_t pos_ = 0;
  std::string error_;
};

}  // namespace kvferry
