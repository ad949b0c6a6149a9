// kvferry.TransferEngine and kvferry.Segment: engine.h in Python terms.
//
// Thread-safety: as engine.h: every method may be called from any Python thread; each call
// into the engine releases the GIL, and callbacks (batch completion, notifications) run on
// engine threads holding the GIL.
#pragma once

#include <pybind11/pybind11.h>

namespace kvferry::python {

namespace py = pybind11;

void BindEngine(py::module_& m);

}  // namespace kvferry::python
