"""`LLM(model)` keeps transformers out of its process (issues 23, 24): the tokenizer is built in the
export child, as for the server, and read with `tokenizers` alone (model/tokenizer_export.py `load`),
with the same ids as the in-process build. Checked in a fresh interpreter, since this one imported
transformers long ago; the export child's failure reaches the caller with its reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.tiny_models import make_tiny_model
from tokenmill.cache_root import cache_root
from tokenmill.errors import ModelLoadError
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.model import tokenizer_cache, tokenizer_export
from tokenmill.model.tokenizer_files import load_tokenizer_files

TEXTS = ["Hello world", "  tabs\tand\nnewlines\n\n naïve café 東京 🚀", "<|im_start|>user\nHi<|im_end|>"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"))


def test_llm_loads_its_tokenizer_without_transformers(tiny_folder, tmp_path, monkeypatch):
    # Its own tokenizer cache, the machine's compiled kernels. The entry the export child would keep
    # is put there first (built here, where transformers is loaded anyway): the child's seconds of
    # imports are the first run's cost, checked for the server in tests/server; here the load reads it.
    cache = tmp_path / "cache"
    cache.mkdir()
    os.symlink(cache_root() / "kernels", cache / "kernels")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(cache))
    monkeypatch.setenv("TOKENMILL_TOKENIZER_CACHE", "1")
    exported = str(tmp_path / "tokenizer.json")
    tokenizer_export.write(exported, load_tokenizer_files(tiny_folder))
    tokenizer_cache.store(tokenizer_cache.key(tiny_folder, tokenizer_export.FORMAT), exported)
    code = (
        "import json, subprocess, sys\n"
        "run, children = subprocess.run, []\n"  # an export child would show here: the cache serves
        "subprocess.run = lambda cmd, **kw: children.append(cmd) or run(cmd, **kw)\n"
        "from tokenmill import LLM\n"
        "from tokenmill.model.tokenizer_files import load_tokenizer_files\n"
        f"llm = LLM({tiny_folder!r}, num_threads=1, kv_cache_tokens=256)\n"
        "out = llm.generate('Hello', __import__('tokenmill').SamplingParams(max_tokens=2, temperature=0.0))\n"
        "print(json.dumps({\n"
        "    'transformers': sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'),\n"
        f"    'ids': [llm.tokenizer.encode(t, s) for t in {TEXTS!r} for s in (True, False)],\n"
        f"    'chat': llm.chat_prompt_ids({CHAT!r}),\n"
        "    'generated': len(out[0].outputs[0].token_ids),\n"
        "    'children': [c for c in children if 'tokenmill.model.tokenizer_export' in c],\n"
        # the grammar backend's load (engine_core) gets the handed-over tokenizer, not a second build
        f"    'shared': load_tokenizer_files({tiny_folder!r}).backend is llm.tokenizer.backend,\n"
        "}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["transformers"] == []
    reference = load_tokenizer_files(tiny_folder).backend  # built here, through transformers
    assert seen["ids"] == [reference.encode(t, add_special_tokens=s).ids for t in TEXTS for s in (True, False)]
    assert seen["chat"] == Tokenizer.from_files(load_tokenizer_files(tiny_folder)).apply_chat_template(CHAT)
    assert seen["generated"] == 2 and seen["shared"] is True and seen["children"] == []


def test_the_export_childs_failure_reaches_the_caller(tmp_path, monkeypatch):
    # As in a process without transformers: the child builds, and here it fails (before it would
    # import transformers, so this is quick).
    monkeypatch.delitem(sys.modules, "transformers")
    missing = str(tmp_path / "no-such-model.gguf")
    with pytest.raises(ModelLoadError, match="expected a .gguf file") as caught:
        tokenizer_export.load(missing)
    assert caught.value.path == missing


def test_a_sentencepiece_gguf_is_built_in_process_without_transformers(tmp_path):
    """Gemma's kind of vocabulary needs no transformers: built where it is loaded, no export child."""
    import gguf

    from tests.model.test_spm_vocab import llama_cpp_spm, made_up_vocab

    meta, tokens, scores, types = made_up_vocab()
    path = tmp_path / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    texts = ["abcde aab", "cd\n\nea<ctl> é中x"]
    code = (
        "import json, subprocess, sys\n"
        "run, children = subprocess.run, []\n"
        "subprocess.run = lambda cmd, **kw: children.append(cmd) or run(cmd, **kw)\n"
        "from tokenmill.model import tokenizer_export\n"
        f"files = tokenizer_export.load({str(path)!r})\n"
        "print(json.dumps({'heavy': sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'torch'}),\n"
        "                  'children': children, 'eos': sorted(files.eos_token_ids),\n"
        f"                  'ids': [files.backend.encode(t).ids for t in {texts!r}]}}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["heavy"] == [] and seen["children"] == [] and seen["eos"] == [2]
    assert seen["ids"] == [llama_cpp_spm(t, tokens, scores, types, add_space_prefix=True) for t in texts]
