"""A built model's tensors moved into one memory mapping backed by 2 MB pages (transparent huge pages).

Why: a decode step streams every weight once, and with 4 kB pages that is one TLB entry per 4 kB
read; in a virtual machine each miss walks two page tables (the guest's and the host's), and the
hardware prefetchers stop at every 4 kB boundary. Measured on a 2-core Xeon VM (docs/benchmarks.md,
"Weights on 2 MB pages"): a plain read loop over 512 MB went from 23.5 to 27.9 GB/s on 2 MB pages,
batch-1 decode +5-20 % by file (Q8_0 most), the 16-row step of a MoE file 35 -> 32 ms. Linux gives
anonymous memory 2 MB pages only where it is asked to (`enabled` = "madvise", the common default) or
everywhere ("always"); the kernels' weights are hundreds of allocations of 0.1-1 MB, so neither
torch's THP_MEM_ALLOC_ENABLE (allocations of 2 MB and up) nor glibc's hugetlb tunable covers them.

So once a model is built (builder.py), `move_to_huge_pages` gathers every tensor reachable from it
(attributes of tokenmill objects, lists, tuples, dicts; not objects whose class sets
`FILLED_ON_DEMAND`, whose tensors are allocated untouched and filled as they are used, like the RoPE
tables: a copy would make all of them resident), maps one anonymous region of their total
size with MADV_HUGEPAGE, copies each storage into it and points the tensors there with `set_`: the
tensor objects stay the same, so whatever already holds them (bound kernel calls) reads the new
memory, and each old storage is freed as soon as its tensors have moved (and handed back to the OS
every TRIM_EVERY_BYTES: the peak stays the model plus that). The values are the same bytes, so no
output changes. Nothing may depend on it: where the kernel has no transparent huge pages ("never",
not Linux), refuses the advice, or TOKENMILL_HUGE_PAGES=0, the tensors stay where they are.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.glibc_heap import malloc_trim

logger = logging.getLogger(__name__)

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
DISABLE_ENV = "TOKENMILL_HUGE_PAGES"
# A class attribute: True where an object's tensors are allocated untouched (torch.empty) and filled as
# they are used. The walk leaves such objects where they are: a copy touches every page.
FILLED_ON_DEMAND = "FILLED_ON_DEMAND"
# Each storage starts on a cache line (the kernels' aligned 64-byte loads; torch's own alignment).
_ALIGN = 64
# The storages left behind are freed heap that glibc keeps: handed back every this many bytes moved,
# so that the peak is the model plus this (not twice the model: a 558 MB MoE file peaked at 1,594
# MB without the trims, 1,134 with them, 1,069 with no move).
TRIM_EVERY_BYTES = 128 << 20


@dataclass(frozen=True)
class Moved:
    tensors: int  # tensor objects now pointing into the region
    storages: int  # distinct storages copied (views of one storage share its copy)
    nbytes: int  # the region's size


def thp_mode(path: str = THP_ENABLED) -> str:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"), "" where unknown."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return ""


def enabled() -> bool:
    """Whether `move_to_huge_pages` moves anything here."""
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def model_tensors(root: Any) -> Iterator[torch.Tensor]:
    """Every dense CPU tensor (no grad) reachable from `root` through tokenmill objects' attributes and
    lists, tuples and dicts, each once. Other objects (functions, torch modules, loggers) are not entered,
    nor tokenmill objects whose class sets FILLED_ON_DEMAND."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu" and obj.layout == torch.strided and not obj.requires_grad:
                yield obj
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif (type(obj).__module__ or "").startswith("tokenmill.") and not getattr(type(obj), FILLED_ON_DEMAND, False):
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            stack.extend(getattr(obj, name) for cls in type(obj).__mro__
                         for name in getattr(cls, "__slots__", ()) if hasattr(obj, name))


def move_to_huge_pages(root: Any) -> Moved | None:
    """Moves the tensors reachable from `root` (module docstring); None where nothing moved."""
    if not enabled():
        return None
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in model_tensors(root):
        # A view keeps its base tensor (`_base`), which would keep the old storage alive: moved too.
        for u in (t,) if t._base is None else (t, t._base):
            group = by_storage.setdefault(u.untyped_storage().data_ptr(), [])
            if u.untyped_storage().nbytes() and all(u is not v for v in group):
                group.append(u)
    by_storage = {ptr: ts for ptr, ts in by_storage.items() if ts}
    if not by_storage:
        return None
    sizes = {ptr: ts[0].untyped_storage().nbytes() for ptr, ts in by_storage.items()}
    total = sum(-(-n // _ALIGN) * _ALIGN for n in sizes.values())
    region = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:  # a kernel built without THP, or one that refuses it: nothing to gain
        logger.debug("MADV_HUGEPAGE refused (%s): the weights stay where they are", exc)
        region.close()
        return None
    malloc_trim()  # what building the model freed (its transient copies), before the region fills
    with torch.inference_mode():  # tensors made under it (a layer's tables) refuse `set_` outside
        _fill(region, by_storage, sizes)
    malloc_trim()
    moved = Moved(sum(len(ts) for ts in by_storage.values()), len(by_storage), total)
    logger.info("weights on 2 MB pages: %d tensors, %.1f MB (TOKENMILL_HUGE_PAGES=0: left on 4 kB pages)",
                moved.tensors, total / 1e6)
    return moved


def _fill(region: mmap.mmap, by_storage: dict[int, list[torch.Tensor]], sizes: dict[int, int]) -> None:
    """Each storage copied into `region` in turn, its tensors pointed at the copy."""
    offset = untrimmed = 0
    for ptr, tensors in by_storage.items():
        n = sizes[ptr]
        # A storage of its own over bytes offset..offset+n of the region (it keeps the region alive).
        new = torch.frombuffer(region, dtype=torch.uint8, count=n, offset=offset).untyped_storage()
        new.copy_(tensors[0].untyped_storage())
        for t in tensors:
            t.set_(new, t.storage_offset(), t.size(), t.stride())
        offset += -(-n // _ALIGN) * _ALIGN
        untrimmed += n
        if untrimmed >= TRIM_EVERY_BYTES:  # the storages moved so far are free now
            malloc_trim()
            untrimmed = 0
