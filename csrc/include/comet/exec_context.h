// The execution context the comm programs are written against. A program is a template over Ctx;
// the CPU backend (csrc/cpu/cpu_context.h) and the CUDA kernels (csrc/cuda/) each provide one.
//
//   int32_t block() const, blocks() const   this comm block's index / number of comm blocks
//   int32_t thread() const, threads() const  thread rank in the block / threads per block
//   void sync()                              block-wide barrier
//   void copy(void* dst, const void* src, size_t bytes)
//                                            cooperative copy by all threads of the block (16-byte
//                                            vectors on the GPU); dst/src may be peer memory
//   void copy_rows(const RowCopy* rows, int32_t n, size_t bytes, bool vectorisable)
//                                            cooperative copy of a batch of rows (copy.h): several
//                                            16-byte loads in flight per thread
//   void acquire(int32_t rank)               block-wide: make a source rank's published data
//                                            readable (the GPU waits for its data flag once per
//                                            call; a no-op where the host waited before the kernel)
//   char* data(int32_t rank)                 base of a rank's symmetric data segment (own or peer);
//                                            a source's only after acquire(rank)
//   RankHeader* header(int32_t rank)         base of a rank's symmetric header
//   void wait(uint64_t* flag, uint64_t epoch, WaitSite site, int64_t index)
//                                            block-wide: returns once *flag >= epoch (acquire);
//                                            gives up with an error naming site/index after the
//                                            buffer's timeout instead of hanging
//   bool failed()                            (comm contexts) a wait of this call gave up and
//                                            returned (GPU): publish nothing more to peers;
//                                            always false on the CPU, whose waits throw
//   void fence_peers()                       make this thread's stores to peer memory visible to
//                                            peers before a later release (system fence on GPU)
//   void delay()                             stress hook: a random pause on the CPU, no-op on GPU
//   void work(int64_t n)                     span accounting: n more elements assigned to this
//                                            thread (counted on the CPU, no-op on the GPU)
//   void* block_shared()                     the block's shared scratch, kBlockSharedBytes bytes
//   bool reachable(int32_t rank)             rank's header/data may be dereferenced (same node)
//   void put_signal(int32_t rank, void* dst, const void* src, size_t bytes, uint64_t* sig,
//                   uint64_t value)          one thread: non-blocking put of bytes from src into
//                                            rank's copy of the symmetric object dst (given as
//                                            its address in THIS rank's segment), then rank's
//                                            copy of flag sig (this rank's header) := value;
//                                            FIFO per target (a signal covers earlier puts)
#pragma once

#include "comet/config.h"
#include "comet/copy.h"

namespace comet {

constexpr size_t kBlockSharedBytes = 16 * 1024;

// What a wait was for, so a timeout can say which flag never arrived.
enum class WaitSite : int32_t {
  PeerDone = 0,      // a peer finishing the previous call (buffer reuse handshake)
  PeerMeta = 1,      // a peer's call metadata
  PeerData = 2,      // a peer's published source data
  PeerMapped = 3,    // a peer mapping our new data segment
  PeerGeneration = 4,// a peer's new data segment
  RowTile = 5,       // layer0: an m-tile's rows dispatched (GEMM block waiting on comm blocks)
  ColumnTile = 6,    // layer1: an n-tile finished (comm block waiting on GEMM blocks)
  Partials = 7,      // layer1: a peer's partial sums of our tokens
  GridBarrier = 8,   // a grid barrier of a multi-block program
  MirrorRows = 9,    // layer0: rows of a source on another node (its mirror on this node's relay)
  PeerRearm = 10,    // a peer re-arming the buffer after a failed call (host only)
};

// Flags of these sites are written and read by this GPU only (device-scope acquire suffices);
// the others are written by peers (system scope).
COMET_HD bool local_site(WaitSite s) {
  return s == WaitSite::RowTile || s == WaitSite::ColumnTile || s == WaitSite::GridBarrier;
}

COMET_HD const char* wait_site_name(WaitSite s) {  // host and device (timeout messages)
  switch (s) {
    case WaitSite::PeerDone: return "peer finishing the previous call";
    case WaitSite::PeerMeta: return "peer call metadata";
    case WaitSite::PeerData: return "peer source data";
    case WaitSite::PeerMapped: return "peer mapping the new data segment";
    case WaitSite::PeerGeneration: return "peer data segment generation";
    case WaitSite::RowTile: return "layer0 m-tile rows (comm -> GEMM)";
    case WaitSite::ColumnTile: return "layer1 n-tile (GEMM -> comm)";
    case WaitSite::Partials: return "layer1 partial sums from peer";
    case WaitSite::GridBarrier: return "grid barrier of a prologue program";
    case WaitSite::MirrorRows: return "rows of a source on another node (mirror on the relay)";
    case WaitSite::PeerRearm: return "peer re-arming the buffer after a failed call";
  }
  return "?";
}

}  // namespace comet
