// Which stream a buffer's calls run on (host logic of the CUDA backend, kept free of CUDA types so
// the CPU tests can check it with made-up stream ids).
//
// Every kernel of a call reads the call's number (epoch) from the buffer's device state, which the
// call's begin kernel advances: a graph replay then gets a fresh number without the host. The
// price is that two calls of one buffer must never run concurrently, or their kernels read each
// other's number. So a buffer has ONE stream at a time: its first call binds the stream it runs
// on; a call from another stream hands the buffer over by making the new stream wait for
// everything already queued on the old one (an event: stream-ordered, no host synchronisation),
// then binds the new stream. Calls made while their stream captures a CUDA graph run at replay, on
// whatever stream replays it, so they neither hand over nor rebind; handing over FROM a stream
// that is capturing is refused (the capture cannot be waited for from outside it).
#pragma once

#include <cstdint>

namespace comet {

enum class StreamStep : int32_t {
  Bind = 0,      // the buffer's first call: bind its stream
  Same = 1,      // the bound stream: nothing to do
  HandOver = 2,  // another stream: it waits for the bound stream's queued work, then is bound
  Capture = 3,   // the call is being captured: no hand-over, the binding stays
  Refuse = 4,    // the bound stream is capturing a graph and the call comes from another stream
};

// has_bound: the buffer has a stream, `bound`; current: the calling stream; *_capturing: whether
// that stream is capturing a CUDA graph now. Ids are opaque (the cudaStream_t's value; the legacy
// default stream is 0, hence has_bound).
inline StreamStep stream_step(bool has_bound, uint64_t bound, bool bound_capturing,
                              uint64_t current, bool current_capturing) {
  if (!has_bound) bound_capturing = false;
  if (current_capturing)
    return !bound_capturing || bound == current ? StreamStep::Capture : StreamStep::Refuse;
  if (!has_bound) return StreamStep::Bind;
  if (bound == current) return StreamStep::Same;
  return bound_capturing ? StreamStep::Refuse : StreamStep::HandOver;
}

}  // namespace comet
