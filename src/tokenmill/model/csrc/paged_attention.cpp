// The paged decode attention op (the kernel and its work planning: paged_attention.h).

#include "paged_attention.h"
#include "cascade_attention.h"

namespace {

using namespace tm_attention;
using tm_kv::cache_format;
using tm_kv::row_width;

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table_in, const at::Tensor& seq_lens_in,
                                  int64_t page_size, double scale, int64_t isa, int64_t window, double softcap,
                                  int64_t cascade_min_rows, int64_t cascade_min_prefix) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat, "q must be [nd, num_heads, head_dim] float32");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.dim() == 3, "k_cache/v_cache must be [kv_heads, slots, head_dim]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "k_cache and v_cache must have the same shape and strides");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must have the same dtype");
  const CacheFormat format = cache_format(k_cache.scalar_type());
  TORCH_CHECK(k_cache.stride(2) == 1, "the KV cache's last dimension must be contiguous");
  TORCH_CHECK(!q_in.is_cuda() && !k_cache.is_cuda(), "CPU tensors only");
  TORCH_CHECK(page_size > 0, "page_size must be positive");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  const int64_t nd = q_in.size(0), num_heads = q_in.size(1), hd = q_in.size(2);
  const int64_t kv_heads = k_cache.size(0), num_slots = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == row_width(format, hd), "head_dim of q and the KV cache's rows differ");
  TORCH_CHECK(kv_heads > 0 && num_heads % kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_table_in.dim() == 2 && block_table_in.size(0) == nd, "block_table must be [nd, max_pages]");
  TORCH_CHECK(seq_lens_in.dim() == 1 && seq_lens_in.size(0) == nd, "seq_lens must be [nd]");
  TORCH_CHECK(block_table_in.scalar_type() == at::kLong || block_table_in.scalar_type() == at::kInt,
              "block_table must be int64 or int32");
  TORCH_CHECK(seq_lens_in.scalar_type() == at::kLong || seq_lens_in.scalar_type() == at::kInt,
              "seq_lens must be int64 or int32");

  const at::Tensor q = q_in.contiguous();
  const at::Tensor table = block_table_in.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens_in.to(at::kLong).contiguous();
  const int64_t max_pages = table.size(1);
  const int64_t pool_pages = num_slots / page_size;
  const int64_t* table_ptr = table.data_ptr<int64_t>();
  const int64_t* lens_ptr = lens.data_ptr<int64_t>();
  const int64_t group = num_heads / kv_heads;
  const Isa chosen = selected_isa(isa);
  Plan plan = make_plan(table_ptr, lens_ptr, nd, max_pages, page_size, pool_pages, num_heads, kv_heads, hd,
                        chosen, at::get_num_threads(), window);
  const int64_t num_items = plan.num_items();
  std::vector<float> partial(static_cast<size_t>(plan.partial_size));

  at::Tensor out = at::empty({nd, num_heads, hd}, q.options());
  if (nd == 0 || num_heads == 0 || hd == 0) return out;

  Args a = make_args(plan, q.data_ptr<float>(), out.data_ptr<float>(), partial.data(), table_ptr, lens_ptr, max_pages,
                     page_size, num_heads, kv_heads, hd, static_cast<float>(scale), k_cache.stride(0),
                     k_cache.stride(1));
  a.window = window;
  a.softcap = static_cast<float>(softcap);
  a.k = k_cache.data_ptr();
  a.v = v_cache.data_ptr();

  const RangeFn fn = pick(chosen, format);
#if TM_AMX_COMPILES
  // Rows over a shared prefix (cascade_attention.h), not under a window or soft-capping: the prefix on
  // the tiles around the items below. The buffers stay with the calling thread between calls (one a
  // layer, 30 a step).
  thread_local tm_cascade::Work cw;
  const tm_cascade::Plan cp =
      window == 0 && softcap == 0
          ? tm_cascade::plan(plan, table_ptr, lens_ptr, nd, max_pages, page_size, format, hd, cascade_min_rows,
                             cascade_min_prefix)
          : tm_cascade::Plan{};
  tm_flash::Problem pr[tm_cascade::kMaxGroups];
  if (cp.on()) {
    cw.prepare(cp, nd, num_heads, kv_heads, hd, format, page_size, 1, at::get_num_threads());
    tm_cascade::begin_call(cp, cw, a, format, pr);
  }
#endif
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(plan.scores_size));
    std::vector<float> acc(static_cast<size_t>(group * hd));
    fn(a, begin, end, scores.data(), acc.data());
  });
#if TM_AMX_COMPILES
  if (cp.on()) tm_cascade::finish_call(cp, cw, a, pr);
#endif
  merge_parts(plan, partial.data(), a.out, num_heads, group, hd);
  return out;
}

int64_t best_isa() { return static_cast<int64_t>(selected_isa(-1)); }

// The work items make_plan gives this table on `threads` threads, [items, kItemFields] (first row, rows,
// KV head, part, parts, partial offset): what a call would run, for tests and diagnostics.
at::Tensor decode_attention_items(const at::Tensor& block_table_in, const at::Tensor& seq_lens_in, int64_t page_size,
                                  int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t threads,
                                  int64_t window) {
  TORCH_CHECK(block_table_in.dim() == 2 && seq_lens_in.dim() == 1 && seq_lens_in.size(0) == block_table_in.size(0),
              "block_table must be [nd, max_pages] and seq_lens [nd]");
  TORCH_CHECK(page_size > 0 && kv_heads > 0 && num_heads % kv_heads == 0 && threads > 0, "bad attention layout");
  const at::Tensor table = block_table_in.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens_in.to(at::kLong).contiguous();
  const int64_t pool_pages = table.numel() > 0 ? table.max().item<int64_t>() + 1 : 1;
  const Plan plan = make_plan(table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), table.size(0), table.size(1),
                              page_size, pool_pages, num_heads, kv_heads, head_dim, selected_isa(-1), threads, window);
  at::Tensor items = at::empty({plan.num_items(), kItemFields}, table.options());
  std::copy(plan.items.begin(), plan.items.end(), items.data_ptr<int64_t>());
  return items;
}

}  // namespace

TORCH_LIBRARY(tokenmill_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
      "int page_size, float scale, int isa=-1, int window=0, float softcap=0.0, int cascade_min_rows=0, "
      "int cascade_min_prefix=0) -> Tensor",
      &paged_decode_attention);
  m.def("best_isa() -> int", &best_isa);
  m.def("decode_attention_items(Tensor block_table, Tensor seq_lens, int page_size, int num_heads, int kv_heads, "
        "int head_dim, int threads, int window=0) -> Tensor",
        &decode_attention_items);
}
