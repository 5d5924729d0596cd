// comet._C.engine.copy_bench: the comm blocks' row copy (comet/copy.h copy_rows, what layer0's comm
// program runs per batch of row origins) on the CPU backend's thread team of one block, measured
// in bytes per second for a given number of independent 16-byte loads in flight per thread
// (Unroll 1, 2, 4 = kCopyUnroll, 8). Rows are gathered from random places of a shared-memory
// source region larger than the caches (as a comm block pulls token rows from peers' symmetric
// buffers) into a contiguous destination, in batches of `batch` rows. Used by bench/comm_copy.py.
#include <torch/extension.h>
#include <sys/mman.h>

#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "comet/copy.h"
#include "cpu/block_runner.h"

namespace py = pybind11;

namespace {

using namespace comet;

// An anonymous shared mapping: the same kind of memory the CPU backend's peers map.
struct SharedRegion {
  void* p = MAP_FAILED;
  size_t bytes = 0;
  explicit SharedRegion(size_t n) : bytes(n) {
    p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(p != MAP_FAILED, "copy_bench: mmap of ", n, " bytes failed");
    std::memset(p, 1, n);  // fault every page in before timing
  }
  ~SharedRegion() {
    if (p != MAP_FAILED) munmap(p, bytes);
  }
  char* data() const { return static_cast<char*>(p); }
};

template <int U>
void copy_batches(const std::vector<RowCopy>& rows, int32_t batch, size_t row_bytes, int tid,
                  int nthreads) {
  for (size_t b = 0; b < rows.size(); b += size_t(batch)) {
    const int32_t n = int32_t(std::min<size_t>(size_t(batch), rows.size() - b));
    copy_rows<U>(rows.data() + b, n, row_bytes, true, tid, nthreads);
  }
}

py::dict copy_bench(int64_t row_bytes, int64_t rows, int32_t batch, int32_t threads, int32_t unroll,
                    int64_t source_bytes, int32_t reps, uint64_t seed) {
  TORCH_CHECK_VALUE(row_bytes >= 16 && row_bytes % 16 == 0, "copy_bench: row_bytes must be a "
                    "positive multiple of 16, got ", row_bytes);
  TORCH_CHECK_VALUE(rows >= 1 && batch >= 1 && threads >= 1 && threads <= 1024 && reps >= 1,
                    "copy_bench: bad sizes rows=", rows, " batch=", batch, " threads=", threads,
                    " reps=", reps);
  TORCH_CHECK_VALUE(unroll == 1 || unroll == 2 || unroll == 4 || unroll == 8,
                    "copy_bench: unroll must be 1, 2, 4 or 8, got ", unroll);
  const int64_t src_rows = std::max<int64_t>(source_bytes / row_bytes, 1);
  SharedRegion src(size_t(src_rows * row_bytes)), dst(size_t(rows * row_bytes));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> pick(0, src_rows - 1);
  std::vector<RowCopy> plan(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    plan[size_t(r)] = RowCopy{dst.data() + r * row_bytes, src.data() + pick(rng) * row_bytes};

  double best = 1e300;
  for (int32_t rep = 0; rep < reps; ++rep) {
    double seconds = 0;
    cpu::run_grid(nullptr, 1, threads, 0, [&](cpu::CpuContext& ctx) {
      ctx.sync();
      const auto t0 = std::chrono::steady_clock::now();
      switch (unroll) {
        case 1: copy_batches<1>(plan, batch, size_t(row_bytes), ctx.thread(), ctx.threads()); break;
        case 2: copy_batches<2>(plan, batch, size_t(row_bytes), ctx.thread(), ctx.threads()); break;
        case 4: copy_batches<4>(plan, batch, size_t(row_bytes), ctx.thread(), ctx.threads()); break;
        default: copy_batches<8>(plan, batch, size_t(row_bytes), ctx.thread(), ctx.threads());
      }
      ctx.sync();
      if (ctx.thread() == 0)
        seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
    best = std::min(best, seconds);
  }
  // every row arrived: a wrong copy must not produce a figure
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(std::memcmp(plan[size_t(r)].dst, plan[size_t(r)].src, size_t(row_bytes)) == 0,
                "copy_bench: row ", r, " was not copied");
  py::dict out;
  out["bytes"] = rows * row_bytes;
  out["seconds"] = best;
  out["gbs"] = double(rows * row_bytes) / best / 1e9;
  return out;
}

}  // namespace

void bind_copy_bench(py::module_& engine) {
  engine.def("copy_bench", &copy_bench, py::arg("row_bytes"), py::arg("rows"),
             py::arg("batch") = 128, py::arg("threads") = 1, py::arg("unroll") = kCopyUnroll,
             py::arg("source_bytes") = int64_t(256) << 20, py::arg("reps") = 3,
             py::arg("seed") = 0);
}
