// Small synchronous device-memory operations, event relays, staging kernels and bounce
// buffers, behind an interface
// with no CUDA types so host-only code (pools, connector, tools) can call them in every build;
// without CUDA they report "no CUDA device".
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "cuda/pool_geometry.h"
#include "kvferry/status.h"

namespace kvferry::cuda {

// Synchronous copies between host memory and the memory of one CUDA device, and a memset of
// device memory: each returns once the bytes are in place. They run on a non-blocking stream
// of kvferry's own (one per device, calls take turns) through a pinned scratch buffer, so
// they never wait for other work on the device, such as a model on the legacy default stream:
// a caller whose own kernels or copies on other streams touch the same bytes synchronizes
// those first. Errors: kInvalidArgument when the device-side address is not CUDA device memory
// (host, pinned host or managed memory), and CUDA's.
Status CopyToDevice(void* dst, const void* src, uint64_t bytes);
Status CopyToHost(void* dst, const void* src, uint64_t bytes);
Status MemsetDevice(void* dst, int value, uint64_t bytes);
// Background reads of 8-byte words of one GPU's memory, one slot per word watched, so that a
// value can be checked off the latency path: an 8-byte device-to-host copy takes several
// microseconds, more on an idle GPU (docs/perf/layerwise.md).
// Seen answers from the slot's last finished read and starts the next one on the device's
// private stream (above), which waits for no other work. Thread-safe (a lock per slot).
class DeviceWordProbes {
 public:
  // `slots` probes of memory on `device`: a pinned host word each (cudaMallocHost) and a CUDA
  // event, made on the slot's first read. Errors: kUnimplemented / kFailedPrecondition
  // without CUDA or device, kInvalidArgument for slots < 1, kResourceExhausted.
  static StatusOr<std::unique_ptr<DeviceWordProbes>> Create(int device, int32_t slots);
  // Waits for the reads under way.
  virtual ~DeviceWordProbes() = default;
  // Whether the last finished read of `slot` returned `want`. Unless it did, starts another
  // read of the 8 bytes at `src` (8-byte aligned, in this object's device's memory) when none
  // of this slot is under way and the private stream is free (so a caller polling in a loop
  // keeps one read after another going, each ~7 us); never waits. A failed read counts as
  // not seen. A read started before the word was written may still return the old value:
  // only a true answer says something. REQUIRES 0 <= slot < slots.
  virtual bool Seen(int32_t slot, const void* src, uint64_t want) = 0;
  // Drops what `slot` has read (the word is about to mean something else, e.g. its row was
  // freed): a read under way is not answered from either. Never waits.
  virtual void Forget(int32_t slot) = 0;
};
// Whether the work before a recorded cudaEvent_t has finished (cudaEventQuery): true, false
// (still running), or the error the event reports.
StatusOr<bool> EventCompleted(void* event);
// The calling thread's current CUDA device (0 when it cannot be read).
int CurrentDevice();

// Stand-ins for callers' CUDA events: Relay(e, &lane) queues, on the lane's private stream of
// `device`, a wait for `e` as recorded now and a record of an event of its own, and returns
// that event. It completes once `e` did, so the caller may destroy or re-record `e` as soon as
// Relay returned. Relays on one lane complete in order (one stream); give unrelated work
// (e.g. passes computing on different streams) lanes of their own. A null *lane gets an idle
// stream (or a new one), returned when the last copy of the lane handle is dropped. Events
// stay ours while their holder (or a copy) lives, then go back to a pool (re-recorded later:
// waits already queued on them are unaffected). Thread-safe; holders and lanes may outlive
// the relay. Errors: CUDA failures (a bad event handle included).
class EventRelay {
 public:
  static StatusOr<std::unique_ptr<EventRelay>> Create(int device);
  virtual ~EventRelay() = default;
  // holder.get() is the cudaEvent_t.
  virtual StatusOr<std::shared_ptr<void>> Relay(void* event, std::shared_ptr<void>* lane) = 0;
};

// Heterogeneous-TP staging on the GPU for one pool: gathers a head slice of the pool into a
// staging region in GPU memory, or scatters one back (the same bytes and layout as GatherHeads
// / ScatterHeads in head_slices.h). The pool's buffers may lie anywhere on `device` (one
// block, or a server's separately allocated per-layer tensors, KvPool::Wrap): the kernels
// take each buffer's first byte from a table of them in device memory, uploaded once by
// Create. Each call waits for its kernel. Thread-safe: calls from several threads take turns
// on its one stream and page-table buffer on `device` (and make `device` current for the
// call, restoring the caller's).
class GpuHeadSlices {
 public:
  // `g`: the pool's geometry (GpuGeometry in disagg/connector_pools.h); `buffer_bases`: the
  // first byte of each of its g.num_buffers buffers in GPU memory of `device`
  // (KvPool::BufferBase order), each g.buffer_stride bytes long. The pool must outlive the
  // object. Errors: kInvalidArgument (not one non-null base per buffer), kUnimplemented /
  // kFailedPrecondition without CUDA or device, CUDA's.
  static StatusOr<std::unique_ptr<GpuHeadSlices>> Create(int device, const PoolGeometry& g,
                                                         std::span<uint8_t* const> buffer_bases);
  virtual ~GpuHeadSlices() = default;
  // `pages`: the request's pages in token order (host memory); `first_token`.. as in
  // head_slices.h, with attention layers [first_layer, first_layer + num_layers) (0: all).
  // `staging`: the region in GPU memory of `device` (not read through the span on the host);
  // it must hold the StagingBytes the range needs. Blocks until the kernel finished. Errors:
  // kOutOfRange (heads, layers, tokens or a page outside the pool, or a region too short;
  // nothing moved), CUDA's.
  virtual Status Gather(std::span<const int32_t> pages, int64_t first_token, int64_t num_tokens,
                        int head_start, int num_heads, int first_layer, int num_layers,
                        std::span<uint8_t> staging) = 0;
  virtual Status Scatter(std::span<const int32_t> pages, int64_t first_token, int64_t num_tokens,
                         int head_start, int num_heads, int first_layer, int num_layers,
                         std::span<const uint8_t> staging) = 0;
};

// Pinned host buffers with asynchronous copies to and from one GPU, for moving GPU memory
// through TCP: a buffer is filled from the device (or emptied into it) by a copy on this
// object's stream, and Ready/Wait tell when that copy finished. Each call makes `device`
// current and restores the caller's context. Not thread-safe: one owning thread.
class BounceBuffers {
 public:
  // `count` buffers of `bytes` each (pinned, cudaMallocHost). Errors: kUnimplemented /
  // kFailedPrecondition without CUDA or device, kResourceExhausted when pinned memory runs out.
  static StatusOr<std::unique_ptr<BounceBuffers>> Create(int device, int count, uint64_t bytes);
  virtual ~BounceBuffers() = default;
  virtual int count() const = 0;
  virtual uint64_t bytes() const = 0;
  virtual int device() const = 0;
  virtual uint8_t* host(int i) = 0;
  // Starts copying `n` (<= bytes()) bytes from device memory into buffer i, or from buffer i
  // into device memory; returns at once. The buffer must not be touched until Ready/Wait say
  // the copy finished.
  virtual Status StartFromDevice(int i, const void* device_src, uint64_t n) = 0;
  virtual Status StartToDevice(int i, void* device_dst, uint64_t n) = 0;
  // Whether buffer i's last copy finished (true with no copy started); its error if it failed.
  virtual StatusOr<bool> Ready(int i) = 0;
  // Blocks until buffer i's last copy finished.
  virtual Status Wait(int i) = 0;
};

}  // namespace kvferry::cuda
