"""What the CPU path starts vLLM with: the preloads vLLM's CPU docs ask for, looked for where this machine keeps
them, and named once as optional where it has none."""

from __future__ import annotations

import logging
from pathlib import Path

from email_agent.backends import vllm_server


def test_the_preloads_are_found_where_this_machine_keeps_them_or_named_once_as_optional(tmp_path, monkeypatch,
                                                                                        caplog):
    """tcmalloc is looked for as the dynamic linker finds libraries on this machine (its architecture's multiarch
    directory, else `ldconfig -p`), and Intel OpenMP in vLLM's venv; a missing one is named once in the log, as
    optional, with how to install it (the Debian/Ubuntu package `libtcmalloc-minimal4`), and left out of
    LD_PRELOAD. intel-openmp has x86_64 wheels only: elsewhere its absence is not mentioned."""
    # the lookup, on this machine: glibc's own libraries are there; a library nobody has is not
    assert vllm_server.system_library("c") is not None
    assert vllm_server.system_library("no_such_library_anywhere") is None

    python = tmp_path / "venv" / "bin" / "python"
    monkeypatch.setattr(vllm_server, "_said", set())
    monkeypatch.setattr(vllm_server, "system_library", lambda name: None)
    monkeypatch.setattr(vllm_server.platform, "machine", lambda: "x86_64")
    caplog.set_level(logging.INFO, logger=vllm_server.__name__)
    for _ in range(2):
        assert "LD_PRELOAD" not in vllm_server.environment(python, {})
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 2, said  # each once, for two servers started
    assert "`apt-get install libtcmalloc-minimal4`" in said[0] and "optional" in said[0]
    assert "intel-openmp" in said[1] and "optional" in said[1] and str(python) in said[1]

    caplog.clear()
    monkeypatch.setattr(vllm_server, "_said", set())
    monkeypatch.setattr(vllm_server.platform, "machine", lambda: "aarch64")
    vllm_server.environment(python, {})
    assert [record.getMessage() for record in caplog.records] == [vllm_server.TCMALLOC_MISSING]

    (python.parent.parent / "lib").mkdir(parents=True)
    (python.parent.parent / "lib" / "libiomp5.so").touch()
    monkeypatch.setattr(vllm_server, "system_library", lambda name: f"/usr/lib/any-arch/lib{name}.so.4")
    assert vllm_server.environment(python, {})["LD_PRELOAD"] == \
        f"/usr/lib/any-arch/libtcmalloc_minimal.so.4:{python.parent.parent / 'lib' / 'libiomp5.so'}"
    assert vllm_server.environment(python, {"LD_PRELOAD": "mine.so"})["LD_PRELOAD"] == "mine.so"  # the caller's


def test_vllm_serves_in_bfloat16_only_where_the_cpu_has_it_in_hardware():
    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
    avx512_bf16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
    amx = "flags\t\t: fpu avx2 amx_bf16 amx_tile\n"
    assert [vllm_server.served_dtype({}, info) for info in (avx2, avx512_bf16, amx)] == [
        "float32", "bfloat16", "bfloat16"]
    assert vllm_server.served_dtype({"EMAIL_AGENT_CPU_DTYPE": "bfloat16"}, avx2) == "bfloat16"  # the override wins
    argv = vllm_server.command(Path("python"), "/m", "base:m", chat_template="t", port=1, lora_rank=0, max_loras=1,
                               max_model_len=512, max_num_seqs=1, seed=0)
    assert argv[argv.index("--dtype") + 1] == vllm_server.served_dtype()
