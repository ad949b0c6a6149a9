// Memory that Python objects expose, and columns of integers read from array-likes.
//
// DescribeBuffer finds where an object's bytes are, in this order: `__cuda_array_interface__`
// (CuPy, Numba, torch CUDA tensors), the buffer protocol (numpy arrays, bytearray, memoryview,
// mmap), `__array_interface__`, and torch-style tensors (`data_ptr()`, `numel()`,
// `element_size()`, `device`, `is_contiguous()`; torch CPU tensors expose no other
// interface). Only C-contiguous memory is accepted: a registered region is one range.
//
// Thread-safety: everything here needs the GIL.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "errors.h"
#include "kvferry/memory.h"

namespace kvferry::python {

namespace py = pybind11;

struct BufferSpan {
  uint64_t address = 0;
  uint64_t length_bytes = 0;
  MemoryLocation location;  // host memory, or CUDA memory and its device
  bool read_only = false;
};

// Keeps a registered object alive and, when it came through the buffer protocol, its buffer
// exported (a bytearray cannot be resized while exported). Destroy it with the GIL held.
class HeldBuffer {
 public:
  explicit HeldBuffer(py::object owner) : owner_(std::move(owner)) {}
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;
  ~HeldBuffer() {
    if (view_) PyBuffer_Release(view_.get());
  }
  // Takes over an exported buffer (released on destruction).
  void Hold(std::unique_ptr<Py_buffer> view) { view_ = std::move(view); }

 private:
  py::object owner_;
  std::unique_ptr<Py_buffer> view_;
};

struct DescribedBuffer {
  BufferSpan span;
  std::unique_ptr<HeldBuffer> hold;
};

// Where `obj`'s bytes are (see the header comment). Throws StatusError: kInvalidArgument when
// `obj` exposes none of the interfaces, is not C-contiguous or describes itself malformed;
// kFailedPrecondition for a CUDA array whose memory this process does not see as CUDA device
// memory (a build without CUDA, or no GPU).
DescribedBuffer DescribeBuffer(py::handle obj);

// `obj`, a Python int (PyLong_Check), as a uint64: false, with no Python error left set, when
// it is outside [0, 2^64). PyLong_AsUnsignedLong walks the int's digits; the ...LongLong
// variant goes through a byte array for any int above 2^30, which addresses are (several times
// slower). Needs the GIL.
inline bool LongToU64(PyObject* obj, uint64_t* out) {
  static_assert(sizeof(unsigned long) == sizeof(uint64_t));
  const unsigned long v = PyLong_AsUnsignedLong(obj);
  if (v == static_cast<unsigned long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  *out = v;
  return true;
}

// n unsigned 64-bit integers from an array-like (numpy arrays of any integer dtype are cast in
// C, without per-element Python work; lists and scalars are accepted too). One value stands
// for every index (broadcast).
using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

// The same values, taken from a list or tuple of ints by a plain loop (numpy's conversion of a
// list inspects every element's type first, about 3x slower: SGLang passes lists of 8192
// addresses per call); anything else (numpy arrays, scalars, lists numpy must convert, such as
// negative values) goes through U64Array. Loaded by the type caster below.
struct U64Values {
  std::vector<uint64_t> owned;  // list or tuple values
  U64Array array;               // otherwise
  const uint64_t* data = nullptr;
  size_t size = 0;
};

class Column {
 public:
  explicit Column(const U64Array& values)
      : data_(values.data()), size_(static_cast<size_t>(values.size())) {}
  explicit Column(const U64Values& values) : data_(values.data), size_(values.size) {}
  size_t size() const { return size_; }
  uint64_t operator[](size_t i) const { return size_ == 1 ? data_[0] : data_[i]; }

 private:
  const uint64_t* data_;
  size_t size_;
};

void BindBuffers(py::module_& m);

}  // namespace kvferry::python

namespace pybind11::detail {

template <>
struct type_caster<kvferry::python::U64Values> {
  PYBIND11_TYPE_CASTER(kvferry::python::U64Values, const_name("ArrayLike[int]"));

  bool load(handle src, bool convert) {
    PyObject* obj = src.ptr();
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
      PyObject** items = PySequence_Fast_ITEMS(obj);
      value.owned.resize(static_cast<size_t>(n));
      bool fast = true;
      for (Py_ssize_t i = 0; i < n && fast; ++i) {
        fast = PyLong_Check(items[i]) &&
               kvferry::python::LongToU64(items[i], &value.owned[static_cast<size_t>(i)]);
      }
      if (fast) {
        value.data = value.owned.data();
        value.size = value.owned.size();
        return true;
      }
      value.owned.clear();
    }
    if (!convert && !kvferry::python::U64Array::check_(src)) return false;
    if (pybind11::isinstance<pybind11::array>(src)) {
      // The cast below turns a signed array's negative values into huge unsigned ones.
      const auto a = pybind11::reinterpret_borrow<pybind11::array>(src);
      const char kind = a.dtype().kind();
      if ((kind == 'i' || kind == 'f') && a.size() > 0) {
        pybind11::object negative = pybind11::module_::import("numpy").attr("less")(a, 0);
        if (negative.attr("any")().cast<bool>()) {
          const auto at = negative.attr("argmax")().cast<int64_t>();
          throw kvferry::python::StatusError(kvferry::InvalidArgumentError(
              "element " + std::to_string(at) +
              " of an address, length or offset array is negative (they are unsigned)"));
        }
      }
    }
    value.array = kvferry::python::U64Array::ensure(src);
    if (!value.array) {
      PyErr_Clear();
      return false;
    }
    value.data = value.array.data();
    value.size = static_cast<size_t>(value.array.size());
    return true;
  }
};

}  // namespace pybind11::detail
