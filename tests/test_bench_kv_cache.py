"""`tokenmill bench kv-cache`: reachable from the bench table, times the kernel per dtype, and names a
bad dtype instead of raising."""

from __future__ import annotations

from tokenmill.entrypoints.cli import main
from tokenmill.model import cpu_attention_kernel


def test_unknown_dtype_is_a_usage_error(capsys):
    assert main(["bench", "kv-cache", "--dtypes", "bf16,int9"]) == 2
    assert "int9" in capsys.readouterr().err


def test_times_each_shape_per_dtype(capsys):
    argv = ["bench", "kv-cache", "--dtypes", "bf16,int8", "--rows", "2", "--context", "40", "--run-seqs", "1",
            "--repeats", "2", "--num-threads", "1"]
    if not cpu_attention_kernel.available():
        assert main(argv) == 1
        return
    assert main(argv) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(w[0], w[1]) for w in lines] == [("bf16", "decode"), ("bf16", "runs"), ("int8", "decode"), ("int8", "runs")]
    assert all(float(w[6]) > 0 for w in lines)  # the median, ms


def test_steps_over_a_shared_prefix_time_cascade_off_and_on(capsys):
    from tokenmill.model.kernels import decode_step, prompt_flash

    argv = ["bench", "kv-cache", "--steps", "--dtypes", "bf16", "--rows", "12", "--context", "300",
            "--shared-prefix", "260", "--repeats", "1", "--num-threads", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert "(256 of them shared)" in out[0]  # whole pages
    timed = [line.split() for line in out[1:]]
    if decode_step.available() and prompt_flash.available():  # the fused step, where the tiles run
        assert [w[:3] for w in timed] == [["bf16", "cascade", "off"], ["bf16", "cascade", "on"]]
    else:
        assert [w[0] for w in timed] == ["bf16"]
    assert all(float(line.split("[")[0].split()[-1]) > 0 for line in out[1:])  # each median, ms


def test_steps_under_several_prefixes_say_so(capsys):
    argv = ["bench", "kv-cache", "--steps", "--dtypes", "int8", "--rows", "4", "--context", "40",
            "--shared-prefix", "32", "--prompts", "2", "--repeats", "1", "--num-threads", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert "(32 of them shared under 2 prefixes)" in out[0]
    assert all(line.split()[0] == "int8" for line in out[1:])
