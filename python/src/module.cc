// kvferry._kvferry: the compiled half of the Python package (python/kvferry/ is the other).
#include <pybind11/pybind11.h>

#include "batch.h"
#include "buffers.h"
#include "connector.h"
#include "engine.h"
#include "errors.h"
#include "kvferry/segment.h"

PYBIND11_MODULE(_kvferry, m) {
  m.doc() =
      "kvferry's transfer engine (include/kvferry/engine.h) for Python: register memory, open "
      "peer segments by host:port, submit batches of WRITE/READ requests, notifications. "
      "Import it through the `kvferry` package.";
  m.attr("PROTOCOL_VERSION") = kvferry::kProtocolVersion;
  kvferry::python::BindErrors(m);
  kvferry::python::BindBuffers(m);
  kvferry::python::BindBatch(m);
  kvferry::python::BindEngine(m);
  kvferry::python::BindConnectors(m);
}
