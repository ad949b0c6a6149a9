// The checks KvPool::Wrap, AuxBuffer::Wrap and StatePool::Wrap make of the buffers a caller
// owns: none null, none running past the top of the address space, no two overlapping.
//
// Thread-safety: a pure function.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "kvferry/status.h"

namespace kvferry {

struct WrappedBuffer {
  std::string label;  // for errors, e.g. "buffer 3", "aux field 2 ('field2')"
  size_t index = 0;   // its number among the caller's buffers, for the overlap error
  uint64_t base = 0;
  uint64_t size_bytes = 0;
};

// kInvalidArgument naming the buffer: "<label> has a null base", "<label> at <base> would end
// past the top of the address space", or "<plural> <i> and <j> overlap (<n> and <m> bytes)"
// (`plural`: "buffers", "aux fields", ...). OK otherwise.
Status CheckWrappedBuffers(std::span<const WrappedBuffer> buffers, std::string_view plural);

}  // namespace kvferry
