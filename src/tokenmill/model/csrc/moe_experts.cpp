// A MoE block's routed experts over a step of many rows (prompt steps), each expert on one thread.
//
// Why: op by op (model/moe.py) each active expert is a gather, the gate_up linear, SiLU(gate) * up,
// the down linear and a weighted add into its tokens' rows, every one a parallel region over the
// expert's ~100-300 rows: 7 forks and joins an expert, 224 a layer of 32 experts, with threads that
// sleep between them (GOMP_SPINCOUNT), and every thread reading all of an expert's rows from the
// other core's cache. Here the experts are dealt out to the threads instead (the largest first, each
// to the thread with the least work so far), and each thread runs its experts whole, its rows staying
// in its own cache: one parallel region for the experts and one for adding their outputs up.
//
// The numbers are the op-by-op fast path's bit for bit: the same rows through the same kernel
// (quant_multiply.h, which gives each row the same bits however the rows are split), the same SiLU
// (fused_ops.h), and each token's weighted outputs added to zero in ascending expert order, each
// product rounded before the sum, as `weighted_index_add_` adds them expert after expert.

#include "fused_ops.h"
#include "quant_multiply.h"

#include <ATen/ops/zeros.h>

#include <algorithm>
#include <numeric>
#include <vector>

namespace {

using namespace tm_vnni;
using tm_fused::row_isa;
using tm_fused::weighted_add_row;

// The threads' experts: each expert (by its rows plus a fixed cost for reading its weights) to the
// thread with the least work so far, the largest first.
std::vector<std::vector<int64_t>> deal(const std::vector<int64_t>& rows, int team) {
  constexpr int64_t kWeightRows = 32;  // reading and decoding an expert's weights, in rows' worth of work
  std::vector<int64_t> order(rows.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return rows[a] > rows[b]; });
  std::vector<std::vector<int64_t>> mine(static_cast<size_t>(team));
  std::vector<int64_t> load(static_cast<size_t>(team), 0);
  for (const int64_t e : order) {
    const size_t t = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    mine[t].push_back(e);
    load[t] += rows[e] + kWeightRows;
  }
  return mine;
}

// out [T, H] = sum over each token's experts, in ascending expert order, of weight * expert(x[token]).
// tokens [n] and weights [n]: the step's (token, expert) assignments grouped by expert (ascending ids,
// tokens in order within one), counts[e] rows each for the E active experts whose gate_up and down
// weights (four tensors and a format and N each) are given in the same order.
at::Tensor moe_experts(const at::Tensor& x_in, const at::Tensor& tokens_in, const at::Tensor& weights_in,
                       at::IntArrayRef counts, at::TensorList gate_up, at::IntArrayRef gate_up_fmts,
                       at::IntArrayRef gate_up_Ns, at::TensorList down, at::IntArrayRef down_fmts,
                       at::IntArrayRef down_Ns) {
  const at::Tensor x = checked_x(x_in, 2);
  const at::Tensor tokens = tokens_in.to(at::kLong).contiguous(), weights = weights_in.contiguous();
  const int64_t T = x.size(0), H = x.size(1), E = static_cast<int64_t>(counts.size()), n = tokens.numel();
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.numel() == n, "one float32 weight per assignment");
  TORCH_CHECK(gate_up_fmts.size() == static_cast<size_t>(E) && down_fmts.size() == static_cast<size_t>(E),
              "a gate_up and a down weight per expert");
  const int64_t* tok = tokens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(tok[i] >= 0 && tok[i] < T, "token ", tok[i], " is outside x");
  std::vector<int64_t> start(static_cast<size_t>(E) + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(counts[e] > 0, "an active expert has at least one row");
    start[e + 1] = start[e] + counts[e];
  }
  TORCH_CHECK(start[E] == n, "the experts' rows must add up to the assignments");
  const Parts ups = parts_of(gate_up, gate_up_fmts, gate_up_Ns, H, check);
  std::vector<Weights> downs(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(gate_up_Ns[e] % 2 == 0, "gate_up must have an even number of columns");
    downs[e] = check(down[4 * e], down[4 * e + 1], down[4 * e + 2], down[4 * e + 3], down_fmts[e], down_Ns[e],
                     gate_up_Ns[e] / 2);
    TORCH_CHECK(down_Ns[e] == H, "down must give rows as wide as x");
  }

  // Each expert's outputs, unweighted, at its assignments' rows of ys [n, H].
  at::Tensor ys = at::empty({n, H}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = ys.data_ptr<float>();
  const int team = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), std::max<int64_t>(E, 1)));
  const std::vector<std::vector<int64_t>> mine = deal(std::vector<int64_t>(counts.begin(), counts.end()), team);
  const int isa = row_isa();
  at::parallel_for(0, team, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (const int64_t e : mine[static_cast<size_t>(t)]) {
        const int64_t rows = counts[e], ff = gate_up_Ns[e] / 2;
        at::Tensor xs = at::empty({rows, H}, x.options());
        float* xsp = xs.data_ptr<float>();
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(xsp + r * H, xp + tok[start[e] + r] * H, static_cast<size_t>(H) * sizeof(float));
        // nested in this region, the kernel's own parallel loops run on this thread
        const at::Tensor gu = multiply(xs, {ups.w[e]}, {0, gate_up_Ns[e] / kCols}, 2, true);
        at::Tensor act = at::empty({rows, ff}, x.options());
        const float* gup = gu.data_ptr<float>();
        float* ap = act.data_ptr<float>();
        if (isa == 2) tm_fused::silu_mul_rows_avx512(gup, ff, ap, 0, rows);
        else if (isa == 1) tm_fused::silu_mul_rows_avx2(gup, ff, ap, 0, rows);
        else tm_fused::silu_mul_rows_base(gup, ff, ap, 0, rows);
        const at::Tensor y = multiply(act, {downs[e]}, {0, H / kCols}, 2, true);
        std::memcpy(yp + start[e] * H, y.data_ptr<float>(), static_cast<size_t>(rows * H) * sizeof(float));
      }
    }
  });

  // Each token's assignments in ascending expert order (their grouped rows ascend with the expert).
  std::vector<int64_t> first(static_cast<size_t>(T) + 1, 0), slot(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ++first[tok[i] + 1];
  for (int64_t t = 0; t < T; ++t) first[t + 1] += first[t];
  std::vector<int64_t> fill(first.begin(), first.end() - 1);
  for (int64_t i = 0; i < n; ++i) slot[fill[tok[i]]++] = i;
  at::Tensor out = at::zeros({T, H}, x.options());
  float* op = out.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t j = first[t]; j < first[t + 1]; ++j) weighted_add_row(op + t * H, yp + slot[j] * H, wp[slot[j]], H);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenmill_moe, m) {
  m.def("experts(Tensor x, Tensor tokens, Tensor weights, int[] counts, Tensor[] gate_up, int[] gate_up_fmts, "
        "int[] gate_up_Ns, Tensor[] down, int[] down_fmts, int[] down_Ns) -> Tensor",
        &moe_experts);
}
