"""The engine's counters as one flat dict (EngineCore.stats(): the offline API, /metrics and the
dashboard read it), gathered from the pool, the scheduler, the step and speculation stats and the
disk tier."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.engine.engine_core import EngineCore


def engine_stats(core: EngineCore) -> dict[str, int | float | str]:
    """EngineCore.stats(): the pool, the queue, the prefix cache, steps, speculation, the disk tier."""
    total = core.pool.num_pages
    free = core.pool.num_free
    cached = core.scheduler.num_cached_pages
    queries = core.scheduler.prefix_query_tokens
    hits = core.scheduler.prefix_hit_tokens
    return {
        "kv_pages_total": total,
        "kv_pages_free": free,  # in the pool; cached pages are not counted here
        "kv_pages_in_use": total - free - cached,  # held by running requests (not by the tree)
        "kv_pages_cached": cached,  # owned by the prefix tree, evictable unless a request locks them
        "kv_page_size": core.pool.page_size,
        # fp32, bf16 or int8 (model/kv_cache_format.py); the bytes count K and V of all layers
        # (this rank's heads under tensor parallelism). A test's fake runner has neither.
        "kv_cache_dtype": getattr(getattr(core.runner, "kv_format", None), "name", ""),
        "kv_cache_bytes_per_token": getattr(core.runner, "kv_bytes_per_token", 0),
        "num_requests_running": len(core.scheduler.running),
        "num_requests_waiting": len(core.scheduler.waiting),
        "num_preemptions": core.scheduler.num_preemptions,
        "num_steps": core.num_steps,
        "prompt_tokens_total": core.prompt_tokens_total,
        "generation_tokens_total": core.generation_tokens_total,
        "prompt_tokens_computed_total": core.prompt_tokens_computed_total,
        "pooling_requests_total": core.pooling_requests_total,
        "prefix_cache_queries_tokens_total": queries,
        "prefix_cache_hit_tokens_total": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        **core.step_stats.as_dict(core.scheduler),  # kv_pages_evicted, preempted, step composition
        **core.spec_stats.as_dict(),
        **(core.scheduler.offload.stats() if core.scheduler.offload is not None else {}),
        **kv_group_stats(core),
    }


def kv_group_stats(core: EngineCore) -> dict[str, int]:
    """Pages per KV group (kvcache/kv_groups.py): `kv_groups`, and for each group g its layers, its
    window (0: full attention), the pages running requests hold privately and the pages the prefix
    tree holds. One group (a model without sliding layers): its totals are the kv_pages_* above."""
    layout = core.scheduler.layout
    if layout is None or not layout.is_hybrid:
        return {"kv_groups": 1}
    in_use = core.scheduler.pages_in_use_by_group()
    cache = core.scheduler.cache
    window_cached = cache.window_pages_held() if cache is not None else [0] * layout.num_window_groups
    cached = [core.scheduler.num_cached_pages - sum(window_cached), *window_cached]
    out = {"kv_groups": len(layout.groups)}
    for g, group in enumerate(layout.groups):
        out[f"kv_group_{g}_layers"] = len(group.layers)
        out[f"kv_group_{g}_window"] = group.window or 0
        out[f"kv_group_{g}_pages_in_use"] = in_use[g]
        out[f"kv_group_{g}_pages_cached"] = cached[g]
    return out


def kv_groups_list(stats: dict) -> list[dict]:
    """kv_group_stats' flat keys as one dict per group (SchedulerStats.kv_groups); [] for one group."""
    count = int(stats.get("kv_groups", 1))
    if count < 2:
        return []
    fields = ("layers", "window", "pages_in_use", "pages_cached")
    return [{"group": g, **{f: int(stats[f"kv_group_{g}_{f}"]) for f in fields}} for g in range(count)]
