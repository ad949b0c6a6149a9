// Reading the array interfaces: CUDA array interface and numpy array interface (both describe
// memory with "data" = (pointer, read_only), "shape", "typestr" and optional "strides"), the
// buffer protocol, and torch-style tensors.
#include "buffers.h"

#include <string>
#include <vector>

#include "errors.h"
#include "kvferry/engine.h"

namespace kvferry::python {
namespace {

[[noreturn]] void Invalid(const std::string& message) {
  throw StatusError(InvalidArgumentError(message));
}

// LocateMemory may initialise CUDA (a second on a GPU machine): without the GIL.
MemoryLocation Locate(uint64_t address) {
  py::gil_scoped_release release;
  return LocateMemory(reinterpret_cast<const void*>(address));
}

std::string TypeName(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__name__")); }

// Bytes of one item from a typestr such as "<f2", "|u1" or "<M8[ns]".
uint64_t ItemBytes(const std::string& typestr) {
  uint64_t bytes = 0;
  size_t i = 2;
  for (; i < typestr.size() && typestr[i] >= '0' && typestr[i] <= '9'; ++i) {
    bytes = bytes * 10 + static_cast<uint64_t>(typestr[i] - '0');
  }
  if (typestr.size() < 3 || i == 2 || bytes == 0) Invalid("malformed typestr '" + typestr + "'");
  return bytes;
}

// Total bytes of a C-contiguous array; throws when `strides` describe another layout.
uint64_t ContiguousBytes(const std::vector<int64_t>& shape, const py::object& strides,
                         uint64_t item_bytes, const std::string& what) {
  uint64_t elements = 1;
  for (int64_t extent : shape) {
    if (extent < 0) Invalid(what + ": negative extent in shape");
    elements *= static_cast<uint64_t>(extent);
  }
  if (strides.is_none() || elements == 0) return elements * item_bytes;
  auto stride = strides.cast<std::vector<int64_t>>();
  if (stride.size() != shape.size()) Invalid(what + ": strides and shape differ in length");
  int64_t expected = static_cast<int64_t>(item_bytes);
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] != 1 && stride[d] != expected) {
      Invalid(what +
              " is not C-contiguous: register a contiguous array (e.g. "
              "numpy.ascontiguousarray, tensor.contiguous())");
    }
    expected *= shape[d];
  }
  return elements * item_bytes;
}

// The CUDA or numpy array interface dictionary.
BufferSpan FromInterface(const py::dict& face, const std::string& what) {
  if (!face.contains("data") || !face.contains("shape") || !face.contains("typestr")) {
    Invalid(what + " lacks data, shape or typestr");
  }
  py::object data = face["data"];
  if (!py::isinstance<py::tuple>(data) || py::len(data) != 2) {
    Invalid(what + ": data must be a (pointer, read_only) tuple");
  }
  auto pair = data.cast<py::tuple>();
  BufferSpan span;
  span.address = pair[0].cast<uint64_t>();
  span.read_only = pair[1].cast<bool>();
  auto shape = face["shape"].cast<std::vector<int64_t>>();
  py::object strides = face.contains("strides") ? py::object(face["strides"]) : py::none();
  span.length_bytes =
      ContiguousBytes(shape, strides, ItemBytes(face["typestr"].cast<std::string>()), what);
  return span;
}

BufferSpan FromCudaArray(py::handle obj) {
  BufferSpan span = FromInterface(obj.attr("__cuda_array_interface__").cast<py::dict>(),
                                  TypeName(obj) + ".__cuda_array_interface__");
  if (span.length_bytes == 0) return span;
  span.location = Locate(span.address);
  if (span.location.kind != MemoryKind::kCuda) {
    throw StatusError(FailedPreconditionError(
        TypeName(obj) +
        " exposes __cuda_array_interface__ but its memory is not CUDA device "
        "memory seen by this process (kvferry built without CUDA, or no GPU)"));
  }
  return span;
}

// Exports the buffer (held by the caller until unregistration). Returns false when `obj`
// does not support the protocol.
bool FromBufferProtocol(py::handle obj, DescribedBuffer* out) {
  if (!PyObject_CheckBuffer(obj.ptr())) return false;
  auto view = std::make_unique<Py_buffer>();
  if (PyObject_GetBuffer(obj.ptr(), view.get(), PyBUF_C_CONTIGUOUS) != 0) {
    py::error_already_set error;  // fetches and clears the Python error
    if (error.matches(PyExc_BufferError) && py::hasattr(obj, "__array_interface__")) {
      // e.g. a numpy dtype the buffer protocol cannot express: the array interface can; a
      // non-contiguous array is refused there with the same reason.
      return false;
    }
    Invalid("cannot export the memory of a " + TypeName(obj) + " (" + error.what() +
            "): register a C-contiguous object");
  }
  out->span.address = reinterpret_cast<uint64_t>(view->buf);
  out->span.length_bytes = static_cast<uint64_t>(view->len);
  out->span.read_only = view->readonly != 0;
  out->hold->Hold(std::move(view));
  return true;
}

bool IsTorchStyle(py::handle obj) {
  return py::hasattr(obj, "data_ptr") && py::hasattr(obj, "numel") &&
         py::hasattr(obj, "element_size") && py::hasattr(obj, "is_contiguous") &&
         py::hasattr(obj, "device");
}

BufferSpan FromTorchStyle(py::handle obj) {
  const std::string what = TypeName(obj);
  if (!obj.attr("is_contiguous")().cast<bool>()) {
    Invalid(what + " is not contiguous: register tensor.contiguous()");
  }
  BufferSpan span;
  span.address = obj.attr("data_ptr")().cast<uint64_t>();
  span.length_bytes =
      obj.attr("numel")().cast<uint64_t>() * obj.attr("element_size")().cast<uint64_t>();
  auto device_type = py::str(obj.attr("device").attr("type")).cast<std::string>();
  if (device_type == "cuda") {
    span.location = Locate(span.address);
    if (span.length_bytes != 0 && span.location.kind != MemoryKind::kCuda) {
      throw StatusError(FailedPreconditionError(
          what +
          " is a CUDA tensor but its memory is not CUDA device memory seen by this "
          "process (kvferry built without CUDA, or no GPU)"));
    }
  } else if (device_type != "cpu") {
    Invalid(what + " lives on device type '" + device_type + "': only cpu and cuda are supported");
  }
  return span;
}

}  // namespace

DescribedBuffer DescribeBuffer(py::handle obj) {
  DescribedBuffer out;
  out.hold = std::make_unique<HeldBuffer>(py::reinterpret_borrow<py::object>(obj));
  if (py::hasattr(obj, "__cuda_array_interface__")) {
    out.span = FromCudaArray(obj);
  } else if (FromBufferProtocol(obj, &out)) {
    // described by the exported buffer
  } else if (py::hasattr(obj, "__array_interface__")) {
    out.span = FromInterface(obj.attr("__array_interface__").cast<py::dict>(),
                             TypeName(obj) + ".__array_interface__");
  } else if (IsTorchStyle(obj)) {
    out.span = FromTorchStyle(obj);
  } else {
    Invalid("cannot find the memory of a " + TypeName(obj) +
            ": pass an int address with length (and device), or an object exposing "
            "__cuda_array_interface__, __array_interface__ or the buffer protocol");
  }
  return out;
}

void BindBuffers(py::module_& m) {
  m.def(
      "describe_buffer",
      [](py::handle obj) {
        DescribedBuffer d = DescribeBuffer(obj);
        py::object device = py::none();
        if (d.span.location.kind == MemoryKind::kCuda) device = py::int_(d.span.location.device_id);
        return py::make_tuple(d.span.address, d.span.length_bytes, device);
      },
      py::arg("obj"),
      "Where an object's bytes are: (address, length_bytes, device), device None for host "
      "memory or the CUDA ordinal. Accepts what register_memory accepts (numpy arrays, torch "
      "tensors, CuPy arrays, bytearray, memoryview, ...); C-contiguous only.\n\n"
      "Raises InvalidArgumentError (no known interface, not contiguous) or "
      "FailedPreconditionError (a CUDA array without CUDA in this build or process).");
  m.def(
      "locate_memory",
      [](uint64_t address) -> py::object {
        MemoryLocation where = Locate(address);
        if (where.kind == MemoryKind::kCuda) return py::int_(where.device_id);
        return py::none();
      },
      py::arg("address"),
      "The CUDA device ordinal of the memory at `address`, or None for host memory (or a build "
      "or machine without CUDA). On a machine with a GPU the first call initialises CUDA.");
}

bool IndexToU64(PyObject* item, uint64_t* out) {
  PyObject* index = PyLong_Check(item) ? Py_NewRef(item) : PyNumber_Index(item);
  if (index == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool in_range = LongToU64(index, out);
  Py_DECREF(index);
  return in_range;
}

std::string Describe(py::handle item) {
  std::string text;
  try {
    text = py::repr(item).cast<std::string>();
  } catch (const py::error_already_set&) {
    text = "?";
  }
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return text + " (" + py::str(py::type::handle_of(item).attr("__name__")).cast<std::string>() +
         ")";
}

}  // namespace kvferry::python
