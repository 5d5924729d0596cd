"""Shared pieces of the benchmarks: scaled model shapes, the rank launcher (local CPU processes or
torchrun), synchronised timing with the max over ranks, and output (table, JSON, PNG).

Backends
--------
* CPU (default without a GPU): W local processes joined by gloo on 127.0.0.1 (tests.dist_utils
  .run_ranks: one torch thread per rank, timeouts, errors of any rank reported), comet's ops on
  the CPU backend (OS threads as blocks, POSIX shared memory). What is measured is that CPU
  backend: it says nothing about GPU performance.
* GPU (untested: written without a GPU): launch the script under
  ``torchrun --nproc-per-node W``; NCCL, CUDA events, comet's CUDA kernels.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from comet.tune.profiling import Timer  # noqa: E402  (the tuner's timer: benchmarks and tuning measure alike)

# Where the JSON (and PNG) results go without --out: ./bench-results of the directory the script
# runs from, not the source tree.
DEFAULT_OUT = "bench-results"

# docs/peers.md, "Model shapes of the Comet evaluation": hidden H, ffn per expert (gated), E, k.
# `scale` divides H and ffn for the CPU runs (every scaled model gets H = 128).
MODELS: Dict[str, Dict[str, Any]] = {
    "mixtral": dict(title="Mixtral-8x7B", H=4096, ffn=14336, E=8, k=2, scale=32),
    "qwen2": dict(title="Qwen2-MoE", H=2048, ffn=1408, E=64, k=4, scale=16),
    "phi3.5": dict(title="Phi-3.5-MoE", H=4096, ffn=6400, E=16, k=2, scale=32),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_LABEL = ("CPU backend (OS threads as blocks, POSIX shared memory, gloo all-to-all; shapes "
             "scaled down): measured on this CPU, not GPU results")


def shape_of(model: str, scale: Optional[int] = None, hidden: Optional[int] = None,
             ffn: Optional[int] = None) -> Dict[str, Any]:
    """A model's shape, H and ffn divided by `scale` (default: the model's CPU scale; 1 = full)."""
    m = dict(MODELS[model])
    s = int(m["scale"] if scale is None else scale)
    H = int(hidden or max(8, m["H"] // s))
    f = int(ffn or max(4, m["ffn"] // s))
    return dict(model=model, title=m["title"], E=m["E"], k=m["k"], H=H, ffn=f, N0=2 * f, N1=f,
                scale=s, full_H=m["H"], full_ffn=m["ffn"])


def progress(msg: str) -> None:
    """A progress line on stderr (rank 0 only when distributed)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
        sys.stderr.flush()


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------


def on_gpu() -> bool:
    return torch.cuda.is_available()


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def launch(body: Callable, world: int, *args, timeout: float = 1800.0, **kwargs) -> List[Any]:
    """Run ``body(rank, world, *args, **kwargs)`` on every rank; returns the results by rank.

    Under torchrun (the GPU path, untested here) this process is one rank: the group is
    initialised with NCCL (gloo without CUDA), the results are gathered with all_gather_object.
    Otherwise ``world`` local CPU processes are spawned (gloo)."""
    if under_torchrun():
        if not dist.is_initialized():
            backend = "nccl" if on_gpu() else "gloo"
            if on_gpu():
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        if dist.get_world_size() != world:
            raise SystemExit(f"--world {world} but torchrun started {dist.get_world_size()} ranks")
        mine = body(dist.get_rank(), world, *args, **kwargs)
        out: List[Any] = [None] * world
        dist.all_gather_object(out, mine)
        return out
    from tests.dist_utils import run_ranks

    return run_ranks(body, world, *args, timeout=timeout, **kwargs)


def is_main_process() -> bool:
    return not under_torchrun() or int(os.environ.get("RANK", "0")) == 0


def device() -> torch.device:
    if on_gpu() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


def time_call(fn: Callable[[], Any], dev: torch.device, group=None) -> float:
    """Seconds of one ``fn()`` on this rank, started right after a barrier of the group (the
    tuner's own timer, so benchmarks and tuning measure alike)."""
    return Timer(dev, group)(fn)


def measure(fns: Dict[str, Callable[[], Any]], dev: torch.device, warmup: int, iters: int,
            group=None, label: str = "") -> Dict[str, Dict[str, float]]:
    """Time every fn ``iters`` times after ``warmup`` untimed rounds, round-robin (one call of
    each per round, so drifts hit all alike). Per iteration the time of a collective is its
    slowest rank (max over ranks); reported: median (and min, max) of those over the iterations."""
    names = list(fns)
    samples = {n: [] for n in names}
    t_start = time.monotonic()
    for it in range(warmup + iters):
        for n in names:
            t = time_call(fns[n], dev, group)
            if it >= warmup:
                samples[n].append(t)
        if label and (it + 1) % max(1, (warmup + iters) // 4) == 0:
            progress(f"{label}: round {it + 1}/{warmup + iters} "
                     f"({time.monotonic() - t_start:.1f} s)")
    local = torch.tensor([samples[n] for n in names], dtype=torch.float64)
    if dev.type == "cuda":
        local = local.to(dev)
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    local = local.cpu()
    out = {}
    for i, n in enumerate(names):
        row = local[i].tolist()
        out[n] = dict(median=statistics.median(row), min=min(row), max=max(row), n=len(row))
    return out


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def ms(seconds: Optional[float]) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    return f"{seconds * 1e3:.2f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    fmt = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([fmt(headers), sep, *(fmt(r) for r in rows)])


def environment(backend: str) -> Dict[str, Any]:
    env = dict(backend=backend, torch=torch.__version__, python=platform.python_version(),
               machine=platform.machine(), cpu_count=os.cpu_count(),
               processor=platform.processor() or None,
               time=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    with contextlib.suppress(OSError, AttributeError):
        env["loadavg_1_5_15min"] = [round(v, 2) for v in os.getloadavg()]
    if backend == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                env["cpu_model"] = line.split(":", 1)[1].strip()
                break
    return env


NO_MATPLOTLIB = ("plot skipped: matplotlib is not installed (the 'bench' extra: "
                 "pip install -e '.[bench]')")


def arg_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser: its whole module doc (usage lines included) as the --help text."""
    return argparse.ArgumentParser(prog=prog, description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_output_args(p: argparse.ArgumentParser, name: str, smoke_size: str) -> None:
    """--smoke and --out, alike in every script. A smoke run writes <name>_smoke.*, so it never
    overwrites a full run's results."""
    p.add_argument("--smoke", action="store_true",
                   help=f"CI-sized run ({smoke_size}); writes {name}_smoke.json instead of "
                        f"{name}.json, so a full run's results are kept")
    p.add_argument("--out", metavar="DIR", default=None,
                   help=f"directory of the JSON (and PNG) results (default ./{DEFAULT_OUT})")


def add_shape_and_timing_args(p: argparse.ArgumentParser, *, warmup: int, iters: int) -> None:
    """--hidden, --ffn, --dtype, --warmup and --iters, alike in the layer benchmarks (the
    defaults of the rounds are each script's own)."""
    p.add_argument("--hidden", type=int, default=None, help="override H (after scaling)")
    p.add_argument("--ffn", type=int, default=None, help="override ffn (after scaling)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="default fp32 on the CPU, bf16 on a GPU")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed rounds before timing (default {warmup}; smoke: 1)")
    p.add_argument("--iters", type=int, default=None,
                   help=f"timed rounds; the median is shown (default {iters}; smoke: 3)")


def result_name(name: str, smoke: bool) -> str:
    return f"{name}_smoke" if smoke else name


def out_dir(out: Optional[str]) -> Path:
    """The results directory: --out, else ./bench-results of the current directory."""
    return Path(out) if out else Path.cwd() / DEFAULT_OUT


def write_json(name: str, data: Dict[str, Any], out: Optional[Path] = None) -> Path:
    d = out_dir(out)
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{name}.json"
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, p)
    return p


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None (then the plot is skipped with a note)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except Exception:  # noqa: BLE001
        return None
