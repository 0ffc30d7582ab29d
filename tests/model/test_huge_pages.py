"""A built model's tensors moved onto 2 MB pages (model/huge_pages.py): the same values through every
holder (views, their bases, calls bound before the move), the mapping advised for huge pages, the
engine's outputs bit for bit those of the tensors left in place, and nothing moved when disabled."""

from __future__ import annotations

import mmap

import pytest
import torch

from tests.tiny_models import make_tiny_model, write_tiny_gguf
from tokenmill.config import EngineConfig
from tokenmill.engine.factory import build_engine_core
from tokenmill.model import huge_pages
from tokenmill.model.huge_pages import model_tensors, move_to_huge_pages, thp_mode
from tokenmill.model.runner import SeqChunk


class Holder:
    """Stands in for a model's objects: the walk enters tokenmill classes only."""


class Slotted:
    __slots__ = ("weight",)


class Foreign:
    """Not a tokenmill class: not entered."""


Holder.__module__ = Slotted.__module__ = "tokenmill.fake"


def mapping_of(address: int) -> tuple[int, int, list[str]]:
    """(start, end, VmFlags) of the mapping of this process that holds `address`."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = (lo, hi) if lo <= address < hi else None
            elif found and line.startswith("VmFlags:"):
                return found[0], found[1], line.split()[1:]
    raise LookupError(f"no mapping holds {address:#x}")


def advised_for_huge_pages(address: int) -> bool:
    """Whether the mapping holding `address` carries MADV_HUGEPAGE ("hg" in its VmFlags)."""
    return "hg" in mapping_of(address)[2]


@pytest.fixture
def thp(monkeypatch):
    """Moves on wherever the kernel can advise huge pages (whatever this machine's default mode)."""
    monkeypatch.delenv(huge_pages.DISABLE_ENV, raising=False)
    monkeypatch.setattr(huge_pages, "thp_mode", lambda path=huge_pages.THP_ENABLED: "madvise")
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE on this platform")


def test_thp_mode_reads_the_selected_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert thp_mode(str(f)) == "madvise"
    f.write_text("[always] madvise never\n")
    assert thp_mode(str(f)) == "always"
    assert thp_mode(str(tmp_path / "missing")) == ""


def test_walk_enters_tokenmill_objects_and_containers_once():
    shared = torch.ones(4)
    root = Holder()
    root.items = [shared, {"a": shared, "b": (torch.zeros(2),)}]
    root.slotted = Slotted()
    root.slotted.weight = torch.full((3,), 2.0)
    root.foreign = Foreign()
    root.foreign.t = torch.full((5,), 3.0)
    root.skipped = [torch.ones(6).to_sparse(), torch.ones(7, requires_grad=True)]  # not plain weights
    found = list(model_tensors(root))
    assert sorted(t.numel() for t in found) == [2, 3, 4]  # shared once; the foreign object's not entered


def test_walk_leaves_objects_filled_on_demand():
    class Lazy:
        FILLED_ON_DEMAND = True

    Lazy.__module__ = "tokenmill.fake"
    root = Holder()
    root.w = torch.ones(3)
    root.lazy = Lazy()
    root.lazy.table = torch.empty(1000)  # untouched: a copy would make it resident
    assert [t.numel() for t in model_tensors(root)] == [3]


def test_move_keeps_values_views_and_bound_calls(thp):
    base = torch.arange(4096, dtype=torch.float32)
    root = Holder()
    root.base, root.view, root.ints = base, base[100:200], base.view(torch.int32)[7:9]
    only_view = torch.arange(1000, dtype=torch.int16).reshape(10, 100)[2:5]  # its base is not in the graph
    with torch.inference_mode():  # a tensor made under inference mode refuses `set_` outside it
        scale = torch.randn(64, dtype=torch.float16)
    root.layers = [only_view, {"scale": scale}]
    expected = [t.clone() for t in (root.base, root.view, root.ints, only_view, scale)]
    bound = (lambda w: lambda: w.sum())(root.view)  # a call bound before the move holds the tensor object
    old = base.data_ptr()
    moved = move_to_huge_pages(root)
    if moved is None:
        pytest.skip("this kernel refused MADV_HUGEPAGE")
    # over `base`: itself, the slice, the int32 slice and its base (a dtype view is a base of its own);
    # the view and its base; the scale
    assert moved.storages == 3 and moved.tensors == 7
    assert base.data_ptr() != old and advised_for_huge_pages(base.data_ptr())
    assert mapping_of(only_view.data_ptr()) == mapping_of(base.data_ptr())  # one region
    for t, e in zip((root.base, root.view, root.ints, only_view, root.layers[1]["scale"]), expected):
        assert torch.equal(t, e)
    assert root.view.data_ptr() == base.data_ptr() + 400  # still a view of the same memory
    base[100] = -1.0
    assert root.view[0] == -1.0 and bound() == expected[1].sum() - 100.0 - 1.0
    assert only_view._base.data_ptr() == only_view.untyped_storage().data_ptr()  # its base moved with it


def test_disabled_moves_nothing(monkeypatch):
    monkeypatch.setenv(huge_pages.DISABLE_ENV, "0")
    root = Holder()
    root.w = torch.ones(8)
    ptr = root.w.data_ptr()
    assert move_to_huge_pages(root) is None and root.w.data_ptr() == ptr
    monkeypatch.delenv(huge_pages.DISABLE_ENV)
    monkeypatch.setattr(huge_pages, "thp_mode", lambda path=huge_pages.THP_ENABLED: "never")
    assert move_to_huge_pages(root) is None and root.w.data_ptr() == ptr


@pytest.fixture(scope="module")
def tiny_k_quant(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hp")
    folder = make_tiny_model(tmp, "llama", tokenizer=False, hidden_size=256, intermediate_size=512)
    return write_tiny_gguf(folder, tmp / "tiny.gguf", quant="Q4_K")


def steps(core, ids: list[int], decode: int) -> list[torch.Tensor]:
    """The prompt's logits, then `decode` greedy steps' (the fused decode step where it runs)."""
    pages = list(range(-(-(len(ids) + decode) // core.runner.page_size)))
    out = [core.runner.execute([SeqChunk(ids, 0, pages, sample=True, all_logits=True)])]
    for i in range(decode):
        nxt = int(out[-1][-1].argmax())
        out.append(core.runner.execute([SeqChunk([nxt], len(ids) + i, pages, sample=True)]))
        ids = ids + [nxt]
    return out


def test_engine_outputs_identical_on_huge_pages(tiny_k_quant, thp, monkeypatch):
    from tokenmill.model import builder

    results = []

    def recorded(root):
        results.append(move_to_huge_pages(root))
        return results[-1]

    monkeypatch.setattr(builder, "move_to_huge_pages", recorded)
    ids = [int(i) for i in torch.randint(100, 49152, (30,), generator=torch.Generator().manual_seed(3))]
    config = EngineConfig(model=str(tiny_k_quant), precision="fast", num_threads=2, kv_cache_tokens=256)
    moved = build_engine_core(config)
    if results[-1] is None:
        pytest.skip("this kernel refused MADV_HUGEPAGE")
    tensors = [t for t in model_tensors(moved.runner.model) if t.numel()]
    region = mapping_of(tensors[0].data_ptr())
    # every weight, norm and table of the model in the one region, advised for 2 MB pages
    assert len(tensors) > 20 and all(mapping_of(t.data_ptr()) == region for t in tensors)
    assert "hg" in region[2] and results[-1].nbytes <= region[1] - region[0]
    rope = moved.runner.model.rope  # filled as positions are reached: left where it was allocated
    assert all(mapping_of(t.data_ptr()) != region for t in (rope.cos, rope.sin))
    monkeypatch.setenv(huge_pages.DISABLE_ENV, "0")
    in_place = build_engine_core(config)
    assert results[-1] is None
    for a, b in zip(steps(moved, ids, 6), steps(in_place, ids, 6)):
        assert torch.equal(a, b)
