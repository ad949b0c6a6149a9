// kvferry.Error and its subclasses, one per StatusCode (status.h explains the codes).
#include "errors.h"

#include <array>

namespace kvferry::python {
namespace {

struct CodeClass {
  StatusCode code;
  const char* enum_name;   // kvferry.StatusCode member
  const char* class_name;  // kvferry.<class_name>
  const char* doc;
};

constexpr CodeClass kCodeClasses[] = {
    {StatusCode::kCancelled, "CANCELLED", "CancelledError",
     "The caller cancelled the operation (Batch.cancel(), or the engine closed)."},
    {StatusCode::kUnknown, "UNKNOWN", "UnknownError", "An error of no known kind."},
    {StatusCode::kInvalidArgument, "INVALID_ARGUMENT", "InvalidArgumentError",
     "The arguments are wrong whatever the system state: fix the call."},
    {StatusCode::kDeadlineExceeded, "DEADLINE_EXCEEDED", "DeadlineExceededError",
     "The operation's deadline passed before it finished (a stalled or slow peer)."},
    {StatusCode::kNotFound, "NOT_FOUND", "NotFoundError",
     "A named thing (segment, batch, registered region) does not exist."},
    {StatusCode::kAlreadyExists, "ALREADY_EXISTS", "AlreadyExistsError",
     "A thing with that id exists already."},
    {StatusCode::kPermissionDenied, "PERMISSION_DENIED", "PermissionDeniedError",
     "The peer did not prove the deployment's shared secret (docs/security.md)."},
    {StatusCode::kResourceExhausted, "RESOURCE_EXHAUSTED", "ResourceExhaustedError",
     "A queue, pool or ring is full: retry later or with less."},
    {StatusCode::kFailedPrecondition, "FAILED_PRECONDITION", "FailedPreconditionError",
     "The system is not in a state for this, e.g. an address range that is not registered."},
    {StatusCode::kAborted, "ABORTED", "AbortedError", "The peer aborted the operation."},
    {StatusCode::kOutOfRange, "OUT_OF_RANGE", "OutOfRangeError",
     "An offset or index lies outside its valid range."},
    {StatusCode::kUnimplemented, "UNIMPLEMENTED", "UnimplementedError",
     "Not supported by this build or transport (e.g. GPU memory without CUDA)."},
    {StatusCode::kInternal, "INTERNAL", "InternalError",
     "A kvferry bug or an unexpected system error."},
    {StatusCode::kUnavailable, "UNAVAILABLE", "UnavailableError",
     "The peer is gone or unreachable; a retry may succeed once it is back."},
    {StatusCode::kDataLoss, "DATA_LOSS", "DataLossError",
     "Bytes arrived but are not what was sent."},
};

// The classes live as long as the process (the module is never unloaded): plain references,
// created once at import.
PyObject* g_error_base = nullptr;
std::array<PyObject*, 16> g_error_class{};

PyObject* ClassOf(StatusCode code) {
  auto index = static_cast<size_t>(code);
  if (index < g_error_class.size() && g_error_class[index] != nullptr) {
    return g_error_class[index];
  }
  return g_error_class[static_cast<size_t>(StatusCode::kUnknown)];
}

}  // namespace

py::object ErrorObject(const Status& status) {
  if (status.ok()) return py::none();
  py::handle cls(ClassOf(status.code()));
  py::object error = cls(status.message());
  error.attr("message") = status.message();
  return error;
}

void BindErrors(py::module_& m) {
  py::enum_<StatusCode> codes(m, "StatusCode",
                              "Canonical status codes (abseil's), as kvferry's C++ API "
                              "returns them; each error class carries its own as `code`.");
  codes.value("OK", StatusCode::kOk);
  for (const CodeClass& c : kCodeClasses) codes.value(c.enum_name, c.code);

  g_error_base = PyErr_NewExceptionWithDoc(
      "kvferry.Error",
      "Base class of every kvferry error. `code` is the kvferry.StatusCode of the class, "
      "`message` the status message (also str(error)).",
      PyExc_Exception, nullptr);
  if (g_error_base == nullptr) throw py::error_already_set();
  py::handle base(g_error_base);
  base.attr("code") = py::none();
  m.attr("Error") = base;
  for (const CodeClass& c : kCodeClasses) {
    std::string qualified = std::string("kvferry.") + c.class_name;
    PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), c.doc, g_error_base, nullptr);
    if (cls == nullptr) throw py::error_already_set();
    py::handle(cls).attr("code") = py::cast(c.code);
    g_error_class[static_cast<size_t>(c.code)] = cls;
    m.attr(c.class_name) = py::handle(cls);
  }

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object error = ErrorObject(e.status());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    }
  });
}

}  // namespace kvferry::python
