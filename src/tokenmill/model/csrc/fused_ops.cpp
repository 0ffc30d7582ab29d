// The fused elementwise ops of the fast path (the row kernels: fused_ops.h).

#include "fused_ops.h"

namespace {

using namespace tm_fused;

// Rows per thread chunk: below this many rows everything runs on the calling thread.
constexpr int64_t kRowGrain = 16;

// float32 or bfloat16 rows, contiguous within a row.
bool check_rows(const at::Tensor& t, const char* name) {
  const bool bf16 = t.scalar_type() == at::kBFloat16;
  TORCH_CHECK(t.dim() == 2 && (bf16 || t.scalar_type() == at::kFloat) && t.stride(1) == 1, name,
              " must be a float32 or bfloat16 [rows, n] tensor with contiguous rows");
  return bf16;
}

const uint16_t* bf16_ptr(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
uint16_t* bf16_ptr(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// Calls fn(const In*) with the tensor's data as float or bf16 (uint16_t).
template <typename Fn>
void with_input(const at::Tensor& t, bool bf16, Fn&& fn) {
  if (bf16) fn(bf16_ptr(t));
  else fn(t.data_ptr<float>());
}

template <typename Fn>
void with_output(at::Tensor& t, bool bf16, Fn&& fn) {
  if (bf16) fn(bf16_ptr(t));
  else fn(t.data_ptr<float>());
}

// q [T, nq, d] (float32, or bf16 rounded from the same floats) and k [T, nkv, d] (float32) with RoPE;
// then, on the same thread, rows(src, k, t0, t1) for each range of tokens it roped (src: qkv's data).
template <typename Rows>
std::tuple<at::Tensor, at::Tensor> rope_heads(const at::Tensor& qkv, const at::Tensor& cos_in, const at::Tensor& sin_in,
                                              int64_t nq, int64_t nkv, bool q_bf16, Rows&& rows) {
  const bool bf16 = check_rows(qkv, "qkv");
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t T = qkv.size(0), d = cos.size(-1);
  TORCH_CHECK(d % 2 == 0 && cos.numel() == T * d && sin.numel() == T * d, "cos and sin must be [T, head_dim]");
  TORCH_CHECK(qkv.size(1) >= (nq + nkv) * d, "qkv has fewer columns than the q and k heads need");
  const auto options = qkv.options().dtype(at::kFloat);
  at::Tensor q = at::empty({T, nq, d}, options.dtype(q_bf16 ? at::kBFloat16 : at::kFloat));
  at::Tensor k = at::empty({T, nkv, d}, options);
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const int64_t stride = qkv.stride(0);
  const int isa = row_isa();
  with_input(qkv, bf16, [&](const auto* src) {
    with_output(q, q_bf16, [&](auto* qp) {
      at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
        if (isa == 2) rope_rows_avx512(src, stride, c, s, nq, nkv, d, qp, kp, t0, t1);
        else if (isa == 1) rope_rows_avx2(src, stride, c, s, nq, nkv, d, qp, kp, t0, t1);
        else rope_rows_base(src, stride, c, s, nq, nkv, d, qp, kp, t0, t1);
        rows(src, kp, t0, t1);
      });
    });
  });
  return {q, k};
}

std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                           int64_t nq, int64_t nkv) {
  return rope_heads(qkv, cos, sin, nq, nkv, false, [](const auto*, const float*, int64_t, int64_t) {});
}

// The caches' K / V rows of each token are written by the thread that roped it (a 512-token prompt's
// 3,072 rows on the calling thread alone took ~70 us a layer while the other thread slept).
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t nq, int64_t nkv,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots_in, bool q_bf16) {
  const int64_t T = qkv.size(0), d = cos.size(-1);
  const tm_kv::CacheFormat format = tm_kv::cache_format(k_cache.scalar_type());
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == nkv &&
                  k_cache.size(2) == tm_kv::row_width(format, d) && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [num_kv_heads, slots, row] of one format (fp32, bf16 or int8 rows)");
  TORCH_CHECK(qkv.size(1) >= (nq + 2 * nkv) * d, "qkv has fewer columns than q, k and v need");
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == T, "one slot per token");
  const int64_t num_slots = k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " is outside the cache");
  const bool wide = use_avx512();
  const int64_t stride = qkv.stride(0);
  void* kc = k_cache.data_ptr();
  void* vc = v_cache.data_ptr();
  auto store = [&](const auto* src, const float* kp, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < nkv; ++h) {
        const int64_t row = h * num_slots + sp[t];
        store_cache_row(wide, format, kp + (t * nkv + h) * d, kc, row, d);
        store_cache_row(wide, format, src + t * stride + (nq + nkv + h) * d, vc, row, d);
      }
    }
  };
  return std::get<0>(rope_heads(qkv, cos, sin, nq, nkv, q_bf16, store));
}

// silu(gate) * up, in the input's dtype.
at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  const at::Tensor gate_up = gate_up_in.contiguous();
  const bool bf16 = check_rows(gate_up, "gate_up");
  const int64_t T = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  at::Tensor out = at::empty({T, inter}, gate_up.options());
  const int isa = row_isa();
  with_input(gate_up, bf16, [&](const auto* src) {
    with_output(out, bf16, [&](auto* o) {
      at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
        if (isa == 2) silu_mul_rows_avx512(src, inter, o, t0, t1);
        else if (isa == 1) silu_mul_rows_avx2(src, inter, o, t0, t1);
        else silu_mul_rows_base(src, inter, o, t0, t1);
      });
    });
  });
  return out;
}

// out[rows[i]] += y[i] * w[i] for each row i of y (float32): a MoE expert's outputs weighted and added
// to its tokens' rows in one pass, as `out.index_add_(0, rows, y.mul_(w))` computes them (the product
// rounded, then the sum: never fused into one rounding). rows must be distinct (an expert's tokens).
void weighted_index_add_(at::Tensor& out, const at::Tensor& rows_in, const at::Tensor& y_in, const at::Tensor& w_in) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat, "out must be contiguous float32 [T, H]");
  const at::Tensor y = y_in.contiguous(), w = w_in.contiguous(), rows = rows_in.to(at::kLong).contiguous();
  const int64_t n = y.size(0), H = out.size(1), T = out.size(0);
  TORCH_CHECK(y.dim() == 2 && y.size(1) == H && y.scalar_type() == at::kFloat, "y must be float32 [n, H]");
  TORCH_CHECK(rows.numel() == n && w.numel() == n && w.scalar_type() == at::kFloat, "one row index and one weight per row of y");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(r[i] >= 0 && r[i] < T, "row ", r[i], " is outside out");
  const float* yp = y.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, kRowGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) weighted_add_row(op + r[i] * H, yp + i * H, wp[i], H);
  });
}

// own + (prefix - own) * share for attention outputs [1, H, L, D] (float32 or bf16, D contiguous, the
// same strides) and share [1, H, L] float32: a long chunk's attention over its cached prefix and over
// itself merged by the prefix's share of each query's softmax mass (model/prompt_attention.py), in one
// pass, each step rounded to float32 as the torch expression rounds it (no fused multiply-add); the
// result in float32 or, with bf16_out, rounded once to bf16.
at::Tensor merge_attention(const at::Tensor& own, const at::Tensor& prefix, const at::Tensor& share_in, bool bf16_out) {
  TORCH_CHECK(own.dim() == 4 && own.sizes() == prefix.sizes() && own.strides() == prefix.strides() &&
                  own.scalar_type() == prefix.scalar_type() && own.stride(3) == 1 && own.size(0) == 1,
              "own and prefix must be [1, H, L, D] of one dtype and layout, D contiguous");
  const bool bf16_in = own.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16_in || own.scalar_type() == at::kFloat, "own and prefix must be float32 or bfloat16");
  const int64_t H = own.size(1), L = own.size(2), D = own.size(3);
  const at::Tensor share = share_in.contiguous();
  TORCH_CHECK(share.numel() == H * L && share.scalar_type() == at::kFloat, "share must be float32 [1, H, L]");
  at::Tensor out = at::empty_strided(own.sizes(), own.strides(), own.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const int64_t sh = own.stride(1), sl = own.stride(2);
  const float* sp = share.data_ptr<float>();
  with_input(own, bf16_in, [&](const auto* o) {
    const auto* p = reinterpret_cast<decltype(o)>(prefix.data_ptr());
    with_output(out, bf16_out, [&](auto* r) {
      at::parallel_for(0, L, kRowGrain, [&](int64_t l0, int64_t l1) {
        for (int64_t l = l0; l < l1; ++l)
          for (int64_t h = 0; h < H; ++h) {
            const int64_t at = h * sh + l * sl;
            merge_row(o + at, p + at, sp[h * L + l], r + at, D);
          }
      });
    });
  });
  return out;
}

// int8 cache rows [..., n + 4] (kv_cache_format.py: a scale, then n codes) as bfloat16 values
// [..., n]: what `KVCacheFormat.stored_values(rows, torch.bfloat16)` computes in three passes (to
// float, times the scale, to bfloat16; bit for bit), and with `unrotate` the rows' H x rotated back
// to x on the way, by the kernels' butterflies (prompt_attention.py multiplied by H in fp32 instead).
at::Tensor int8_rows_values(const at::Tensor& rows_in, bool unrotate) {
  TORCH_CHECK(rows_in.scalar_type() == at::kChar && rows_in.dim() >= 1 && rows_in.size(-1) > tm_kv::kInt8ScaleBytes,
              "rows must be int8 cache rows [..., 4 + head_dim]");
  const at::Tensor rows = rows_in.contiguous();
  const int64_t width = rows.size(-1), n = width - tm_kv::kInt8ScaleBytes, count = rows.numel() / width;
  TORCH_CHECK(!unrotate || tm_kv::rotates(n), "rows of head_dim ", n, " are not rotated (kv_rotation.h)");
  std::vector<int64_t> sizes = rows.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, rows.options().dtype(at::kBFloat16));
  const int8_t* src = rows.data_ptr<int8_t>();
  uint16_t* dst = bf16_ptr(out);
  const bool wide = use_avx512();
  at::parallel_for(0, count, 256, [&](int64_t r0, int64_t r1) {
    std::vector<float> x(static_cast<size_t>(n));
    for (int64_t r = r0; r < r1; ++r) int8_row_values(wide, src + r * width, n, unrotate, x.data(), dst + r * n);
  });
  return out;
}

// x += delta (float32 or bfloat16); returns RMSNorm(x) * w, in bfloat16 when bf16_out.
at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta_in, const at::Tensor& w_in, double eps,
                         bool bf16_out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous float32 [T, hidden]");
  const at::Tensor delta = delta_in.contiguous(), w = w_in.contiguous();
  TORCH_CHECK(delta.sizes() == x.sizes(), "delta must match x");
  const bool bf16_in = check_rows(delta, "delta");
  const int64_t T = x.size(0), hidden = x.size(1);
  TORCH_CHECK(w.numel() == hidden && w.scalar_type() == at::kFloat, "weight must be float32 [hidden]");
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const int isa = row_isa();
  with_input(delta, bf16_in, [&](const auto* dp) {
    with_output(out, bf16_out, [&](auto* o) {
      at::parallel_for(0, T, kRowGrain, [&](int64_t t0, int64_t t1) {
        if (isa == 2) add_rms_norm_rows_avx512(xp, dp, wp, hidden, e, o, t0, t1);
        else if (isa == 1) add_rms_norm_rows_avx2(xp, dp, wp, hidden, e, o, t0, t1);
        else add_rms_norm_rows_base(xp, dp, wp, hidden, e, o, t0, t1);
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenmill_fused, m) {
  m.def("rope_qk(Tensor qkv, Tensor cos, Tensor sin, int nq, int nkv) -> (Tensor, Tensor)", &rope_qk);
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, int nq, int nkv, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots, bool q_bf16=False) -> Tensor", &rope_store);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("weighted_index_add_(Tensor(a!) out, Tensor rows, Tensor y, Tensor w) -> ()", &weighted_index_add_);
  m.def("merge_attention(Tensor own, Tensor prefix, Tensor share, bool bf16_out=False) -> Tensor", &merge_attention);
  m.def("int8_rows_values(Tensor rows, bool unrotate=False) -> Tensor", &int8_rows_values);
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor w, float eps, bool bf16_out=False) -> Tensor", &add_rms_norm_);
}
