// The disaggregation connectors (include/kvferry/connector.h) for Python, over memory the
// Python server owns: kvferry._kvferry.PrefillConnector, DecodeConnector and BootstrapServer.
// kvferry.sglang builds SGLang's backend interface on them.
//
// Each connector object owns the wrapped pools it was made with (KvPool::Wrap,
// AuxBuffer::Wrap, StatePool::Wrap over the caller's addresses): the caller keeps the memory
// alive until close() or the object is gone. Every call into a connector releases the GIL.
//
// Thread-safety: the Python objects may be used from any thread (the connectors are
// thread-safe); close() waits for calls in progress.
#pragma once

#include <pybind11/pybind11.h>

namespace kvferry::python {

// Adds PrefillConnector, DecodeConnector, BootstrapServer and geometry_from_hf_config to `m`.
void BindConnectors(pybind11::module_& m);

}  // namespace kvferry::python
