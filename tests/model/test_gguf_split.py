"""A model split over several GGUF files (llama.cpp's gguf-split naming, NAME-00001-of-0000N.gguf):
loading the first part reads every part's tensors, and parts that do not add up are named."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.engine.fake_runner import run_to_completion
from tests.tiny_models import make_tiny_model, write_tiny_gguf
from tokenmill.config import EngineConfig
from tokenmill.engine.factory import build_engine_core
from tokenmill.errors import ModelLoadError
from tokenmill.model.gguf_file import read_gguf
from tokenmill.model.gguf_loader import load_gguf
from tokenmill.sample.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("split")
    folder = make_tiny_model(tmp, "llama", tokenizer=False)
    whole = write_tiny_gguf(folder, tmp / "whole.gguf", quant="Q8_0")
    first = write_tiny_gguf(folder, tmp / "tiny.gguf", quant="Q8_0", split_max_tensors=5)
    return whole, first


def part(first, no: int):
    """Part `no` (from 1) of the split model whose first part is `first`."""
    count = int(first.name.split("-of-")[1].removesuffix(".gguf"))
    return first.with_name(f"tiny-{no:05d}-of-{count:05d}.gguf")


def greedy(path) -> list[int]:
    core = build_engine_core(EngineConfig(model=str(path), precision="exact", num_threads=1, kv_cache_tokens=128))
    core.add_request("0", [3, 17, 42, 5], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return run_to_completion(core)["0"]


def test_the_first_part_loads_every_parts_tensors(files):
    whole, first = files
    a, b = read_gguf(str(whole)), read_gguf(str(first))
    count = b.metadata["split.count"]
    assert count >= 3 and first.name == f"tiny-00001-of-{count:05d}.gguf" and part(first, count).is_file()
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    assert all(np.array_equal(x.data, y.data) and x.kind == y.kind for x, y in zip(a.tensors, b.tensors))
    assert greedy(first) == greedy(whole)


def test_parts_that_do_not_add_up_are_named(files, tmp_path):
    _, first = files
    count = int(read_gguf(str(first)).metadata["split.count"])
    with pytest.raises(ModelLoadError, match=rf"is part 2 of a model split in {count} files: load the first part "
                                             rf"\(.*{part(first, 1).name}\)"):
        load_gguf(str(part(first, 2)))
    # a part missing
    for no in range(1, count + 1):
        os.link(part(first, no), tmp_path / part(first, no).name)
    (tmp_path / part(first, 3).name).unlink()
    with pytest.raises(ModelLoadError, match=rf"part 3 of {count} of this split model is missing: .*{part(first, 3).name}"):
        load_gguf(str(tmp_path / first.name))
    # a first part renamed: the others cannot be found
    renamed = tmp_path / "model.gguf"
    os.link(first, renamed)
    with pytest.raises(ModelLoadError, match=f"its name is not NAME-0000N-of-{count:05d}.gguf"):
        load_gguf(str(renamed))
    # another part in the place of part 3
    os.link(part(first, 2), tmp_path / part(first, 3).name)
    with pytest.raises(ModelLoadError, match=f"is not part 3 of {count}"):
        load_gguf(str(tmp_path / first.name))
