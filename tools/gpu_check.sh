#!/usr/bin/env bash
# One command for a machine with one or more NVIDIA GPUs (no network needed): build comet with its
# CUDA kernels on every core, then measure and test it, and write one report with every figure and
# the command that produced it.
#
#   tools/gpu_check.sh [OUT_DIR]          # default: $OUT if set, else ./gpu-check
#   GPU_CHECK_STEPS="build bench" tools/gpu_check.sh   # only some steps (default: all, in order)
#
# Steps (each under its own time limit; a failing step is reported and the next still runs):
#   env      nvidia-smi, torch, nvcc, the compilers
#   build    setup.py build_ext --inplace, MAX_JOBS = cores, COMET_CUDA_ARCHS = this GPU's
#            architecture unless set (90 -> 90a); the build guard (build_cxx.py) picks a C++
#            compiler that links the shared libstdc++. CUTLASS headers: the nvidia-cutlass wheel
#            if importable, else a wheel file in .whl/ installed with --no-index into a temp dir.
#   guard    tests/test_build_guard.py on the built extension
#   tests    tests/gpu, a world of one (xdist when installed: a crashing test fails alone), but
#            the simulated worlds, which have a step of their own:
#   sim      tests/gpu/test_cuda_sim.py (make test-gpu-sim): the multi-rank cases at W = 2 and 4
#            as threads of one process on this one GPU (the protocol across ranks)
#   bench    bench/kernels.py --variants: comet beside torch._grouped_mm, the unfused torch layer
#            and a dense matmul, 4096 and 32 tokens, three model shapes (the README's table)
#   hbm      tools/hbm_stream.py: HBM read rate against streaming blocks and bytes in flight,
#            beside the cost model's assumption (a block's share of HBM, Little's law)
#   ncu      Nsight Compute on one Mixtral-shaped 4096-token call of each: the fused kernels'
#            duration, DRAM bytes, L2 hit rate and SM throughput, beside torch's grouped GEMM
#   tune     python -m comet.tune on the device (world of one, Mixtral, 4096 tokens): measured
#            splits stored in $OUT/tune-cache, then the bench's Mixtral rows again with them
#   multi    with 2+ GPUs: torchrun over all of them, tests/gpu
# Writes $OUT/report.md (the summary: every command, its exit code and time, and its figures),
# one log per step, kernels.json, hbm_stream.json, ncu.csv. About 9-12 minutes on a 16-core H200
# machine (an estimate from the steps, not a timed run).
set -u
OUT_DIR=${1:-${OUT:-gpu-check}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$(dirname "$0")/.."
ROOT=$PWD
REPORT=$OUT_DIR/report.md
STEPS=${GPU_CHECK_STEPS:-"env build guard tests sim bench hbm ncu tune multi"}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export COMET_CACHE_DIR=$OUT_DIR/tune-cache  # never the user's ~/.cache/comet

echo "# comet GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')" > "$REPORT"

# run NAME LIMIT_S CMD...: the command's output to NAME.log; its line, exit code, time and the
# log's tail into the report.
run() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS rc
  printf '\n## %s\n\n```\n$ %s\n' "$name" "$*" >> "$REPORT"
  timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  tail -n "${TAIL:-25}" "$OUT_DIR/$name.log" >> "$REPORT"
  printf '```\nexit %s after %s s%s\n' "$rc" "$((SECONDS - t0))" \
    "$([ "$rc" = 124 ] && echo " (time limit $limit s)")" >> "$REPORT"
  return "$rc"
}
want() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }

# CUTLASS headers: the wheel if importable, else a wheel file carried in .whl/.
if ! $PY -c "import cutlass_library" 2>/dev/null; then
  whl=$(ls "$ROOT"/.whl/nvidia_cutlass-*.whl 2>/dev/null | head -n 1)
  if [ -n "$whl" ]; then
    $PY -m pip install -q --no-index --no-deps --target /tmp/comet-site "$whl" &&
      export PYTHONPATH=/tmp/comet-site${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d '.')
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ -z "${COMET_CUDA_ARCHS:-}" ]; then
  case "$cc" in 90) export COMET_CUDA_ARCHS=90a ;; 89) export COMET_CUDA_ARCHS="80;89" ;;
    "") export COMET_CUDA_ARCHS="80;90a" ;; *) export COMET_CUDA_ARCHS=80 ;; esac
fi

if want env; then
  TAIL=40 run env 60 bash -c "nvidia-smi; $PY -c 'import torch; print(\"torch\", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; nvcc --version | tail -n 2; echo CXX=\${CXX:-unset}; g++ --version | head -n 1; nproc"
fi
if want build; then
  run build 900 env MAX_JOBS="$(nproc)" "$PY" setup.py build_ext --inplace
fi
if want guard; then
  run guard 120 "$PY" -m pytest tests/test_build_guard.py -q -p no:cacheprovider
fi
if want tests; then
  xdist=""
  $PY -c "import xdist" 2>/dev/null && xdist="-n 8"
  TAIL=40 run tests 600 "$PY" -m pytest tests/gpu -q -rfEs --timeout 120 $xdist -p no:cacheprovider \
    --ignore tests/gpu/test_cuda_sim.py
fi
if want sim; then
  # One process, no xdist: the simulated world's ranks share this GPU's SMs between them.
  TAIL=40 run sim 300 env CUDA_MODULE_LOADING=EAGER "$PY" -m pytest tests/gpu/test_cuda_sim.py \
    -q -rfEs --timeout 120 -p no:cacheprovider
fi
if want bench; then
  TAIL=60 run bench 600 "$PY" bench/kernels.py --variants --out "$OUT_DIR"
fi
if want hbm; then
  TAIL=50 run hbm 120 "$PY" tools/hbm_stream.py --out "$OUT_DIR"
fi
if want ncu && command -v ncu >/dev/null; then
  # The first Mixtral call's kernels (bench/kernels.py checks comet, then times every row with
  # one warm-up call): comet's fused and combine kernels and torch's GEMMs.
  metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size
  run ncu 600 ncu --csv --metrics "$metrics" --kernel-name-base demangled \
    --kernel-name "regex:fused_kernel|combine_kernel|[Gg]emm|[Gg]rouped|cutlass" \
    --launch-count 40 --log-file "$OUT_DIR/ncu.csv" \
    "$PY" bench/kernels.py --models mixtral --tokens 4096 --warmup 0 --iters 1 \
    --out "$OUT_DIR/ncu-bench"
  "$PY" - "$OUT_DIR/ncu.csv" >> "$REPORT" <<'EOF'
import csv, sys
rows = {}
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
for r in csv.DictReader(lines):
    key = (r["ID"], r["Kernel Name"][:90])
    rows.setdefault(key, {})[r["Metric Name"]] = (r["Metric Value"], r["Metric Unit"])
print("\n| launch | kernel | ms | DRAM read GB | DRAM write GB | L2 hit % | SM % | grid |")
print("|--:|---|--:|--:|--:|--:|--:|--:|")
def val(m, name, scale=1.0):
    v, unit = m.get(name, ("", ""))
    try:
        x = float(str(v).replace(",", ""))
    except ValueError:
        return "-"
    x *= {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "byte": 1e-9, "Kbyte": 1e-6,
          "Mbyte": 1e-3, "Gbyte": 1.0}.get(unit, scale)
    return f"{x:.4g}"
for (i, name), m in rows.items():
    print(f"| {i} | {name} | {val(m, 'gpu__time_duration.sum')} | {val(m, 'dram__bytes_read.sum')} "
          f"| {val(m, 'dram__bytes_write.sum')} | {val(m, 'lts__t_sector_hit_rate.pct')} "
          f"| {val(m, 'sm__throughput.avg.pct_of_peak_sustained_elapsed')} | {val(m, 'launch__grid_size')} |")
EOF
fi
if want tune; then
  run tune 300 "$PY" -m comet.tune --model mixtral --world 1 --tokens 4096 --dtype bf16
  run bench-tuned 300 "$PY" bench/kernels.py --models mixtral --out "$OUT_DIR/tuned"
fi
if want multi && [ "${ngpu:-0}" -ge 2 ]; then
  run multi 600 torchrun --nproc-per-node "$ngpu" -m pytest tests/gpu -q -x -rfEs -p no:cacheprovider
fi
echo "report: $REPORT"
