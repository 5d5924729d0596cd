"""Autotuner for the comm/GEMM split (``n_comm``) and the GEMM tile of Comet's fused MoE ops.

Pieces
------
* :class:`TuneKey` -- what a choice depends on: arch, SM count, dtype, layer, W, E, k, H, N, the
  token count rounded up to a power of two (:func:`token_bucket`), the ranks per node (default
  W: one node; keys of one node keep the id they had before nodes were modelled) and the expert
  tensor-parallel size ``tp_size`` (default 1; keys without TP keep their id too).  dtype "fp8"
  is FP8 operands with their scales (comet.tune.model.fp8).
* :class:`Config` -- the choice: ``n_comm``, ``tile_m``, ``tile_n`` and (layer1) ``band_n``, the
  n-tiles per column band of its GEMM (csrc/include/comet/tile_order.h; 0 = all; cache entries
  written before bands existed read as 1, the column order they were measured with).
* :class:`TuneCache` -- winners persisted as JSON, one file per arch, in ``$COMET_CACHE_DIR`` or
  ``~/.cache/comet``; written atomically (temporary file + rename, under a lock file, merged with
  what is on disk); a corrupt file is reported with a warning and ignored.
* :class:`Tuner` -- :meth:`Tuner.choose` answers from the cache (exact bucket, else the nearest
  measured bucket of an otherwise identical key), else from the cost model
  (:mod:`comet.tune.perfmodel`) for a known GPU or the CPU backend, else a generic default;
  :meth:`Tuner.tune` measures candidates and stores the winner.
* :func:`tune` -- the same through the process-wide default tuner.
* :data:`PROFILERS` -- hooks that turn a key into a ``run_fn`` on the real ops; filled in by the ops
  module (``PROFILERS["layer0"] = factory``, ``factory(key, shape, group) -> run_fn``,
  ``run_fn(config) -> seconds``).  :func:`profile` uses them.

Measurement and agreement across ranks
--------------------------------------
``run_fn(config) -> seconds`` is supplied by the caller (CUDA events on a GPU, wall clock on the
CPU) and is called the same number of times, with the same configs in the same order, on every
rank (it usually runs a collective kernel).  Each rank takes the median of ``iters`` timed calls
after ``warmup`` untimed ones; a call that raises or returns a non-finite or negative time marks
the candidate as failed (infinite time).  With torch.distributed initialised, the per-candidate
times are all-reduced with MAX over the group (a split is as fast as its slowest rank), then rank 0
of the group picks the minimum -- ties broken by the smallest ``n_comm``, then the smallest tile,
then candidate order -- and broadcasts its index, so every rank returns the same Config.  Every
rank records that winner (in memory and in its cache file), so later ``choose`` calls agree too.

This module imports neither torch nor the compiled ops at import time.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from statistics import median
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from . import perfmodel as pm
from .model import small_tile

__all__ = [
    "Config",
    "TuneKey",
    "TuneCache",
    "Tuner",
    "PROFILERS",
    "ProfilerUnavailable",
    "token_bucket",
    "normalize_dtype",
    "cache_dir",
    "default_config",
    "candidate_configs",
    "detect_device",
    "make_key",
    "default_tuner",
    "tune",
    "profile",
]

CACHE_ENV = "COMET_CACHE_DIR"
CACHE_FORMAT = "comet-tune-cache"
CACHE_VERSION = 1

# Filled in by the ops module: "layer0"/"layer1" -> factory(key, shape, group) -> run_fn, with
# run_fn(config) -> seconds for one call of the fused op with that config (collective over group).
PROFILERS: Dict[str, Callable[..., Callable[["Config"], float]]] = {}


class ProfilerUnavailable(RuntimeError):
    """No profiler hook registered for a layer: the compiled ops are not loaded."""


# ----------------------------------------------------------------------------------------------
# Config and key
# ----------------------------------------------------------------------------------------------


@dataclass
class Config:
    """One launch configuration of a fused op: comm blocks (0: staged, no comm blocks beside the
    GEMM, see comet.tune.perfmodel.choose_n_comm), the GEMM tile shape and layer1's band width
    (n-tiles per column band; 0 = all; layer0 ignores it)."""

    n_comm: int
    tile_m: int = pm.DEFAULT_TILE[0]
    tile_n: int = pm.DEFAULT_TILE[1]
    band_n: int = 1

    def __post_init__(self):
        self.n_comm, self.tile_m, self.tile_n = int(self.n_comm), int(self.tile_m), int(self.tile_n)
        self.band_n = int(self.band_n)
        if self.n_comm < 0 or self.tile_m < 1 or self.tile_n < 1:
            raise ValueError(f"invalid Config {self}: n_comm must be >= 0 and the tile >= 1")
        if self.band_n < 0:
            raise ValueError(f"invalid Config {self}: band_n must be >= 0 (0 = all n-tiles)")

    @property
    def tile(self) -> Tuple[int, int]:
        return (self.tile_m, self.tile_n)

    def to_dict(self) -> Dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Config":
        return cls(int(d["n_comm"]), int(d.get("tile_m", pm.DEFAULT_TILE[0])),
                   int(d.get("tile_n", pm.DEFAULT_TILE[1])), int(d.get("band_n", 1)))

    def sort_key(self) -> Tuple[int, int, int, int]:
        return (self.n_comm, self.tile_m, self.tile_n, self.band_n)


# How far (in power-of-two token buckets) a cached measurement may stand in for another bucket.
NEAREST_BUCKETS = 2


def token_bucket(tokens: int) -> int:
    """``tokens`` rounded up to a power of two (0 and 1 -> 1): bucket ``b`` covers ``(b/2, b]``."""
    t = int(tokens)
    if t < 0:
        raise ValueError(f"token count must be >= 0, got {tokens}")
    if t <= 1:
        return 1
    return 1 << (t - 1).bit_length()


def normalize_dtype(dtype) -> str:
    """Canonical dtype name: "bf16", "fp16", "fp32" or "fp8" (accepts torch dtypes and torch
    names: float8_e4m3fn and float8_e5m2 are "fp8")."""
    return pm.dtype_name(dtype)


def _norm_arch(arch: str) -> str:
    a = re.sub(r"[^a-z0-9.+-]+", "_", str(arch).strip().lower()).strip("_")
    if not a:
        raise ValueError(f"empty arch name {arch!r}")
    return a


@dataclass(frozen=True)
class TuneKey:
    """What a tuning choice depends on.  ``tokens`` is stored bucketed (:func:`token_bucket`).

    ``N`` is the per-expert GEMM size other than ``H`` (layer0: ``N0`` output columns, layer1:
    ``N1`` reduction size); ``layer`` is part of the key because the two ops differ even when
    ``N0 == N1``.  ``ranks_per_node`` (default ``W``: one node) groups the ranks into nodes; it
    changes the traffic over the inter-node link and hence the best split; ``node_reduce``
    (layer1's node-reduced combine, only meaningful with several nodes) does too.  ``tp_size``
    (expert tensor parallelism: ``W / tp_size`` EP groups of ``tp_size`` ranks; ``N`` is then
    this rank's shard) changes both the traffic and the GEMM.
    """

    arch: str
    sm_count: int
    dtype: str
    W: int
    E: int
    k: int
    H: int
    N: int
    tokens: int
    layer: int = 0
    ranks_per_node: Optional[int] = None
    node_reduce: bool = False
    tp_size: int = 1

    def __post_init__(self):
        object.__setattr__(self, "arch", _norm_arch(self.arch))
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        for f in ("sm_count", "W", "E", "k", "H", "N", "layer"):
            object.__setattr__(self, f, int(getattr(self, f)))
        object.__setattr__(self, "tokens", token_bucket(self.tokens))
        if self.layer not in (0, 1):
            raise ValueError(f"layer must be 0 or 1, got {self.layer}")
        if min(self.sm_count, self.W, self.E, self.k, self.H, self.N) < 1:
            raise ValueError(f"invalid TuneKey {self}")
        rpn = self.W if self.ranks_per_node is None else int(self.ranks_per_node)
        if rpn < 1 or self.W % rpn:
            raise ValueError(f"TuneKey: ranks_per_node={self.ranks_per_node} must divide W={self.W}")
        object.__setattr__(self, "ranks_per_node", rpn)
        # one node: nothing to reduce per node, the same key as without
        object.__setattr__(self, "node_reduce", bool(self.node_reduce) and rpn < self.W)
        t = int(self.tp_size)
        if t < 1 or self.W % t or self.E % (self.W // t):
            raise ValueError(f"TuneKey: tp_size={self.tp_size} must divide W={self.W}, and "
                             f"W/tp_size must divide E={self.E}")
        object.__setattr__(self, "tp_size", t)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "TuneKey":
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def id(self) -> str:
        """Canonical string, used as the JSON key."""
        nodes = "" if self.ranks_per_node == self.W else f"|P{self.ranks_per_node}"
        if self.node_reduce:
            nodes += "|R"
        if self.tp_size > 1:
            nodes += f"|TP{self.tp_size}"
        return (f"{self.arch}|sm{self.sm_count}|{self.dtype}|L{self.layer}|W{self.W}{nodes}"
                f"|E{self.E}|k{self.k}|H{self.H}|N{self.N}|T{self.tokens}")

    def family(self) -> Tuple:
        """Every field but the token bucket (the fields nearest-bucket lookup must match)."""
        return (self.arch, self.sm_count, self.dtype, self.layer, self.W, self.ranks_per_node,
                self.node_reduce, self.tp_size, self.E, self.k, self.H, self.N)

    def shape(self, tokens: Optional[int] = None) -> pm.MoEShape:
        """The perfmodel shape for this key (``tokens`` defaults to the bucket)."""
        return pm.MoEShape(W=self.W, E=self.E, k=self.k, H=self.H, N=self.N,
                           T=self.tokens if tokens is None else int(tokens),
                           dtype_bytes=pm.DTYPE_BYTES[self.dtype],
                           ranks_per_node=self.ranks_per_node, node_reduce=self.node_reduce,
                           tp_size=self.tp_size,
                           tp_path=pm.BUILT_TP_PATH if self.tp_size > 1 else None)

    @classmethod
    def from_shape(cls, arch: str, sm_count: int, dtype, shape: pm.MoEShape, layer: int) -> "TuneKey":
        return cls(arch, sm_count, dtype, shape.W, shape.E, shape.k, shape.H, shape.N, shape.T, layer,
                   shape.ranks_per_node, shape.node_reduce, shape.tp_size)


# ----------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """``$COMET_CACHE_DIR`` if set, else ``~/.cache/comet`` (read at every call)."""
    d = os.environ.get(CACHE_ENV)
    return Path(d).expanduser() if d else Path.home() / ".cache" / "comet"


@contextlib.contextmanager
def _file_lock(path: Path):
    """Exclusive advisory lock on ``path`` (POSIX flock); a no-op where unavailable."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    fd = os.open(str(path), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class TuneCache:
    """JSON store of tuned configs, one file ``<dir>/<arch>.json`` per arch.

    File layout: ``{"format": "comet-tune-cache", "version": 1, "arch": ..., "entries":
    {key_id: {"key": {...}, "config": {...}, "seconds": float|null, "source": str,
    "updated": unix_time}}}``.
    """

    def __init__(self, directory: Optional[os.PathLike] = None):
        self._directory = Path(directory).expanduser() if directory is not None else None

    @property
    def directory(self) -> Path:
        return self._directory if self._directory is not None else cache_dir()

    def path(self, arch: str) -> Path:
        return self.directory / f"{_norm_arch(arch)}.json"

    # -- reading ---------------------------------------------------------------------------
    def load(self, arch: str) -> Dict[str, Dict[str, Any]]:
        """Entries of ``arch``'s file ({} if missing; a corrupt file warns and reads as {})."""
        p = self.path(arch)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as e:
            warnings.warn(f"comet: cannot read tuning cache {p}: {e}; ignoring it", RuntimeWarning,
                          stacklevel=2)
            return {}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
                raise ValueError("not a comet tuning cache")
            if int(data.get("version", -1)) != CACHE_VERSION:
                raise ValueError(f"unsupported version {data.get('version')!r}")
            entries = data.get("entries")
            if not isinstance(entries, dict):
                raise ValueError("'entries' is not an object")
        except (ValueError, TypeError) as e:
            warnings.warn(f"comet: ignoring corrupt tuning cache {p}: {e}", RuntimeWarning,
                          stacklevel=2)
            return {}
        good = {}
        for kid, ent in entries.items():
            try:
                key = TuneKey.from_dict(ent["key"])
                Config.from_dict(ent["config"])
            except (KeyError, TypeError, ValueError) as e:
                warnings.warn(f"comet: skipping bad entry {kid!r} in {p}: {e!r}", RuntimeWarning,
                              stacklevel=2)
                continue
            good[key.id()] = ent
        return good

    def get(self, key: TuneKey, nearest: bool = True) -> Optional[Tuple[Config, TuneKey]]:
        """The cached config for ``key`` and the key it was stored under, or None.

        Exact bucket first; else, if ``nearest``, the entry of an otherwise identical key whose
        bucket is closest in log2 distance (ties: the larger bucket), if it is at most
        ``NEAREST_BUCKETS`` buckets away: a split measured at 4096 tokens says nothing about 32
        (there the layer streams weights, a different regime), so the cost model decides there.
        """
        entries = self.load(key.arch)
        ent = entries.get(key.id())
        if ent is not None:
            return Config.from_dict(ent["config"]), key
        if not nearest:
            return None
        best = None
        target = math.log2(key.tokens)
        fam = key.family()
        for ent in entries.values():
            k2 = TuneKey.from_dict(ent["key"])
            if k2.family() != fam:
                continue
            rank = (abs(math.log2(k2.tokens) - target), -k2.tokens)
            if rank[0] > NEAREST_BUCKETS:
                continue
            if best is None or rank < best[0]:
                best = (rank, k2, ent)
        if best is None:
            return None
        return Config.from_dict(best[2]["config"]), best[1]

    def has_band(self, key: TuneKey) -> bool:
        """Whether the entry stored under ``key`` records layer1's band (entries written before
        bands existed do not; :meth:`get` reads them as column order, band 1)."""
        ent = self.load(key.arch).get(key.id())
        return ent is not None and "band_n" in ent["config"]

    # -- writing ---------------------------------------------------------------------------
    def put(self, key: TuneKey, config: Config, seconds: Optional[float] = None,
            source: str = "measured", extra: Optional[Dict[str, Any]] = None) -> Path:
        """Store ``config`` for ``key``: merged with the file's current content, written
        atomically (temporary file in the same directory, fsync, rename) under a lock file."""
        d = self.directory
        d.mkdir(parents=True, exist_ok=True)
        p = self.path(key.arch)
        with _file_lock(d / f".{p.name}.lock"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a corrupt file was reported on read; replace it
                entries = self.load(key.arch)
            ent = {
                "key": key.to_dict(),
                "config": config.to_dict(),
                "seconds": None if seconds is None or not math.isfinite(seconds) else float(seconds),
                "source": source,
                "updated": time.time(),
            }
            if extra:
                ent.update(extra)
            entries[key.id()] = ent
            data = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "arch": key.arch,
                    "entries": dict(sorted(entries.items()))}
            fd, tmp = tempfile.mkstemp(dir=str(d), prefix=f".{p.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(data, f, indent=1, sort_keys=False)
                    f.write("\n")
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, p)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        return p


# ----------------------------------------------------------------------------------------------
# Defaults and candidates
# ----------------------------------------------------------------------------------------------


def _blocks(sm_count: int, max_blocks: Optional[int]) -> int:
    return sm_count if max_blocks is None else min(sm_count, int(max_blocks))


def default_config(sm_count: int, max_blocks: Optional[int] = None, tile=pm.DEFAULT_TILE) -> Config:
    """Generic split when neither a measurement nor a cost model applies: about a fifth of the
    blocks for comm (Comet's release uses 28 comm blocks on 132 SMs), at least 1, leaving 1+ GEMM."""
    total = _blocks(sm_count, max_blocks)
    if total < 2:
        raise ValueError(f"need at least 2 co-resident blocks, have {total}")
    n = min(total - 1, max(1, round(total * 0.2)))
    return Config(n, *pm._tile(tile))


_GRID = (0, 1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128)


def candidate_configs(
    sm_count: int,
    tiles: Sequence[Tuple[int, int]] = (pm.DEFAULT_TILE,),
    n_comm_values: Optional[Iterable[int]] = None,
    around: Optional[int] = None,
    max_blocks: Optional[int] = None,
    bands: Sequence[int] = (1,),
) -> List[Config]:
    """Candidates for :func:`tune`: ``n_comm_values`` (default: a coarse grid, with 0, the staged
    layer) plus the neighbourhood ``around +- 2`` (e.g. the model's choice), within
    ``[0, blocks - 1]``, times ``tiles``, times ``bands`` (layer1's band widths; a staged
    candidate runs one band, 0, whatever ``bands`` says: its comm starts after the GEMM, so bands
    only re-read h); sorted by (n_comm, tile, band)."""
    total = _blocks(sm_count, max_blocks)
    vals = set(_GRID if n_comm_values is None else (int(v) for v in n_comm_values))
    if around is not None:
        vals.update(range(int(around) - 2, int(around) + 3))
    vals = sorted(v for v in vals if 0 <= v <= total - 1)
    out = sorted({Config(v, int(tm), int(tn), int(b) if v > 0 else 0).sort_key()
                  for v in vals for tm, tn in tiles for b in set(bands)})
    out = [Config(*k) for k in out]
    return sorted(out, key=Config.sort_key)


def detect_device() -> Tuple[str, int]:
    """(arch, sm_count) of the current device: a :data:`perfmodel.GPUS` key (or the sanitised
    device name) and its SM count on a GPU; ``("cpu", threads)`` without one."""
    try:
        import torch

        if torch.cuda.is_available():
            idx = torch.cuda.current_device()
            name = torch.cuda.get_device_name(idx)
            sms = torch.cuda.get_device_properties(idx).multi_processor_count
            return pm.spec_from_device_name(name) or _norm_arch(name), int(sms)
    except Exception:  # noqa: BLE001 - no torch / no driver: fall back to the CPU backend
        pass
    return "cpu", max(2, os.cpu_count() or 2)


def make_key(shape: pm.MoEShape, layer: int, dtype, arch: Optional[str] = None,
             sm_count: Optional[int] = None) -> TuneKey:
    """TuneKey for ``shape`` on ``arch``/``sm_count`` (detected when not given)."""
    if arch is None or sm_count is None:
        a, s = detect_device()
        arch = a if arch is None else arch
        sm_count = s if sm_count is None else sm_count
    return TuneKey.from_shape(arch, sm_count, dtype, shape, layer)


# ----------------------------------------------------------------------------------------------
# Progress line
# ----------------------------------------------------------------------------------------------


def _band_text(config: Config) -> str:
    """" band=b" for a layer1 band other than column order (b = 1, also layer0's value)."""
    return "" if config.band_n == 1 else f" band={config.band_n}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class _Progress:
    """A one-line text progress bar on stderr (rewritten in place on a terminal), with the time
    left: announced before the first call (the caller's estimate per call, if any), re-estimated
    from the first call's time, then from the candidates done so far."""

    def __init__(self, total: int, label: str, enabled: bool, stream=None, calls: int = 1):
        self.total, self.label, self.enabled, self.calls = total, label, enabled, calls
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.best = math.inf
        self.t0 = time.monotonic()
        self.calls_done = 0

    def _say(self, line: str) -> None:
        if self.enabled:
            self.stream.write(line + "\n")
            self.stream.flush()

    def start(self, warmup: int, iters: int, estimate_call_s: Optional[float]) -> None:
        est = ("" if estimate_call_s is None else
               f"; roughly {_duration(estimate_call_s * self.calls * self.total)} in all "
               f"({estimate_call_s * 1e3:.3g} ms per call, an estimate)")
        self._say(f"[comet tune] {self.label}: {self.total} candidates x {self.calls} calls "
                  f"({warmup} warm-up + {iters} timed){est}")

    def call_done(self, seconds: float) -> None:
        """After every op call; the first one sets the estimate (a slow shape shows it at once)."""
        self.calls_done += 1
        if self.calls_done == 1 and self.total * self.calls > 1:
            left = seconds * (self.total * self.calls - 1)
            self._say(f"[comet tune] {self.label}: first call {seconds:.3g} s, about "
                      f"{_duration(left)} left")

    def update(self, i: int, config: Config, seconds: float) -> None:
        if not self.enabled:
            return
        self.best = min(self.best, seconds)
        width = 20
        filled = int(width * i / max(1, self.total))
        bar = "#" * filled + "." * (width - filled)
        t = "failed" if not math.isfinite(seconds) else f"{seconds * 1e3:.3f} ms"
        b = "-" if not math.isfinite(self.best) else f"{self.best * 1e3:.3f} ms"
        elapsed = time.monotonic() - self.t0
        left = elapsed / i * (self.total - i)
        line = (f"[comet tune] {self.label} [{bar}] {i}/{self.total} n_comm={config.n_comm} "
                f"tile={config.tile_m}x{config.tile_n}{_band_text(config)}: {t} (best {b}, "
                f"{elapsed:.1f} s, ~{_duration(left)} left)")
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self, winner: Optional[Config], seconds: float) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\n")
        if winner is not None:
            self.stream.write(f"[comet tune] {self.label}: chose n_comm={winner.n_comm} "
                              f"tile={winner.tile_m}x{winner.tile_n}{_band_text(winner)} "
                              f"({seconds * 1e3:.3f} ms, "
                              f"max over ranks)\n")
        self.stream.flush()


# ----------------------------------------------------------------------------------------------
# Tuner
# ----------------------------------------------------------------------------------------------


def _as_config(c) -> Config:
    if isinstance(c, Config):
        return c
    if isinstance(c, dict):
        return Config.from_dict(c)
    return Config(*c)


def _dist_info(group):
    """(torch.distributed module, group, rank in group, world, device for collectives) or None."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return None
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("tune(): a group was given but torch.distributed is not initialised")
        return None
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    import torch

    device = torch.device("cpu")
    if str(dist.get_backend(group)).lower() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    return dist, group, rank, world, device


def _pick(configs: Sequence[Config], times: Sequence[float]) -> int:
    """Index of the fastest config; ties: smallest n_comm, then tile, then band, then position;
    -1 if none."""
    best = -1
    for i, (c, t) in enumerate(zip(configs, times)):
        if not math.isfinite(t):
            continue
        if best < 0 or (t, c.sort_key(), i) < (times[best], configs[best].sort_key(), best):
            best = i
    return best


class Tuner:
    """Chooses and tunes :class:`Config` s; see the module doc."""

    def __init__(self, cache_dir: Optional[os.PathLike] = None):
        self.cache = TuneCache(cache_dir)
        self._memo: Dict[Tuple, Tuple[Config, str]] = {}
        self._measured: Dict[TuneKey, Config] = {}  # winners of tune() in this process

    def clear(self) -> None:
        """Forget memoised choices and this process's tune() winners (re-read the cache)."""
        self._memo.clear()
        self._measured.clear()

    def lookup(self, key: TuneKey, nearest: bool = True) -> Optional[Config]:
        """Cached config for ``key`` (exact bucket, else the nearest measured bucket), or None."""
        hit = self.cache.get(key, nearest=nearest)
        return None if hit is None else hit[0]

    def store(self, key: TuneKey, config: Config, seconds: Optional[float] = None,
              source: str = "measured") -> None:
        self.cache.put(key, config, seconds=seconds, source=source)
        self._memo.clear()

    def choose(
        self,
        key: TuneKey,
        shape: Optional[pm.MoEShape] = None,
        spec: Optional[pm.GpuSpec] = None,
        max_blocks: Optional[int] = None,
        tile=None,
        explain: bool = False,
        tiles=None,
    ):
        """The Config to launch ``key`` with.

        1. a measurement: this process's :meth:`tune` winner for ``key``, else the cache (exact
           or nearest token bucket), if it fits ``max_blocks``;
        2. else the cost model's ``n_comm`` for ``spec`` (default: the spec of ``key.arch`` scaled
           to ``key.sm_count``; arch ``"cpu"`` uses the CPU pseudo-spec), on ``shape`` (default:
           the key's shape at the bucket's token count) with ``tile`` (default 128x128), or, given
           ``tiles`` (candidates, e.g. the CUDA kernels' comet.tune.model.small_tile.CUDA_TILES)
           and no ``tile``, with the tile the model picks among them (small_tile.choose_tile:
           64 rows where every expert has at most 64, else 128);
        3. else (unknown arch) :func:`default_config`.

        Memoised per arguments.  With ``explain`` returns ``(config, source)`` where source is
        "measured", "cache", "cache-nearest", "model" or "default".

        ``choose`` is local to the process: ranks agree when they share the cache file or ran
        :meth:`tune` together (which stores the same winner on every rank).
        """
        memo_key = (key, shape, spec, max_blocks, None if tile is None else tuple(tile),
                     None if tiles is None else tuple(tuple(t) for t in tiles))
        hit = self._memo.get(memo_key)
        if hit is None:
            hit = self._choose(key, shape, spec, max_blocks, tile, tiles)
            self._memo[memo_key] = hit
        cfg = Config(**hit[0].to_dict())  # a fresh copy: Config is mutable
        return (cfg, hit[1]) if explain else cfg

    def model_band(self, key: TuneKey, n_comm: int, tile=None, shape: Optional[pm.MoEShape] = None,
                   spec: Optional[pm.GpuSpec] = None, max_blocks: Optional[int] = None) -> int:
        """layer1's band width for ``n_comm`` comm blocks as the cost model picks it
        (:func:`comet.tune.perfmodel.choose_band`); 1 (column order) for layer0, an unknown GPU
        or no tokens.  What a config without a measured band runs with: one given explicitly
        (``n_comm=`` / ``tile=``), or a cache entry written before bands existed."""
        if key.layer != 1:
            return 1
        total = _blocks(key.sm_count, max_blocks)
        spec = spec if spec is not None else pm.get_spec(key.arch, key.sm_count)
        shp = shape if shape is not None else key.shape()
        if spec is None or min(total, spec.max_blocks) < 2 or shp.T <= 0 or \
                not 0 <= n_comm <= total - 1:
            return 1
        tile = pm.DEFAULT_TILE if tile is None else pm._tile(tile)
        return pm.choose_band(shp, spec, n_comm, tile, n_blocks=total)

    def _choose(self, key, shape, spec, max_blocks, tile, tiles=None) -> Tuple[Config, str]:
        total = _blocks(key.sm_count, max_blocks)
        allowed = None if tiles is None else {pm._tile(t) for t in tiles}
        fits = lambda c: allowed is None or c.tile in allowed  # noqa: E731
        mine = self._measured.get(key)
        if mine is not None and 0 <= mine.n_comm <= total - 1 and fits(mine):
            return Config(**mine.to_dict()), "measured"
        cached = self.cache.get(key, nearest=True)
        if cached is not None:
            cfg, k2 = cached
            if 0 <= cfg.n_comm <= total - 1 and fits(cfg):
                if not self.cache.has_band(k2):  # an entry from before bands: the model's
                    cfg.band_n = self.model_band(key, cfg.n_comm, cfg.tile, shape, spec,
                                                 max_blocks)
                return cfg, ("cache" if k2 == key else "cache-nearest")
        if spec is None:
            spec = pm.get_spec(key.arch, key.sm_count)
        if tile is None and tiles is not None and spec is not None and \
                min(total, spec.max_blocks) >= 2:
            shp = shape if shape is not None else key.shape()
            tile = small_tile.choose_tile(shp, spec, key.layer, total, tiles) if shp.T > 0 \
                else pm.DEFAULT_TILE
        tile = pm.DEFAULT_TILE if tile is None else pm._tile(tile)
        if spec is not None and min(total, spec.max_blocks) >= 2:
            shp = shape if shape is not None else key.shape()
            if shp.T > 0:
                n = pm.choose_n_comm(shp, spec, key.layer, max_blocks=total, tile=tile)
                return Config(n, *tile, self.model_band(key, n, tile, shp, spec, max_blocks)), \
                    "model"
        return default_config(key.sm_count, max_blocks, tile), "default"

    def tune(
        self,
        key: TuneKey,
        candidates: Iterable,
        run_fn: Callable[[Config], float],
        group=None,
        warmup: int = 1,
        iters: int = 3,
        progress: bool = True,
        store: bool = True,
        estimate_call_s: Optional[float] = None,
    ) -> Config:
        """Measure ``candidates`` with ``run_fn`` and return the winner (same on every rank).

        See the module doc for the protocol. With ``progress`` rank 0 reports on stderr: the
        number of candidates and calls first (with ``estimate_call_s``, a rough total), the time
        left after the first call, then a line per candidate.  Every rank remembers the winner (later
        :meth:`choose` calls return it) and, unless ``store`` is false, writes it to its cache
        (ranks sharing a file write the same entry under the lock; ranks on other nodes get it
        too).  Raises RuntimeError if every candidate failed.
        """
        configs = [_as_config(c) for c in candidates]
        if not configs:
            raise ValueError("tune(): no candidates")
        if iters < 1 or warmup < 0:
            raise ValueError(f"tune(): need iters >= 1 and warmup >= 0, got {iters}, {warmup}")
        info = _dist_info(group)
        rank = 0 if info is None else info[2]
        nodes = "" if key.ranks_per_node == key.W else f" ({key.W // key.ranks_per_node} nodes)"
        nodes += f" TP={key.tp_size}" if key.tp_size > 1 else ""
        label = f"layer{key.layer} {key.arch} W={key.W}{nodes} E={key.E} k={key.k} H={key.H} " \
                f"N={key.N} T<={key.tokens} {key.dtype}"
        bar = _Progress(len(configs), label, enabled=progress and rank == 0, calls=warmup + iters)
        bar.start(warmup, iters, estimate_call_s)

        def reported(cfg):
            t0 = time.monotonic()
            try:
                return run_fn(cfg)
            finally:
                bar.call_done(time.monotonic() - t0)

        times: List[float] = []
        for i, cfg in enumerate(configs):
            t = self._measure(cfg, reported, warmup, iters)
            times.append(t)
            bar.update(i + 1, cfg, t)
        if info is not None:
            dist, grp, rank, world, device = info
            import torch

            buf = torch.tensor(times, dtype=torch.float64, device=device)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=grp)
            times = [float(x) for x in buf.cpu().tolist()]
            choice = torch.tensor([_pick(configs, times) if rank == 0 else -2], dtype=torch.int64,
                                  device=device)
            src = 0 if grp is None else dist.get_global_rank(grp, 0)
            dist.broadcast(choice, src=src, group=grp)
            idx = int(choice.item())
        else:
            idx = _pick(configs, times)
        if idx < 0:
            bar.close(None, math.inf)
            raise RuntimeError(f"tune(): every one of the {len(configs)} candidates failed for {key}")
        winner = configs[idx]
        bar.close(winner, times[idx])
        self._measured[key] = Config(**winner.to_dict())
        self._memo.clear()
        if store:
            self.store(key, winner, seconds=times[idx], source="measured")
        return Config(**winner.to_dict())

    @staticmethod
    def _measure(cfg: Config, run_fn, warmup: int, iters: int) -> float:
        try:
            for _ in range(warmup):
                run_fn(cfg)
            samples = [float(run_fn(cfg)) for _ in range(iters)]
        except Exception as e:  # noqa: BLE001 - a failing candidate loses, it does not abort
            warnings.warn(f"comet tune: candidate {cfg} failed: {e!r}", RuntimeWarning, stacklevel=3)
            return math.inf
        t = median(samples)
        return t if math.isfinite(t) and t >= 0 else math.inf


_DEFAULT: Optional[Tuner] = None


def default_tuner() -> Tuner:
    """The process-wide tuner (its cache directory follows ``$COMET_CACHE_DIR`` at each call)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Tuner()
    return _DEFAULT


def tune(
    key: TuneKey,
    candidates: Iterable,
    run_fn: Callable[[Config], float],
    group=None,
    warmup: int = 1,
    iters: int = 3,
    progress: bool = True,
    tuner: Optional[Tuner] = None,
) -> Config:
    """:meth:`Tuner.tune` on ``tuner`` (default: :func:`default_tuner`)."""
    t = default_tuner() if tuner is None else tuner
    return t.tune(key, candidates, run_fn, group=group, warmup=warmup, iters=iters,
                  progress=progress)


def profile(
    key: TuneKey,
    shape: Optional[pm.MoEShape] = None,
    group=None,
    candidates: Optional[Iterable] = None,
    profilers: Optional[Dict[str, Callable]] = None,
    tuner: Optional[Tuner] = None,
    max_blocks: Optional[int] = None,
    **tune_kwargs,
) -> Config:
    """Tune ``key`` on the real op through ``profilers`` (default :data:`PROFILERS`).

    ``profilers["layer0"|"layer1"](key, shape, group)`` must return ``run_fn(config) ->
    seconds``.  Default candidates: :func:`candidate_configs` around the cost model's choice,
    with the 128 x 128 tile and, on a GPU where every expert has at most 64 rows, the 64 x 128
    one.  Raises :class:`ProfilerUnavailable` when no hook is registered for the layer.
    """
    hooks = PROFILERS if profilers is None else profilers
    name = f"layer{key.layer}"
    factory = hooks.get(name)
    if factory is None:
        raise ProfilerUnavailable(
            f"no profiler registered for {name}: profiling needs the compiled ops "
            f"(comet.layers.ops fills comet.tune.tuner.PROFILERS when its extension is built and loaded)")
    t = default_tuner() if tuner is None else tuner
    shape = key.shape() if shape is None else shape
    if candidates is None:
        around, bands = None, {1}
        spec = pm.get_spec(key.arch, key.sm_count)
        if spec is not None and shape.T > 0 and _blocks(key.sm_count, max_blocks) >= 2:
            around = pm.choose_n_comm(shape, spec, key.layer, max_blocks=max_blocks)
            if key.layer == 1:  # column order and the model's band, each measured
                bands.add(pm.choose_band(shape, spec, around, n_blocks=max_blocks))
        # GPUs: the small-batch tile too, where it removes padding (comet.tune.model.small_tile)
        tiles = (pm.DEFAULT_TILE,)
        if key.arch != "cpu" and shape.T > 0 and small_tile.small_tile_fits(pm.expert_rows(shape)):
            tiles += (small_tile.SMALL_TILE,)
        candidates = candidate_configs(key.sm_count, tiles=tiles, around=around,
                                       max_blocks=max_blocks, bands=tuple(bands))
    run_fn = factory(key, shape, group)
    return t.tune(key, candidates, run_fn, group=group, **tune_kwargs)
