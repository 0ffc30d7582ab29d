"""Tensor parallelism end to end, ranks as local processes over loopback with one thread each:
greedy output in exact mode equals one rank's (tiny random models at TP=2), the bundled model's fast
mode at TP=3 keeps one rank's predictions, and no rank outlives the engine that started it. (The
bundled model at TP=3 in exact mode against transformers: tests/server/test_tensor_parallel_server.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import tokenmill
from tests.real_model import make_llm
from tests.test_fidelity import prompt_ids
from tests.tiny_models import make_tiny_model
from tokenmill.entrypoints.llm import LLM
from tokenmill.sample.sampling_params import SamplingParams

PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 6, "1, 2, 3,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[-1][0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


# qwen2: q/k/v biases split with their rows; qwen3: q/k norms per head and head_dim != hidden/heads,
# tied embeddings (the lm_head is the embedding's vocabulary slice). Both are the llama class with
# those additions; plain llama at TP=2 runs in the second-node and DP+TP tests below.
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_two_ranks_give_one_ranks_greedy_tokens(tmp_path, arch):
    folder = str(make_tiny_model(tmp_path, arch))
    # A small token budget: prompts in several chunks, chunks and decode rows in one step.
    args = dict(precision="exact", kv_cache_tokens=4096, max_num_batched_tokens=24)
    one = LLM(folder, num_threads=1, **args)
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY)]
    vectors = one.embed(PROMPTS)
    # qwen3's pool is sized in bytes: every rank works its pages out from its own heads, the same count.
    sized = dict(args, kv_cache_memory_bytes=1_500_000) if arch == "qwen3" else args
    with LLM(folder, num_threads=2, tensor_parallel_size=2, **sized) as two:
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY)] == expected
        if arch == "qwen3":
            stats = two.engine.stats()
            assert stats["kv_pages_total"] == 1_500_000 // (stats["kv_cache_bytes_per_token"] * 16) > 0
        # embedding steps too (rank 0 pools, every rank runs the same forward)
        for got, ref in zip(two.embed(PROMPTS), vectors):
            assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-5
        # The long prompt again: it takes all but its last token from the prefix cache, the part of
        # a page it continues copied on every rank (each holds its own heads of that page).
        again = two.generate(PROMPTS[1:2], GREEDY)[0]
        assert again.outputs[0].token_ids == expected[1]
        assert again.num_cached_tokens == len(again.prompt_token_ids) - 1 > 16
        assert again.num_cached_tokens % 16, "a prompt that needs no partial page tests nothing here"
        two.check_integrity()
        workers = [p.pid for p in two.engine.runner.workers]
    assert len(workers) == 1 and _gone(workers[0], 10), "rank 1 outlived shutdown()"


# How the engine's script ends: normally without shutdown() (the ranks are stopped at exit, so no rank
# warns), or abruptly (os._exit: as if the engine process died; its ranks warn, and never outlive it).
# The two scripts run side by side: each is mostly Python imports, which do not compete much.
def test_ranks_end_with_the_process_that_started_them(tmp_path):
    folder = str(make_tiny_model(tmp_path, "llama"))
    # The rank inherits stderr: its log lines are in the script's stderr (communicate() waits until it
    # closes too). The same tokenmill as this process imports (a checkout's src/ may come before an
    # installed copy).
    path = os.pathsep.join([os.path.dirname(os.path.dirname(tokenmill.__file__)), os.getcwd()])
    scripts = {}
    for name, ending in (("normal", ""), ("died", "os._exit(0)\n")):
        script = (
            "import os, sys\n"
            "from tokenmill.entrypoints.llm import LLM\n"
            "from tokenmill.sample.sampling_params import SamplingParams\n"
            f"llm = LLM({folder!r}, num_threads=2, tensor_parallel_size=2, kv_cache_tokens=1024)\n"
            "llm.generate(['hello'], SamplingParams(max_tokens=2))\n"
            "print(llm.engine.runner.workers[0].pid, flush=True)\n"
            f"{ending}"
        )
        scripts[name] = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": path})
    for name, proc in scripts.items():
        try:
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == 0, (name, stderr)
        assert _gone(int(stdout.split()[-1]), 10), f"a rank outlived its engine process ({name})"
        warnings = [line for line in stderr.splitlines() if "WARNING" in line]
        if name == "died":
            assert warnings and all("rank 1:" in line for line in warnings), stderr
        else:
            assert warnings == [], stderr


def test_a_second_node_lends_its_rank_from_the_command_line(tmp_path):
    # Two "machines" on loopback: this process is node 0 (rank 0 and the engine); `tokenmill serve
    # --node-rank 1` runs rank 1 and no server, and exits when node 0 stops the group.
    from tests.server.server_process import free_port, tokenmill_command

    folder = str(make_tiny_model(tmp_path, "llama"))
    port = free_port()
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port)]
    # Node 1's own pool size and precision would lay out other pages: it takes node 0's settings.
    node1 = subprocess.Popen([*tokenmill_command(), "serve", "--model", folder, "--kv-cache-tokens", "16",
                              "--num-threads", "1", "--node-rank", "1", *flags])
    try:
        one = LLM(folder, precision="exact", num_threads=1, kv_cache_tokens=1024)
        expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY)]
        with LLM(folder, precision="exact", num_threads=1, kv_cache_tokens=1024, tensor_parallel_size=2,
                 nnodes=2, master_port=port) as llm:
            assert llm.engine.runner.workers == []  # rank 1 is node 1's
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        assert node1.wait(timeout=30) == 0
    finally:
        node1.kill()


def test_data_and_tensor_parallel_together_serve_from_every_replica(tmp_path):
    import httpx

    from tests.server.server_process import ServerProcess
    from tests.server.test_tensor_parallel_server import tp_workers

    folder = str(make_tiny_model(tmp_path, "llama"))
    before = set(tp_workers())
    # Each replica's scheduler is rank 0 of its own TP group, on its own free port.
    srv = ServerProcess("--model", folder, "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                        "--num-threads", "4")
    try:
        srv.wait_ready()
        workers = [p for p in tp_workers() if p not in before]
        assert len(workers) == 2
        replicas, texts = set(), set()
        for _ in range(4):
            resp = httpx.post(f"{srv.url}/v1/completions", timeout=120,
                              json={"prompt": "hello world", "max_tokens": 8, "temperature": 0})
            assert resp.status_code == 200, resp.text
            replicas.add(resp.headers["x-tokenmill-replica"])
            texts.add(resp.json()["choices"][0]["text"])
        assert replicas == {"0", "1"} and len(texts) == 1  # round robin; both groups compute the same
    finally:
        srv.stop()
    assert all(_gone(p, 10) for p in workers), "a tensor-parallel rank outlived the server"


@pytest.mark.slow
def test_three_ranks_in_fast_mode_keep_the_quantized_models_predictions():
    # Fast mode: each rank runs the VNNI kernel on its packed slice of the Q4_1 weights. Row-parallel
    # slices start on quantization groups, so activations are rounded in the same groups as on one
    # rank; only the order of the final sums differs.
    from tokenmill.model.runner import SeqChunk

    ids = prompt_ids()[0] + prompt_ids()[-1]
    chunk = SeqChunk(ids, 0, list(range(-(-len(ids) // 16))), sample=False, all_logits=True)
    one = make_llm(num_threads=1, precision="fast").engine.runner.execute([chunk])  # the session's weights
    with LLM(num_threads=3, tensor_parallel_size=3) as llm:
        three = llm.engine.runner.execute([chunk])
    assert three.shape == one.shape == (len(ids), 49152)
    agree = (three.argmax(-1) == one.argmax(-1)).float().mean().item()
    assert agree >= 0.97, agree
    assert (three - one).abs().max().item() < 0.5
