// Input checks shared by the CPU and CUDA kernels of both ops. They never throw: the verdict goes
// into the call metadata so every rank of the group raises (a local throw would leave the peers
// waiting). `code` is 0 (fine), 1 (ValueError) or 2 (TypeError).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "comet/activation.h"
#include "comet/config.h"
#include "comet/symm_layout.h"

namespace comet {

struct CheckResult {
  int32_t code = 0;
  std::string message;
  bool ok() const { return code == 0; }
};

struct Layer0Inputs {
  const at::Tensor& x;
  const at::Tensor& w0;
  const at::Tensor& topk_ids;
  int64_t num_experts;
  const std::optional<at::Tensor>& b0;
  bool w0_transposed;  // w0 is [E_local, H, N0]
  int64_t max_rows;    // -1: no bound
  int64_t tp = 1;      // tp_size (comet/layout.h): E_local = E / (W / tp)
  // FP8 (comet/fp8_rows.h): x_scale [T, ceil(H/128)] with an FP8 x, w0_scale [E_local,
  // ceil(N0/128), ceil(H/128)] with FP8 w0, y0's dtype, and whether a 16/32-bit x goes on the
  // wire quantised to FP8.
  const std::optional<at::Tensor>& x_scale = kNone;
  const std::optional<at::Tensor>& w0_scale = kNone;
  std::optional<at::ScalarType> out_dtype = std::nullopt;
  bool dispatch_fp8 = false;
  // The activation fused into the epilogue (comet/activation.h), as the caller named it.
  std::optional<std::string> activation = std::nullopt;
  bool h_fp8 = false;  // h emitted as FP8 packed rows (needs an activation)
  static inline const std::optional<at::Tensor> kNone{};
};

struct Layer1Inputs {
  const at::Tensor& h;
  const at::Tensor& w1;
  const at::Tensor& topk_weights;
  const at::Tensor& topk_ids;
  const at::Tensor& send_pos;
  const at::Tensor& recv_counts;
  int64_t num_experts;
  const std::optional<at::Tensor>& b1;
  bool w1_transposed;  // w1 is [E_local, N1, H]
  int64_t max_rows;    // -1: no bound; else h has max_rows rows
  int64_t tp = 1;      // tp_size (comet/layout.h)
  // FP8: h_scale [rows of h, ceil(N1/128)], w1_scale [E_local, ceil(H/128), ceil(N1/128)], out's dtype.
  const std::optional<at::Tensor>& h_scale = Layer0Inputs::kNone;
  const std::optional<at::Tensor>& w1_scale = Layer0Inputs::kNone;
  std::optional<at::ScalarType> out_dtype = std::nullopt;
};

inline bool is_fp8(const at::Tensor& t) {
  return t.defined() && t.scalar_type() == at::kFloat8_e4m3fn;
}

// The dtype of a call's result: out_dtype, else bfloat16 when an input is FP8 (or goes FP8 on the
// wire), else the activation's dtype.
inline at::ScalarType result_dtype(const at::Tensor& act, const at::Tensor& w, bool fp8_wire,
                                   std::optional<at::ScalarType> out_dtype) {
  if (out_dtype) return *out_dtype;
  return is_fp8(act) || is_fp8(w) || fp8_wire ? at::kBFloat16 : act.scalar_type();
}

// Column counts of the weights whatever their layout: (N0, H) of w0, (H, N1) of w1.
inline int64_t w0_out(const at::Tensor& w0, bool t) { return w0.size(t ? 2 : 1); }
inline int64_t w0_in(const at::Tensor& w0, bool t) { return w0.size(t ? 1 : 2); }
inline int64_t w1_out(const at::Tensor& w1, bool t) { return w1.size(t ? 2 : 1); }
inline int64_t w1_in(const at::Tensor& w1, bool t) { return w1.size(t ? 1 : 2); }

// The CPU backend applying the CUDA kernels' rules ($COMET_CPU_CUDA_RULES=1): it then rejects
// the dtypes the CUDA op rejects, so that code meant for GPUs (autograd's backward calls, the
// wrappers) is proven on the CPU never to hand the CUDA kernels a dtype they refuse.
bool cpu_cuda_rules();
// Whether layer0 sends a token once per destination rank (the default) or once per slot
// ($COMET_LAYER0_DEDUP=0: an internal switch, so tests can demand the same bits from both).
bool layer0_dedup_setting();

// $COMET_RASTER_GROUP: m-tiles per raster group of the GEMM tile orders (comet/tile_order.h) for
// every call instead of the automatic raster_group(n_gemm) (0 or unset). A knob for measuring the
// order's effect (1: plain m-major order); results never depend on it. -1 when it is not an
// integer >= 0 (Checker::launch refuses the call then).
int64_t raster_group_setting();

// The tile shapes the CUDA kernels are compiled for (csrc/cuda/launch.h kTileMs x kTileN):
// kCudaTileM rows, or kCudaSmallTileM for few rows per expert (the tuner's small-batch tile); the
// CPU backend takes any tile (one larger than the problem covers it whole).
inline constexpr int64_t kCudaTileM = 128, kCudaSmallTileM = 64, kCudaTileN = 128;
// The most blocks one grid of the CPU backend holds (each block a team of OS threads), the
// analog of a GPU's co-resident blocks: n_comm must leave at least one of them to the GEMM.
inline constexpr int64_t kMaxCpuGrid = 1024;

struct LaunchShape {
  int64_t n_comm, n_gemm, tile_m, tile_n;
  int64_t band_n = 1;  // layer1: n-tiles per column band (tile_order.h), 0 = all
  int64_t sm_margin = 0;  // the call's SM margin after resolving -1 to the buffer's
};

// Validates one call's inputs for a backend: every tensor on `device`; dtypes the backend runs
// (CPU: float32/bfloat16/float16/float64; CUDA: bfloat16/float16); tensor *values* (expert ids,
// the layout's row count) only when read_values, since reading a CUDA tensor on the host would
// synchronise (the CUDA prologue checks them on the device). The first failure is kept.
class Checker {
 public:
  Checker(const char* op, at::Device device, bool read_values)
      : op_(op), device_(device), read_values_(read_values),
        cuda_rules_(device.is_cuda() || cpu_cuda_rules()) {}
  const CheckResult& result() const { return result_; }
  bool failed() const { return !result_.ok(); }
  bool reads_values() const { return read_values_; }
  bool value(bool cond, const std::string& msg) { return cond || fail(1, msg); }
  bool type(bool cond, const std::string& msg) { return cond || fail(2, msg); }

  // t on the call's device, `dim`-D and (unless contiguous is false: check it later with
  // contiguous(), after a shape check whose message says more) contiguous.
  bool tensor(const at::Tensor& t, const char* name, int64_t dim, bool contiguous = true);
  bool contiguous(const at::Tensor& t, const char* name);
  bool float_dtype(const at::Tensor& t, const char* name);
  // A GEMM operand's dtype (float_dtype's, or float8_e4m3fn) and, for FP8, its fp32 block scales
  // of `shape` (`form` spells it): finite and > 0 when values are read. A non-FP8 operand takes
  // no scale.
  bool operand_dtype(const at::Tensor& t, const char* name);
  bool fp8_scale(const std::optional<at::Tensor>& s, const char* name, const at::Tensor& q,
                 const char* qname, at::IntArrayRef shape, const std::string& form);
  // The operands' dtypes together: the same dtype, unless one is FP8 (or `fp8_wire`); then
  // out_dtype (if given) is a float dtype. A call without FP8 takes out_dtype only as the
  // activation's own dtype.
  bool precision(const at::Tensor& act, const char* act_name, const at::Tensor& w,
                 const char* w_name, bool w_transposed, bool fp8_wire,
                 std::optional<at::ScalarType> out_dtype);
  bool same_dtype(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name);
  bool int_dtype(const at::Tensor& t, const char* name, bool allow64);
  // num_experts against the group: tp_size divides W, EP = W / tp divides E, the weight holds
  // E / EP local experts (tp = 1: the expert-parallel rule).
  bool experts(int64_t num_experts, int64_t world, int64_t experts_local, const char* wname,
               int64_t tp = 1);
  // An optional bias [E_local, n] beside its GEMM's operand `like` (device, dtype, contiguity).
  bool bias(const std::optional<at::Tensor>& b, const char* name, int64_t experts_local, int64_t n,
            const at::Tensor& like, const char* like_name);
  bool max_rows(int64_t max_rows);
  bool routing(const at::Tensor& ids, int64_t tokens, int64_t num_experts);
  // The launch shape: n_comm, n_gemm, the tile (CUDA: the one compiled tile), band_n; on the CPU
  // backend also the grid (at most kMaxCpuGrid blocks).
  bool launch(const LaunchShape& l);
  // A fused grid of n_comm comm blocks and n_gemm GEMM blocks that holds at most `limit` blocks
  // (`limit_why` says whose limit): n_comm leaves at least one GEMM block and the grid fits.
  bool grid(int64_t n_comm, int64_t n_gemm, int64_t limit, const std::string& limit_why);

 private:
  bool fail(int32_t code, const std::string& msg);
  CheckResult result_;
  const char* op_;
  at::Device device_;
  bool read_values_;
  bool cuda_rules_;
};

// The checks of each op, in order; backends add their own (launch limits) after them.
bool check_layer0(Checker& c, const Layer0Inputs& in, int64_t world, const LaunchShape& launch);
bool check_layer1(Checker& c, const Layer1Inputs& in, int64_t world, const LaunchShape& launch);

// The activation a layer0 call named (None when it named none, or one check_layer0 refuses).
Activation layer0_activation(const std::optional<c10::string_view>& name);
inline std::optional<std::string> activation_arg(const std::optional<c10::string_view>& name) {
  return name ? std::optional<std::string>(std::string(*name)) : std::nullopt;
}

std::string dtype_name(at::ScalarType t);  // torch's Python spelling: float32, int64, ...
std::string shape_str(const at::Tensor& t);

ScalarKind scalar_kind(at::ScalarType t);

// What a rank announces for a call (symm_layout.h's CallMeta) from its shapes and its check result;
// dtype is a ScalarKind value (ignored, -1, when the check failed). Shared by both backends.
CallMeta make_call_meta(OpKind op, int32_t world, int64_t group_hash, int64_t num_experts,
                        int64_t topk, int64_t hidden, int64_t cols, int32_t dtype, int64_t tokens,
                        int64_t max_rows,
                        const CheckResult& check,  // for a dtype that passed the checks
                        int64_t tp = 1,
                        int32_t placement = 0);  // the heap's call tag (placement fingerprint)

}  // namespace comet
