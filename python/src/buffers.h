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

// `item` as a uint64 when it is an int in [0, 2^64) (bools count: True is 1) or has
// __index__ (numpy integer scalars); false otherwise, with no Python error left set. Needs the
// GIL.
bool IndexToU64(PyObject* item, uint64_t* out);

// A short description of a bad value for error messages: its repr (cut to 40 characters) and
// its type's name. Never throws a Python error. Needs the GIL.
std::string Describe(py::handle item);

// n unsigned 64-bit integers from an array-like (numpy arrays of any integer dtype are cast in
// C, without per-element Python work; lists and scalars are accepted too). One value stands
// for every index (broadcast).
using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

// The same values, taken from a list or tuple of ints by a plain loop (numpy's conversion of a
// list inspects every element's type first, about 3x slower: SGLang passes lists of 8192
// addresses per call); a signed numpy array is read as int64 and checked for negative values
// in C, its bits then taken as they are; anything else (unsigned or float arrays, scalars,
// lists numpy must convert) goes through U64Array. Loaded by the type caster below.
struct U64Values {
  std::vector<uint64_t> owned;  // list or tuple values
  py::array array;              // otherwise: the array `data` points into
  const uint64_t* data = nullptr;
  size_t size = 0;
};

// Throws InvalidArgumentError naming the first negative of `n` values, if any.
template <typename T>
void RefuseNegative(const T* values, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (values[i] < 0) {
      throw StatusError(InvalidArgumentError(
          "element " + std::to_string(i) +
          " of an address, length or offset array is negative (they are unsigned)"));
    }
  }
}

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
      // The U64Array cast would turn negative values into huge unsigned ones.
      const char kind = pybind11::reinterpret_borrow<pybind11::array>(src).dtype().kind();
      if (kind == 'i') {
        using I64Array =
            pybind11::array_t<int64_t, pybind11::array::c_style | pybind11::array::forcecast>;
        I64Array values = I64Array::ensure(src);
        if (!values) {
          PyErr_Clear();
          return false;
        }
        value.size = static_cast<size_t>(values.size());
        kvferry::python::RefuseNegative(values.data(), value.size);
        value.data = reinterpret_cast<const uint64_t*>(values.data());  // all >= 0: same bits
        value.array = std::move(values);
        return true;
      }
      if (kind == 'f') {
        using F64Array =
            pybind11::array_t<double, pybind11::array::c_style | pybind11::array::forcecast>;
        F64Array values = F64Array::ensure(src);
        if (!values) {
          PyErr_Clear();
        } else {
          kvferry::python::RefuseNegative(values.data(), static_cast<size_t>(values.size()));
        }
      }
    }
    kvferry::python::U64Array values = kvferry::python::U64Array::ensure(src);
    if (!values) {
      PyErr_Clear();
      return false;
    }
    value.data = values.data();
    value.size = static_cast<size_t>(values.size());
    value.array = std::move(values);
    return true;
  }
};

}  // namespace pybind11::detail
