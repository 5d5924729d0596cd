"""Parts of the CUDA backend that can be checked without a GPU (they run in CPU-only CI too):

  - the prologue builds layer1's reduce plan with one thread per source from the engine's own
    functions (csrc/cuda/plan_parts.h): the host build of the same helpers, run on random routings
    with the parts built in random order, equals the one-thread plan of comet/reduce_plan.h;
  - tools/check_ptxas.py flags spills in GEMM kernels and wgmma serialisation / setmaxnreg
    warnings."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PLAN_PARTS_TEST = r"""
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>
#include "comet/layout.h"
#include "comet/reduce_plan.h"
#include "plan_parts.h"
using namespace comet;
int main() {
  std::mt19937 rng(1);
  int fails = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    int W = 1 + rng() % 7, El = 1 + rng() % 3, E = W * El, k = 1 + rng() % 4, d = rng() % W;
    std::vector<std::vector<int32_t>> ids(W), pos(W);
    std::vector<std::vector<float>> wt(W);
    std::vector<int64_t> T(W);
    std::vector<int32_t> rc(W * El, 0);
    for (int s = 0; s < W; ++s) {
      T[s] = rng() % 9;
      ids[s].resize(T[s] * k); pos[s].resize(T[s] * k); wt[s].resize(T[s] * k);
      std::vector<int32_t> bo(E + 1), ss(T[s] * k + 1), fill(E);
      for (auto& v : ids[s]) v = int(rng() % (E + 1)) - 1;
      for (auto& v : wt[s]) v = float(rng() % 100) / 10;
      build_send_plan(ids[s].data(), T[s], k, E, bo.data(), ss.data(), pos[s].data(), fill.data());
      for (int el = 0; el < El; ++el) rc[s * El + el] = bo[d * El + el + 1] - bo[d * El + el];
    }
    std::vector<int64_t> eo(El + 1), so(El * (W + 1));
    build_dispatch_layout(rc.data(), d, W, El, eo.data(), so.data());
    std::vector<SourceRouting<float>> all(W);
    for (int s = 0; s < W; ++s) all[s] = {ids[s].data(), pos[s].data(), wt[s].data(), T[s]};
    struct Arrays { std::vector<int32_t> a, b, c; std::vector<int64_t> beg, row; std::vector<float> w; };
    auto make = [](int64_t n, Arrays& x) {
      x.a.assign(n + 1, -7); x.b.assign(n + 1, -7); x.c.assign(n + 1, -7);
      x.beg.assign(n + 2, -7); x.row.assign(n + 1, -7); x.w.assign(n + 1, -7);
      return ReducePlan<float>{0, x.a.data(), x.b.data(), x.c.data(), x.beg.data(), x.row.data(),
                               x.w.data()};
    };
    int64_t slots = 0;
    const int64_t entries = reduce_plan_size(all.data(), W, k, El, d, &slots);
    Arrays x1, x2;
    auto ref = make(slots + entries, x1);
    build_reduce_plan(all.data(), W, k, El, d, so.data(), ref);
    auto plan = make(slots + entries, x2);
    std::vector<SourceRouting<float>> views(W * W);
    std::vector<int64_t> cnt(2 * W), off(2 * W + 2);
    for (int s = 0; s < W; ++s) {
      gpu::source_view(all.data(), W, s, &views[s * W]);
      int64_t sl = 0;
      cnt[s] = reduce_plan_size(&views[s * W], W, k, El, d, &sl);
      cnt[W + s] = sl;
    }
    off[0] = 0; off[W + 1] = 0;
    for (int s = 0; s < W; ++s) {
      off[s + 1] = off[s] + cnt[s];
      off[W + 2 + s] = off[W + 1 + s] + cnt[W + s];
    }
    std::vector<int> order(W);
    for (int s = 0; s < W; ++s) order[s] = s;
    std::shuffle(order.begin(), order.end(), rng);  // threads finish in any order
    for (int s : order) {
      auto part = gpu::plan_part(plan, off[s], off[W + 1 + s]);
      build_reduce_plan(&views[s * W], W, k, El, d, so.data(), part);
    }
    for (int s = 0; s < W; ++s)
      for (int64_t i = off[s]; i < off[s + 1]; ++i) gpu::fix_entry_begin(plan, i, off[s], off[W + 1 + s]);
    plan.entry_begin[off[W]] = off[2 * W + 1];
    bool ok = off[W] == entries && off[2 * W + 1] == slots && ref.entries == entries;
    for (int64_t e = 0; e < entries && ok; ++e)
      ok = x1.a[e] == x2.a[e] && x1.b[e] == x2.b[e] && x1.c[e] == x2.c[e] && x1.beg[e] == x2.beg[e];
    ok = ok && x1.beg[entries] == x2.beg[entries];
    for (int64_t i = 0; i < slots && ok; ++i) ok = x1.row[i] == x2.row[i] && x1.w[i] == x2.w[i];
    if (!ok && ++fails < 5) std::printf("mismatch W=%d El=%d k=%d d=%d\n", W, El, k, d);
  }
  std::printf("%d failures\n", fails);
  return fails != 0;
}
"""


@pytest.mark.host_only
def test_reduce_plan_parts_equal_the_one_thread_plan(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "plan_parts_test.cpp"
    src.write_text(PLAN_PARTS_TEST)
    exe = tmp_path / "plan_parts_test"
    subprocess.run([cxx, "-std=c++20", "-O1", f"-I{ROOT}/csrc/include", f"-I{ROOT}/csrc/cuda",
                    str(src), "-o", str(exe)], check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


LOG = """\
ptxas info    : Compiling entry function '_ZN5comet3gpu4sm9012fused_kernelIN7cutlass6half_tELi0EEEvNS0_10CallParamsENS1_10GemmConfigIT_E6ParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN5comet3gpu4sm9012fused_kernelIN7cutlass6half_tELi0EEEvNS0_10CallParamsENS1_10GemmConfigIT_E6ParamsE
    128 bytes stack frame, 124 bytes spill stores, 124 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 128 bytes cumulative stack size
ptxas info    : (C7510) Potential Performance Loss: wgmma.mma_async instructions are serialized due to wgmma pipeline crossing function boundary at a function call in the function 'f'
ptxas info    : Compiling entry function '_ZN5comet3gpu12_GLOBAL__N_113finish_kernelENS0_10CallParamsE' for 'sm_80'
ptxas info    : Function properties for _ZN5comet3gpu12_GLOBAL__N_113finish_kernelENS0_10CallParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers, 320 bytes smem, 848 bytes cmem[0]
"""


@pytest.mark.host_only
def test_ptxas_check_flags_spills_and_wgmma_serialisation(tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import check_ptxas
    finally:
        sys.path.pop(0)
    rows, problems = check_ptxas.parse(LOG, "x.cu")
    assert [(r["arch"], r["regs"], r["smem"], r["spill_st"]) for r in rows] == [
        ("sm_90a", 168, 0, 124), ("sm_80", 8, 320, 0)]
    assert any("C7510" in p for p in problems)
    log = tmp_path / "ptxas.log"
    log.write_text(LOG)
    assert check_ptxas.main(["--log", str(log)]) == 1
    out = capsys.readouterr()
    assert "spills" in out.err and "sm90::fused_kernel<f16, 0>" in out.out
