// The argument checks of the entry points (checks.h says what each one checks).
#include "checks.h"

namespace attnkit::band {

std::string dtype_name(at::ScalarType t) {
  return t == at::kFloat      ? "float32"
         : t == at::kDouble   ? "float64"
         : t == at::kLong     ? "int64"
         : t == at::kBFloat16 ? "bfloat16"
         : t == at::kHalf     ? "float16"
                              : c10::toString(t);
}

std::string described(const Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  return c10::str(dtype_name(t.scalar_type()), " ", t.sizes(), t.layout() == at::kStrided ? "" : " (not strided)",
                  " on ", t.device());
}

void check_tensor(const Tensor& t, const char* name, at::ScalarType dtype, int64_t dims, const char* shape) {
  TORCH_CHECK(t.defined() && t.layout() == at::kStrided && t.device().is_cpu() && t.scalar_type() == dtype &&
                  t.dim() == dims,
              "band kernel: ", name, " must be a dense ", dtype_name(dtype), " CPU tensor ", shape, ", got ",
              described(t));
}

void check_blas_rows(const Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1 && t.stride(-2) >= t.size(-1) && t.stride(-2) <= MAX_INT, "band kernel: ", name,
              " must have unit stride along its last dim and rows at least a row apart (as .contiguous() makes "
              "it), got strides ",
              t.strides(), " for sizes ", t.sizes());
}

void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, bool half) {
  TORCH_CHECK(q.defined() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble || (half && is_half(q))),
              "band kernel: q must be float32 or float64", half ? " (or bfloat16, float16)" : "", ", got ",
              described(q));
  const auto dtype = q.scalar_type();
  check_tensor(q, "q", dtype, 4, "[B, H, Lq, E]");
  check_tensor(k, "k", dtype, 4, "[B, Hkv, Lk, E] in q's dtype");
  check_tensor(v, "v", dtype, 4, "[B, Hkv, Lk, Ev] in q's dtype");
  const Index B = q.size(0), H = q.size(1), E = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == E, "band kernel: k must be [B, Hkv, Lk, E] with q's B = ", B,
              " and E = ", E, ", got ", k.sizes());
  TORCH_CHECK(Hkv > 0 ? H % Hkv == 0 : H == 0, "band kernel: q's heads (H = ", H,
              ") must be a multiple of k's heads (Hkv = ", Hkv, ")");
  TORCH_CHECK(v.size(0) == B && v.size(1) == Hkv && v.size(2) == S,
              "band kernel: v must be [B, Hkv, Lk, Ev] with q's B = ", B, " and k's Hkv = ", Hkv, " and Lk = ", S,
              ", got ", v.sizes());
  TORCH_CHECK(q.size(2) <= MAX_INT && S <= MAX_INT && E <= MAX_INT && v.size(3) <= MAX_INT,
              "band kernel: lengths and head sizes must be below 2^31 (the BLAS's int), got q ", q.sizes(), ", v ",
              v.sizes());
}

void check_intervals(const Tensor& q, const Tensor& k, const Tensor& starts, const Tensor& ends) {
  const Index B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&starts, "starts"}, {&ends, "ends"}}) {
    check_tensor(*t, name, at::kLong, 3, "[P, L, K]");
    const Index P = t->size(0);
    TORCH_CHECK(t->is_contiguous() && (P == 1 || P == B || P == B * H) && t->size(1) == L && t->size(2) >= 1,
                "band kernel: ", name, " must be a contiguous [P, L, K], P 1, B or B*H (1, ", B, " or ", B * H,
                "), L q's length ", L, " and K >= 1, got ", t->sizes(), t->is_contiguous() ? "" : " (not contiguous)");
  }
  TORCH_CHECK(starts.sizes() == ends.sizes(), "band kernel: starts and ends must have one shape, got ",
              starts.sizes(), " and ", ends.sizes());
  const int64_t* s = starts.data_ptr<int64_t>();
  const int64_t* e = ends.data_ptr<int64_t>();
  const Index n = starts.numel(), K = starts.size(2);
  for (Index x = 0; x < n; ++x) {
    TORCH_CHECK(0 <= s[x] && s[x] <= e[x] && e[x] <= S, "band kernel: intervals must satisfy 0 <= start <= end <= S",
                " (k's length ", S, "), got (", s[x], ", ", e[x], ") at starts/ends[", x / (L * K), ", ", x / K % L,
                ", ", x % K, "]");
  }
}

void check_bias(const Tensor& q, const Tensor& k, const Tensor& bias) {
  check_tensor(bias, "bias", compute_type(q), 2,
               "[1 or H, Lq + Lk - 1] in q's dtype, float32 for half types ([0, 0] for none)");
  const Index H = q.size(1), D = q.size(2) + k.size(2) - 1;
  const bool none = bias.size(0) == 0 && bias.size(1) == 0;
  TORCH_CHECK(none || ((bias.size(0) == 1 || bias.size(0) == H) && bias.size(1) == D && bias.is_contiguous()),
              "band kernel: bias must be contiguous [1 or H = ", H, ", Lq + Lk - 1 = ", D, "] ([0, 0] for none), got ",
              bias.sizes(), bias.is_contiguous() ? "" : " (not contiguous)");
}

void check_numbers(const Tensor& q, double scale, double softcap, Index rows, const char* rows_name, Index chunk,
                   const char* chunk_name) {
  const auto finite = [&](double x) {
    return std::isfinite(x) && (compute_type(q) != at::kFloat || std::abs(x) <= std::numeric_limits<float>::max());
  };
  TORCH_CHECK(finite(scale), "band kernel: scale must be finite in q's dtype, got ", scale);
  TORCH_CHECK(finite(softcap) && softcap >= 0, "band kernel: softcap must be a finite float >= 0 (0: off), got ",
              softcap);
  for (const auto& [x, name] : {std::pair<Index, const char*>{rows, rows_name}, {chunk, chunk_name}}) {
    TORCH_CHECK(x >= 1 && x <= MAX_BLOCK, "band kernel: ", name, " must be between 1 and ", MAX_BLOCK, ", got ", x);
  }
}

bool has_blas() { return sgemm_ != nullptr && dgemm_ != nullptr; }

void check_blas() {
  TORCH_CHECK(has_blas(), "band kernel: this torch does not export the BLAS functions (sgemm_/dgemm_) it calls");
}

}  // namespace attnkit::band
