"""`dynalm bench` end to end, as a user runs it: the real model, tiny runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from test_cli import assert_one_line_error, dynalm
from tiny_models import N_EXPERTS, N_EXPERTS_USED, SPECS, reference_model, write_gguf

TINY = ["-p", "16", "-n", "8", "-r", "1"]


def check_results(report: dict, engines: set[str]) -> None:
    assert {"model", "threads", "mode", "results"} <= report.keys()
    assert isinstance(report["threads"], int) and report["mode"] == "auto"
    got = {(r["engine"], r["test"]) for r in report["results"]}
    assert got == {(e, t) for e in engines for t in ("pp16", "tg8")}
    for r in report["results"]:
        assert r["tokens_per_s"] > 0 and r["sd"] >= 0 and r["runs"] == 1


def test_bench_json(smollm2_gguf: Path):
    result = dynalm("bench", str(smollm2_gguf), *TINY, "-t", "2", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["threads"] == 2
    check_results(report, {"dynalm"})
    memory = report["memory"]
    assert memory["file_bytes"] == smollm2_gguf.stat().st_size and memory["kv_bytes"] > 0
    assert memory["budget_bytes"] == int(memory["plan_bytes"] * 1.1)
    assert memory["plan_bytes"] > memory["file_bytes"] + memory["kv_bytes"]
    # SmolLM2's head is its tied embedding: a decode step reads (nearly) the whole file
    read = report["decode_bytes"]
    assert 0.9 * memory["file_bytes"] < read["file"] < memory["file_bytes"]
    assert 0.9 * read["file"] < read["dynalm"] < 1.3 * read["file"]
    # the memory roof the decode rate is read against, measured in the run (GB/s)
    assert 0.1 < report["stream_gbs"] < 10_000


def test_bench_table_and_profile(smollm2_gguf: Path):
    result = dynalm("bench", str(smollm2_gguf), *TINY)
    assert result.returncode == 0, result.stderr
    assert "| pp16 |" in result.stdout and "dynalm t/s" in result.stdout
    assert "dynalm peak RSS" in result.stdout and "budget" in result.stdout
    assert "decode streams weights per token: dynalm " in result.stdout
    assert "of the roof)" in result.stdout and "the host's streaming read" in result.stdout
    result = dynalm("bench", str(smollm2_gguf), *TINY, "--profile")
    assert result.returncode == 0, result.stderr
    for needle in ("matmul", "attention", "all kernels", "outside kernels", "compiled program"):
        assert needle in result.stdout
    assert "prefill step profile (pp16)" in result.stdout
    assert "decode step profile (tg8)" in result.stdout


def test_bench_vs_llama_cpp(smollm2_gguf: Path):
    result = dynalm("bench", str(smollm2_gguf), *TINY, "--vs", "llama.cpp", "--json")
    if importlib.util.find_spec("llama_cpp") is None:
        assert_one_line_error(result, "llama-cpp-python", "dynalm[bench]")
        return
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    check_results(report, {"dynalm", "llama.cpp"})
    # DynaLM's peak alone, read before llama.cpp maps its own copy of the file
    memory = report["memory"]
    assert memory["file_bytes"] < memory["peak_rss_bytes"] <= memory["budget_bytes"], memory


def test_bench_kv_cache_dtype(smollm2_gguf: Path):
    """``--kv-cache-dtype q8_0`` runs the engines on a q8_0 KV cache (llama.cpp, where
    installed, on its ``-ctk``/``-ctv q8_0`` with the flash attention that needs): fewer
    KV bytes than f16's, said in the report and in the table's header."""
    llama = importlib.util.find_spec("llama_cpp") is not None
    vs = ["--vs", "llama.cpp"] if llama else []
    # a context where q8_0's pages outweigh its 32 recent f16 rows a sequence
    run = [str(smollm2_gguf), "-p", "16,256", "-n", "8", "-r", "1", "--json"]
    f16 = json.loads(dynalm("bench", *run).stdout)
    result = dynalm("bench", *run, "--kv-cache-dtype", "q8_0", *vs)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (f16["kv_cache_dtype"], report["kv_cache_dtype"]) == ("f16", "q8_0")
    tests = {(r["engine"], r["test"]) for r in report["results"]}
    engines = ("dynalm", "llama.cpp") if llama else ("dynalm",)
    assert tests == {(e, t) for e in engines for t in ("pp16", "pp256", "tg8")}
    assert report["memory"]["kv_bytes"] < 0.9 * f16["memory"]["kv_bytes"]
    text = dynalm("bench", str(smollm2_gguf), *TINY, "--kv-cache-dtype", "q8_0").stdout
    assert "· KV q8_0 ·" in text


def test_bench_mixture_of_experts_reads_its_selected_experts(tmp_path: Path):
    """A decode step of one sequence routes each token to top_k distinct experts per layer:
    the expert matmuls' counters read exactly top_k / n_experts of every expert's bytes."""
    spec = SPECS["olmoe"]
    path = write_gguf(reference_model(spec), spec, tmp_path / "olmoe.gguf")
    result = dynalm("bench", str(path), *TINY, "--json")
    assert result.returncode == 0, result.stderr
    read = json.loads(result.stdout)["decode_bytes"]
    share = N_EXPERTS_USED / N_EXPERTS
    assert read["dynalm_experts"] == pytest.approx(share * read["dynalm_experts_all"], rel=1e-12)
    assert read["dynalm_experts"] > 0
    unselected = read["file_dense"] - read["file"]  # the experts a token does not select
    assert unselected == pytest.approx((1 - share) / share * read["file_experts"], abs=1)
    text = dynalm("bench", str(path), *TINY).stdout
    assert f"{N_EXPERTS_USED} of {N_EXPERTS} experts per layer" in text
    assert "100.0% of the 2 selected experts'" in text


def test_bench_bad_arguments(smollm2_gguf: Path):
    assert_one_line_error(dynalm("bench", str(smollm2_gguf), "-p", "x"), "-p")
    assert_one_line_error(dynalm("bench", str(smollm2_gguf), "--vs", "vllm"), "llama.cpp")
