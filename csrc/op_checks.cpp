#include "op_checks.h"

#include "comet/fp8_rows.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace comet {

bool cpu_cuda_rules() {
  const char* v = std::getenv("COMET_CPU_CUDA_RULES");
  return v && *v && std::strcmp(v, "0") != 0;
}

bool layer0_dedup_setting() {
  const char* v = std::getenv("COMET_LAYER0_DEDUP");
  return !(v && std::strcmp(v, "0") == 0);
}

int64_t raster_group_setting() {
  const char* v = std::getenv("COMET_RASTER_GROUP");
  if (!v || !*v) return 0;
  char* end = nullptr;
  const long long g = std::strtoll(v, &end, 10);
  return *end == '\0' && g >= 0 && g <= INT32_MAX ? int64_t(g) : -1;
}

std::string dtype_name(at::ScalarType t) { return std::string(c10::getDtypeNames(t).first); }

std::string shape_str(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

bool Checker::fail(int32_t code, const std::string& msg) {
  if (result_.ok()) result_ = CheckResult{code, std::string(op_) + ": " + msg};
  return false;
}

bool Checker::tensor(const at::Tensor& t, const char* name, int64_t dim, bool contiguous) {
  if (failed()) return false;
  if (!value(t.defined(), std::string(name) + " is undefined")) return false;
  const bool on_device = t.device().type() == device_.type() &&
                         (!device_.has_index() || t.device().index() == device_.index());
  if (!value(on_device, std::string(name) + " is on " + t.device().str() +
                            "; this call needs tensors on " + device_.str()))
    return false;
  if (!value(t.dim() == dim, std::string(name) + " must be " + std::to_string(dim) +
                                 "-D, got shape " + shape_str(t)))
    return false;
  return !contiguous || this->contiguous(t, name);
}

bool Checker::contiguous(const at::Tensor& t, const char* name) {
  if (failed()) return false;
  return value(t.is_contiguous(), std::string(name) + " with shape " + shape_str(t) +
                                      " must be contiguous (call .contiguous())");
}

// float64 only on the CPU backend (exact gradient checks); the CUDA kernels take bf16/fp16.
bool Checker::float_dtype(const at::Tensor& t, const char* name) {
  if (failed()) return false;
  const auto d = t.scalar_type();
  if (cuda_rules_)
    return type(d == at::kBFloat16 || d == at::kHalf,
                std::string(name) + " has dtype " + dtype_name(d) +
                    "; the CUDA kernels support bfloat16 and float16 (float32 and float64 run "
                    "on the CPU backend)" +
                    (device_.is_cuda() ? "" : " [COMET_CPU_CUDA_RULES is set]"));
  return type(d == at::kFloat || d == at::kBFloat16 || d == at::kHalf || d == at::kDouble,
              std::string(name) + " has dtype " + dtype_name(d) +
                  "; supported: float32, bfloat16, float16, float64");
}

bool Checker::operand_dtype(const at::Tensor& t, const char* name) {
  if (failed()) return false;
  const auto d = t.scalar_type();
  if (d == at::kFloat8_e4m3fn) return true;
  if (d == at::kFloat8_e5m2 || d == at::kFloat8_e4m3fnuz || d == at::kFloat8_e5m2fnuz)
    return type(false, std::string(name) + " has dtype " + dtype_name(d) +
                           "; comet's FP8 format is float8_e4m3fn with float32 block scales "
                           "(comet.fp8.quantize_rows / quantize_blocks)");
  return float_dtype(t, name);
}

bool Checker::fp8_scale(const std::optional<at::Tensor>& s, const char* name, const at::Tensor& q,
                        const char* qname, at::IntArrayRef shape, const std::string& form) {
  if (failed()) return false;
  const bool given = s.has_value() && s->defined();
  if (!is_fp8(q))
    return value(!given, std::string(name) + " is given but " + qname + " has dtype " +
                             dtype_name(q.scalar_type()) + ": scales go with float8_e4m3fn only");
  if (!value(given, std::string(qname) + " is float8_e4m3fn but " + name +
                        " is missing: pass its float32 scales " + form +
                        " (comet.fp8 makes both)"))
    return false;
  if (!(tensor(*s, name, int64_t(shape.size())) &&
        type(s->scalar_type() == at::kFloat, std::string(name) + " has dtype " +
                                                 dtype_name(s->scalar_type()) +
                                                 "; scales are float32") &&
        value(s->sizes() == shape, std::string(name) + " must be " + form + " = " +
                                       c10::str(shape) + ", got shape " + shape_str(*s))))
    return false;
  if (!read_values_ || s->numel() == 0) return true;
  const at::Tensor bad = s->isfinite().logical_not().logical_or(s->le(0)).flatten();
  const int64_t n = bad.any().item<bool>() ? bad.nonzero()[0][0].item<int64_t>() : -1;
  if (n < 0) return true;
  return value(false, std::string(name) + " holds " +
                          c10::str(s->flatten()[n].item<float>()) + " at flat index " +
                          std::to_string(n) + ": every scale must be finite and > 0");
}

bool Checker::precision(const at::Tensor& act, const char* act_name, const at::Tensor& w,
                        const char* w_name, bool w_transposed, bool fp8_wire,
                        std::optional<at::ScalarType> out_dtype) {
  if (failed()) return false;
  if (!(operand_dtype(act, act_name) && operand_dtype(w, w_name))) return false;
  const bool fp8 = is_fp8(act) || is_fp8(w) || fp8_wire;
  if (!fp8)
    return same_dtype(w, w_name, act, act_name) &&
           type(!out_dtype || *out_dtype == act.scalar_type(),
                "out_dtype=" + (out_dtype ? dtype_name(*out_dtype) : std::string()) +
                    " is for FP8 calls; this call's result has " + act_name + "'s dtype " +
                    dtype_name(act.scalar_type()));
  // The CUDA kernels' FP8 path (FP8 tensor cores: sm_89 mma.sync, sm_90a wgmma) takes FP8 on both
  // operands and writes bfloat16; mixed calls and other result dtypes run on the CPU backend. The
  // CPU backend under the CUDA rules refuses them alike.
  if (cuda_rules_) {
    const std::string rules = device_.is_cuda() ? "" : " [COMET_CPU_CUDA_RULES is set]";
    const bool act_fp8 = is_fp8(act) || fp8_wire;
    const std::string how_act = std::string(act_name) == "x"
                                    ? "pass dispatch_fp8=True or an FP8 x with x_scale"
                                    : "quantise it with comet.fp8.quantize_rows";
    if (!type(act_fp8, "the CUDA FP8 kernels take FP8 on both operands: " +
                           std::string(w_name) + " is float8_e4m3fn but " + act_name + " is " +
                           dtype_name(act.scalar_type()) + " (" + how_act +
                           "; mixed precision runs on the CPU backend)" + rules) ||
        !type(is_fp8(w), "the CUDA FP8 kernels take FP8 on both operands: " +
                             std::string(act_name) + " is FP8 but " + w_name + " is " +
                             dtype_name(w.scalar_type()) +
                             " (quantise it with comet.fp8.quantize_blocks; mixed precision runs "
                             "on the CPU backend)" + rules) ||
        !type(!out_dtype || *out_dtype == at::kBFloat16,
              "the CUDA FP8 kernels write bfloat16, got out_dtype=" +
                  (out_dtype ? dtype_name(*out_dtype) : std::string()) +
                  " (other result dtypes run on the CPU backend)" + rules))
      return false;
  }
  if (!value(!(is_fp8(w) && w_transposed),
             std::string(w_name) + " is float8_e4m3fn: FP8 weights are taken in their own "
                                   "layout only (no " + w_name + "_transposed)"))
    return false;
  if (!out_dtype) return true;
  const auto d = *out_dtype;
  return type(d == at::kFloat || d == at::kBFloat16 || d == at::kHalf || d == at::kDouble,
              "out_dtype=" + dtype_name(d) +
                  " is not a result dtype: supported float32, bfloat16, float16, float64");
}

bool Checker::same_dtype(const at::Tensor& t, const char* name, const at::Tensor& ref,
                         const char* ref_name) {
  if (failed()) return false;
  return type(t.scalar_type() == ref.scalar_type(),
              std::string(name) + " has dtype " + dtype_name(t.scalar_type()) + " but " + ref_name +
                  " has " + dtype_name(ref.scalar_type()) + "; they must match");
}

bool Checker::int_dtype(const at::Tensor& t, const char* name, bool allow64) {
  if (failed()) return false;
  const auto d = t.scalar_type();
  return type(d == at::kInt || (allow64 && d == at::kLong),
              std::string(name) + " has dtype " + dtype_name(d) + "; expected " +
                  (allow64 ? "int32 or int64" : "int32"));
}

bool Checker::experts(int64_t num_experts, int64_t world, int64_t experts_local,
                      const char* wname, int64_t tp) {
  if (failed()) return false;
  if (!value(tp >= 1, "tp_size must be >= 1 (1: no expert tensor parallelism), got " +
                         std::to_string(tp)))
    return false;
  if (!value(tp <= world && world % tp == 0,
             "tp_size=" + std::to_string(tp) + " does not divide the group size " +
                 std::to_string(world) + " (the group is TP-innermost: EP = W / tp_size)"))
    return false;
  const int64_t ep = world / tp;
  const std::string group = tp == 1 ? std::string("the expert-parallel group size ") +
                                          std::to_string(world)
                                    : "EP = group size " + std::to_string(world) +
                                          " / tp_size " + std::to_string(tp) + " = " +
                                          std::to_string(ep);
  return value(num_experts >= 1, "num_experts must be >= 1, got " + std::to_string(num_experts)) &&
         value(num_experts % ep == 0, "num_experts=" + std::to_string(num_experts) +
                                          " is not divisible by " + group) &&
         value(experts_local == num_experts / ep,
               std::string(wname) + " holds " + std::to_string(experts_local) +
                   " local experts but num_experts / " + (tp == 1 ? "group size" : "EP") + " = " +
                   std::to_string(num_experts / ep));
}

bool Checker::bias(const std::optional<at::Tensor>& b, const char* name, int64_t experts_local,
                   int64_t n, const at::Tensor& like, const char* like_name) {
  if (failed() || !b.has_value() || !b->defined()) return !failed();
  return tensor(*b, name, 2) && same_dtype(*b, name, like, like_name) &&
         value(b->size(0) == experts_local && b->size(1) == n,
               std::string(name) + " must be [E_local, " + std::to_string(n) + "] = [" +
                   std::to_string(experts_local) + ", " + std::to_string(n) + "], got shape " +
                   shape_str(*b));
}

bool Checker::max_rows(int64_t max_rows) {
  if (failed()) return false;
  return value(max_rows >= -1, "max_rows must be >= 0 (an upper bound on the dispatched rows) or "
                               "-1 (no bound), got " + std::to_string(max_rows));
}

bool Checker::routing(const at::Tensor& ids, int64_t tokens, int64_t num_experts) {
  if (failed()) return false;
  if (!(int_dtype(ids, "topk_ids", true) &&
        value(ids.size(0) == tokens, "topk_ids has " + std::to_string(ids.size(0)) +
                                         " rows but there are " + std::to_string(tokens) +
                                         " tokens") &&
        value(ids.size(1) >= 1, "topk_ids must have at least one column (topk >= 1)") &&
        value(ids.numel() < (int64_t(1) << 31), "topk_ids is too large for int32 row indices")))
    return false;
  if (!read_values_) return true;
  auto ids64 = ids.to(at::kLong);
  const int64_t* p = ids64.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids64.numel(); ++i)
    if (p[i] < -1 || p[i] >= num_experts)
      return value(false, "topk_ids[" + std::to_string(i / ids.size(1)) + ", " +
                              std::to_string(i % ids.size(1)) + "] = " + std::to_string(p[i]) +
                              " is not an expert id: valid ids are 0.." +
                              std::to_string(num_experts - 1) + " and -1 (dropped slot)");
  return true;
}

bool Checker::launch(const LaunchShape& l) {
  if (failed()) return false;
  const char* group = std::getenv("COMET_RASTER_GROUP");
  const std::string tile = std::to_string(l.tile_m) + "x" + std::to_string(l.tile_n);
  if (!(value(l.n_comm >= 0, "n_comm must be >= 0 (0: no comm blocks beside the GEMM, the layer "
                             "runs staged), got " + std::to_string(l.n_comm)) &&
        value(raster_group_setting() >= 0,
              std::string("$COMET_RASTER_GROUP must be an integer >= 0 (m-tiles per raster "
                          "group; 0 or unset: automatic), got '") + (group ? group : "") + "'") &&
        value(l.n_gemm >= 0, "n_gemm must be >= 0, got " + std::to_string(l.n_gemm)) &&
        value(l.tile_m >= 1 && l.tile_n >= 1, "tile shape must be positive, got " + tile) &&
        value(l.band_n >= 0 && l.band_n <= INT32_MAX,
              "band_n (n-tiles per column band of layer1; 0 = all) must be >= 0, got " +
                  std::to_string(l.band_n)) &&
        value(l.sm_margin >= 0 && l.sm_margin <= INT32_MAX,
              "sm_margin (SMs left free for other kernels; -1: the buffer's) must be >= 0, "
              "got " + std::to_string(l.sm_margin))))
    return false;
  // The CUDA kernels have two tile shapes (128 or 64 rows by 128 columns); their grid is checked
  // against the GPU's co-resident blocks when the call is planned.
  if (device_.is_cuda())
    return value((l.tile_m == kCudaTileM || l.tile_m == kCudaSmallTileM) && l.tile_n == kCudaTileN,
                 "the CUDA kernels are compiled for " + std::to_string(kCudaTileM) + "x" +
                     std::to_string(kCudaTileN) + " and " + std::to_string(kCudaSmallTileM) +
                     "x" + std::to_string(kCudaTileN) + " tiles, got tile=(" +
                     std::to_string(l.tile_m) + ", " + std::to_string(l.tile_n) + ")");
  // The CPU backend runs any tile its int32 launch fields hold; n_gemm = 0 runs one GEMM block.
  return value(l.tile_m <= INT32_MAX && l.tile_n <= INT32_MAX,
               "tile shape must be at most " + std::to_string(INT32_MAX) +
                   " in each dimension, got " + tile) &&
         grid(l.n_comm, std::max<int64_t>(l.n_gemm, 1), kMaxCpuGrid,
              "the CPU backend's limit: each block is a team of OS threads");
}

bool Checker::grid(int64_t n_comm, int64_t n_gemm, int64_t limit, const std::string& limit_why) {
  if (failed()) return false;
  const std::string at_most =
      "a grid of at most " + std::to_string(limit) + " blocks (" + limit_why + ")";
  if (!value(n_comm < limit, "n_comm=" + std::to_string(n_comm) + " leaves no GEMM block in " +
                                 at_most + ": n_comm must be at most " +
                                 std::to_string(limit - 1)))
    return false;
  return value(n_gemm <= limit - n_comm,
               "n_comm=" + std::to_string(n_comm) + " + n_gemm=" + std::to_string(n_gemm) +
                   " blocks are more than " + at_most + "; lower n_comm or n_gemm");
}

namespace {
// A fused activation's name, and for a gated form the even N0 its gate and up halves need.
bool check_activation(Checker& c, const std::optional<std::string>& name, int64_t n0, int64_t tp) {
  if (!name) return true;
  const int32_t a = activation_from_name(name->data(), name->size());
  if (!c.value(a > 0, "activation must be None, 'swiglu', 'geglu', 'silu' or 'gelu', got '" +
                          *name + "'"))
    return false;
  return c.value(!activation_gated(Activation(a)) || n0 % 2 == 0,
                 "activation='" + *name + "' pairs w0's gate and up halves ([gate; up]), so its " +
                     "N0 must be even, got N0 = " + std::to_string(n0) +
                     (tp > 1 ? " (this rank's shard of tp_size=" + std::to_string(tp) + ")"
                             : std::string()));
}
}  // namespace

Activation layer0_activation(const std::optional<c10::string_view>& name) {
  if (!name) return Activation::None;
  const int32_t a = activation_from_name(name->data(), name->size());
  return a > 0 ? Activation(a) : Activation::None;
}

bool check_layer0(Checker& c, const Layer0Inputs& in, int64_t world, const LaunchShape& launch) {
  const char* w0_form = in.w0_transposed ? "[E_local, H, N0] (w0_transposed)" : "[E_local, N0, H]";
  if (!(c.tensor(in.x, "x", 2) && c.tensor(in.w0, "w0", 3) &&
        c.precision(in.x, "x", in.w0, "w0", in.w0_transposed, in.dispatch_fp8, in.out_dtype)))
    return false;
  const int64_t H = in.x.size(1), N0 = w0_out(in.w0, in.w0_transposed);
  const bool fp8 = is_fp8(in.x) || is_fp8(in.w0) || in.dispatch_fp8;
  const at::Tensor out_like = at::empty({0}, in.x.options().dtype(
      result_dtype(in.x, in.w0, in.dispatch_fp8, in.out_dtype)));
  return c.value(w0_in(in.w0, in.w0_transposed) == H,
                 std::string("w0 must be ") + w0_form + " with H = " +
                     std::to_string(in.x.size(1)) + " (x's columns), got shape " +
                     shape_str(in.w0)) &&
         c.experts(in.num_experts, world, in.w0.size(0), "w0", in.tp) &&
         c.fp8_scale(in.x_scale, "x_scale", in.x, "x", {in.x.size(0), scale_blocks(H)},
                     "[T, ceil(H/128)]") &&
         c.fp8_scale(in.w0_scale, "w0_scale", in.w0, "w0",
                     {in.w0.size(0), scale_blocks(N0), scale_blocks(H)},
                     "[E_local, ceil(N0/128), ceil(H/128)]") &&
         c.bias(in.b0, "b0", in.w0.size(0), N0, fp8 ? out_like : in.x, fp8 ? "y0 (out_dtype)" : "x") &&
         check_activation(c, in.activation, N0, in.tp) &&
         c.value(!in.h_fp8 || in.activation.has_value(),
                 "h_fp8=True quantises the fused activation's h: pass activation= too") &&
         c.tensor(in.topk_ids, "topk_ids", 2) &&
         c.routing(in.topk_ids, in.x.size(0), in.num_experts) && c.max_rows(in.max_rows) &&
         c.launch(launch);
}

namespace {
// The layout's row count M against h: equal, or at most max_rows when h is padded to it.
bool rows_match(Checker& c, const Layer1Inputs& in) {
  const int64_t m = in.recv_counts.sum().item<int64_t>();
  if (in.max_rows >= 0)
    return c.value(m <= in.max_rows, "the layout dispatches " + std::to_string(m) +
                                         " rows to this rank, more than max_rows = " +
                                         std::to_string(in.max_rows));
  return c.value(m == in.h.size(0), "h has " + std::to_string(in.h.size(0)) +
                                        " rows but the layout dispatches " + std::to_string(m) +
                                        ": pass the layout moe_layer0 returned with this h");
}
}  // namespace

bool check_layer1(Checker& c, const Layer1Inputs& in, int64_t world, const LaunchShape& launch) {
  const char* w1_form = in.w1_transposed ? "[E_local, N1, H] (w1_transposed)" : "[E_local, H, N1]";
  if (!(c.tensor(in.h, "h", 2) && c.tensor(in.w1, "w1", 3) &&
        c.precision(in.h, "h", in.w1, "w1", in.w1_transposed, false, in.out_dtype)))
    return false;
  const int64_t N1 = in.h.size(1), H = w1_out(in.w1, in.w1_transposed);
  const bool fp8 = is_fp8(in.h) || is_fp8(in.w1);
  const at::ScalarType out_type = result_dtype(in.h, in.w1, false, in.out_dtype);
  const at::Tensor out_like = at::empty({0}, in.h.options().dtype(out_type));
  return c.value(w1_in(in.w1, in.w1_transposed) == in.h.size(1),
                 std::string("w1 must be ") + w1_form + " with N1 = " +
                     std::to_string(in.h.size(1)) + " (h's columns), got shape " +
                     shape_str(in.w1)) &&
         c.experts(in.num_experts, world, in.w1.size(0), "w1", in.tp) &&
         c.fp8_scale(in.h_scale, "h_scale", in.h, "h", {in.h.size(0), scale_blocks(N1)},
                     "[rows of h, ceil(N1/128)]") &&
         c.fp8_scale(in.w1_scale, "w1_scale", in.w1, "w1",
                     {in.w1.size(0), scale_blocks(H), scale_blocks(N1)},
                     "[E_local, ceil(H/128), ceil(N1/128)]") &&
         c.bias(in.b1, "b1", in.w1.size(0), H, fp8 ? out_like : in.h, fp8 ? "out (out_dtype)" : "h") &&
         c.max_rows(in.max_rows) &&
         c.tensor(in.topk_ids, "topk_ids", 2) &&
         c.routing(in.topk_ids, in.topk_ids.size(0), in.num_experts) &&
         // its shape before its contiguity: a transposed [k, T] weight says what is wrong
         c.tensor(in.topk_weights, "topk_weights", 2, /*contiguous=*/false) &&
         c.value(in.topk_weights.sizes() == in.topk_ids.sizes(),
                 "topk_weights has shape " + shape_str(in.topk_weights) + " but topk_ids has " +
                     shape_str(in.topk_ids)) &&
         c.contiguous(in.topk_weights, "topk_weights") &&
         c.type(in.topk_weights.scalar_type() == at::kFloat ||
                    in.topk_weights.scalar_type() == out_type,
                "topk_weights has dtype " + dtype_name(in.topk_weights.scalar_type()) +
                    "; expected float32 or " +
                    (fp8 ? "the result's dtype " + dtype_name(out_type) : "h's dtype")) &&
         c.tensor(in.send_pos, "layout.send_pos", 2) &&
         c.int_dtype(in.send_pos, "layout.send_pos", false) &&
         c.value(in.send_pos.sizes() == in.topk_ids.sizes(),
                 "layout.send_pos has shape " + shape_str(in.send_pos) + " but topk_ids has " +
                     shape_str(in.topk_ids) + ": the layout belongs to another call") &&
         c.tensor(in.recv_counts, "layout.recv_counts", 2) &&
         c.int_dtype(in.recv_counts, "layout.recv_counts", false) &&
         c.value(in.recv_counts.size(0) == world && in.recv_counts.size(1) == in.w1.size(0),
                 "layout.recv_counts has shape " + shape_str(in.recv_counts) + ", expected [" +
                     std::to_string(world) + ", " + std::to_string(in.w1.size(0)) + "]") &&
         (in.max_rows < 0 ||
          c.value(in.h.size(0) == in.max_rows,
                  "h has " + std::to_string(in.h.size(0)) + " rows but max_rows is " +
                      std::to_string(in.max_rows) +
                      ": with max_rows, h has max_rows rows (as layer0's y0)")) &&
         (!c.reads_values() || rows_match(c, in)) &&
         c.launch(launch);
}

ScalarKind scalar_kind(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ScalarKind::F32;
    case at::kBFloat16: return ScalarKind::BF16;
    case at::kDouble: return ScalarKind::F64;
    case at::kFloat8_e4m3fn: return ScalarKind::F8E4M3;
    default: return ScalarKind::F16;
  }
}

CallMeta make_call_meta(OpKind op, int32_t world, int64_t group_hash, int64_t num_experts,
                        int64_t topk, int64_t hidden, int64_t cols, int32_t dtype, int64_t tokens,
                        int64_t max_rows, const CheckResult& check, int64_t tp, int32_t placement) {
  CallMeta m{};
  m.tp = int32_t(tp);
  m.placement = placement;
  m.op = int32_t(op);
  m.world = world;
  m.group_hash = group_hash;
  m.num_experts = int32_t(num_experts);
  m.topk = int32_t(topk);
  m.hidden = int32_t(hidden);
  m.cols = int32_t(cols);
  m.dtype = check.ok() ? dtype : -1;
  m.tokens = tokens;
  m.max_rows = max_rows;
  m.routed_rows = -1;  // counted by the layer1 paths that can (ops_cpu.cpp, the CUDA begin kernel)
  m.layout_rows = -1;
  m.error = check.code;
  std::strncpy(m.message, check.message.c_str(), sizeof(m.message) - 1);
  return m;
}

}  // namespace comet
