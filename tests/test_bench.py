"""`baton bench`: every suite runs with --quick, prints its table, and writes its JSON and plots.

Smoke tests only: figures are whatever this machine measured; no timing is asserted.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from baton.bench import SUITES, main
from baton.kvtransfer.nixl import nixl_installed


def run_suite(name: str, out: Path, capsys, *extra: str) -> tuple[dict, str]:
    status = main([name, "--quick", "--out", str(out), *extra])
    printed = capsys.readouterr().out
    assert status == 0, printed
    document = json.loads((out / f"{name}.json").read_text())
    assert document["suite"] == name and document["quick"] is True
    assert document["environment"]["torch_threads"] >= 1
    for plot in document.get("plots", []):
        assert Path(plot).is_file() and Path(plot).stat().st_size > 1000, plot
        assert Path(plot).parent == out
    return document, printed


def test_list_names_every_suite_with_a_description(capsys):
    assert main(["--list"]) == 0
    printed = capsys.readouterr().out
    for name in ("engine", "relay", "mixed", "prefix", "transfer", "roofline", "kernels"):
        assert name in SUITES
        assert any(line.startswith(name) and len(line) > len(name) + 10 for line in printed.splitlines())


def test_bad_invocations_say_what_to_do(tmp_path, capsys):
    assert main(["nonsense"]) == 2
    assert "choose one of" in capsys.readouterr().err
    assert main([]) == 2
    with pytest.raises(SystemExit, match="unknown engine"):
        main(["relay", "--quick", "--engines", "static,warp-drive", "--out", str(tmp_path)])


def test_python_dash_m_entry_point_lists_suites():
    out = subprocess.run([sys.executable, "-m", "baton.bench", "--list"], capture_output=True, text=True, check=True)
    assert "relay" in out.stdout and "roofline" in out.stdout


def test_kernels_suite_runs_or_says_why_not(tmp_path, capsys):
    document, printed = run_suite("kernels", tmp_path, capsys)
    if document.get("skipped"):
        assert "needs a CUDA GPU" in printed and document["plots"] == []
    else:
        assert document["plots"] and "geomean speedup" in printed


def test_isa_suite_times_each_build_and_finds_the_avx2_one_computes_the_native_bits(tmp_path, capsys):
    document, printed = run_suite("isa", tmp_path, capsys)
    if document.get("skipped"):
        assert "x86-64" in printed
        return
    builds = document["builds"]
    assert set(builds) == {"native", "x86-64-v3"}  # --full adds x86-64 (SSE2)
    for figures in builds.values():
        assert len(figures["ms"]) == 8 and all(ms > 0 for ms in figures["ms"].values())
        assert set(figures["mkl_gflops"]) == {"GEMM fp32 1 row", "GEMM fp32 8 rows", "GEMM fp32 64 rows"}
    assert builds["x86-64-v3"]["bits_as_native"]  # AVX2 with FMA: the same operations in the same order
    assert "bits as the native build's: native yes, x86-64-v3 yes" in printed


def test_structured_suite_validates_every_answer_and_times_the_mask(tmp_path, capsys):
    document, printed = run_suite("structured", tmp_path, capsys)
    baton = document["summary"]["baton"]
    assert baton["answers"] == 6 and baton["valid"] == 6, document["answers"]
    assert [m["rows"] for m in document["mask_cost"]] == [1, 4] and "guided" in printed
    assert all(m["in_series_ms"] < m["free_ms"] for m in document["mask_cost"])  # a sampler, not a step
    served = document["served_mask_cost"]["baton"]
    assert [m["rows"] for m in served] == [1, 4] and all(m["free_ms"] > 0 and m["guided_ms"] > 0 for m in served)


def test_hosts_suite_measures_one_host_against_three_or_says_why_not(tmp_path, capsys):
    document, printed = run_suite("hosts", tmp_path, capsys)
    if document.get("skipped"):
        assert "root" in printed or "namespaces" in printed
        return
    cells = document["cells"]
    assert [(c["setup"], c["gbit"]) for c in cells] == [
        ("one host, shared memory", None), ("three hosts, after prefill", 1),
        *([("three hosts, after prefill, NIXL", 1)] if nixl_installed() else []), ("three hosts, streamed", 1)]
    assert all(c["exact"] and 0 < c["first_s"] <= c["second_s"] for c in cells), cells
    assert [b["tokens"] for b in document["bound"]] == [600] and "second token at" in printed


def test_invariance_suite_runs_or_says_why_not(tmp_path, capsys):
    document, printed = run_suite("invariance", tmp_path, capsys)
    if document.get("skipped"):
        assert "needs a CUDA GPU" in printed
    else:
        assert document["modes"]["invariant"]["row_bits_equal"] and "prefill, 128 tokens" in printed


def test_gpu_suite_sets_each_figure_against_the_rates_it_measured(tmp_path, capsys):
    """Without CUDA the suite runs its measurements on this CPU with a small model (a check of the
    suite); on a GPU, the 8B and 1B shapes in both modes."""
    document, printed = run_suite("gpu", tmp_path, capsys)
    assert document["rates"]["copy_bytes_per_s"] > 0 and document["rates"]["matmul_flop_per_s"] > 0
    for shape in document["shapes"].values():
        measured = [d for d in shape["decode"] if "ms" in d]
        assert measured and all(d["floor_ms"] > 0 and d["of_floor"] > 0 for d in measured)
        modes = {p["mode"] for p in shape["prefill"]}
        assert "transformers" in modes and all(p["ms"] > 0 for p in shape["prefill"])
    assert {row["implementation"] for row in document["attention"]} >= {"torch SDPA"}
    assert "of floor" in printed and "TFLOP/s" in printed


def test_prefix_planner_figures_without_the_model(tmp_path, capsys):
    document, printed = run_suite("prefix", tmp_path, capsys, "--no-model")
    planner = document["planner"]
    assert "BatchLLM planner" in printed and "LRU prefix cache" in printed and "optimum" in printed
    assert 0 < planner["lru_saving"] < planner["planner_saving"] <= planner["optimum_saving"] < 1
    assert (tmp_path / "prefix_valleys.png").is_file()
    assert all(sizes for sizes in planner["token_batch_sizes"].values())


def test_json_flag_keeps_stdout_machine_readable(tmp_path, capsys):
    assert main(["prefix", "--quick", "--no-model", "--json", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["suite"] == "prefix"
    assert "BatchLLM planner" in captured.err


@pytest.mark.slow
def test_relay_quick_runs_all_four_engines_and_checks_tokens(tmp_path, capsys):
    document, printed = run_suite("relay", tmp_path, capsys)
    engines = {(r["engine"], r["batch_size"]) for r in document["runs"]}
    available = {"static", "local", "cluster"} | ({"continuous"} if "continuous" not in document["problems"] else set())
    assert engines == {(e, 4) for e in available}
    assert "identical greedy tokens: " in printed and "local/static" in printed
    assert {Path(p).name for p in document["plots"]} == {"relay_timeline.png", "relay_kv_bytes.png",
                                                         "relay_speedup.png"}
    assert document["exactness"]["per_engine"]["local"]["compared"] == 6
    samples = document["kv_samples_local"]["4"]
    assert samples and all(s["useful"] <= s["window"] <= s["allocated"] for s in samples)
    assert document["kv_memory_local"]["4"]["allocated_over_useful"] >= 1 and "allocated/useful" in printed


@pytest.mark.slow
def test_mixed_quick_has_all_three_query_shapes(tmp_path, capsys):
    document, printed = run_suite("mixed", tmp_path, capsys)
    kinds = [q["kind"] for q in document["queries"]]
    assert sorted(kinds) == ["long-short", "short-long", "short-short", "short-short"]
    assert "identical greedy tokens: " in printed and (tmp_path / "mixed_timeline.png").is_file()


@pytest.mark.slow
def test_prefix_quick_times_reuse_on_the_model(tmp_path, capsys):
    document, printed = run_suite("prefix", tmp_path, capsys)
    timed = document["timed"]
    assert timed["computed_tokens"] < timed["prompt_tokens"]
    assert "prefill only, planner's prefix reuse" in printed
    assert "cluster" in timed and ("with_planning_s" in timed["cluster"] or "not wired yet" in printed)
    shapes = document["shapes_end_to_end"]["results"]
    assert [s["shape"] for s in shapes] == ["400/40 x4", "shared documents 12x7"] and not document["problems"]
    for shape in shapes:  # what the workers measured reaches the multi-level optimum
        assert shape["measured_saving"] >= 0.995 * shape["optimum_saving"] and shape["generate_batch_s"] > 0
    assert "batch speedup" in printed


@pytest.mark.slow
def test_transfer_quick_compares_grpc_shared_memory_memcpy_and_prefill(tmp_path, capsys):
    document, printed = run_suite("transfer", tmp_path, capsys)
    assert [s["mib"] for s in document["sizes"]] == [1, 4]
    assert all(s["prompt_tokens"] == -(-s["bytes"] // document["kv_bytes_per_token"]) or s["capped_at_context"]
               for s in document["sizes"])
    assert all(s["shm_s"] > 0 and s["shm_share_of_prefill"] > 0 for s in document["sizes"])
    assert "gRPC % prefill" in printed and "shm % prefill" in printed and "goal < 5%" in printed
    served = document["served"]
    assert list(served) == ["one at a time", "all at once"] and all(m["responses"] == 4 for m in served.values())
    assert all(0 < m["transfer_s"] and 0 < m["share"] for m in served.values()) and "transfer / prefill" in printed


@pytest.mark.slow
def test_roofline_quick_reports_the_weight_read_floor(tmp_path, capsys):
    document, printed = run_suite("roofline", tmp_path, capsys)
    assert document["weight_bytes"] > 10 << 20 and document["bandwidth_bytes_per_s"] > 0  # tiny-random: 12 MiB
    assert "% of roofline" in printed and len(document["steps"]["engine_step_s"]) == 8


@pytest.mark.slow
def test_chunks_quick_times_a_long_prompt_whole_and_in_chunks(tmp_path, capsys):
    document, printed = run_suite("chunks", tmp_path, capsys)
    timed = [r for r in document["results"] if "budget" in r]
    assert [(r["budget"], r["chunks"]) for r in timed] == [(0, 1), (128, 3)]  # 300 tokens
    assert timed[0]["slowdown"] == 1.0 and timed[1]["longest_chunk_s"] < timed[1]["total_s"]
    assert all(r["first_tokens_agree"] for r in document["results"] if "first_tokens_agree" in r)
    assert "longest chunk ms" in printed


@pytest.mark.slow
def test_shared_quick_decodes_rows_of_one_prefix_with_and_without_sharing(tmp_path, capsys):
    document, printed = run_suite("shared", tmp_path, capsys, "--rows", "4", "--prefix", "128")
    # the first row holds the prefix's pages, the other three share them
    assert document["tokens_agree"] and document["with"]["rows_sharing"] == 3 and not document["without"]["rows_sharing"]
    # the useful KV falls by nearly what the shape allows (rows joining at different steps cost a little)
    assert 0.9 * document["bound_kv_ratio"] <= document["kv_useful_ratio"] <= document["bound_kv_ratio"]
    assert "with sharing" in printed


@pytest.mark.slow
def test_engine_quick_races_the_executors_and_reports_a_missing_vllm(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("BATON_VLLM_PYTHON", raising=False)
    document, printed = run_suite("engine", tmp_path, capsys)
    assert {(r["engine"], r["batch_size"]) for r in document["runs"]} == {
        ("local", 4), ("local-transformers", 4), ("static", 4)}
    assert document["problems"]["vllm"].startswith("unavailable: no vLLM venv")
    assert document["exactness"]["identical"], document["exactness"]["divergences"]
    assert "vLLM / Baton" in printed and "x floor" in printed
    measured = document["steps"]["measured"]
    assert {(m["executor"], m["rows"]) for m in measured} == {(e, n) for e in ("baton", "transformers") for n in (1, 4)}
    assert all(m["step_over_floor"] > 0 for m in measured)
    assert (tmp_path / "engine_wall.png").is_file()


@pytest.mark.slow
def test_fairness_quick_times_interactive_probes_idle_and_under_both_loads(tmp_path, capsys):
    document, printed = run_suite("fairness", tmp_path, capsys)
    probes = document["probes"]
    assert set(probes) == {"idle", "batch (low priority)", "same priority"}
    assert len(probes["idle"]["ttft_s"]) == 6 and all(t > 0 for t in probes["idle"]["ttft_s"])
    assert probes["batch (low priority)"]["load_wall_s"] > 0 and probes["same priority"]["load_wall_s"] > 0
    assert "p99 / idle" in printed
    # Each probe's stages come back, and the tail's split adds up to its mean TTFT.
    idle = probes["idle"]
    assert len(idle["stage_s"]) == 6 and all(st["prefill"] > 0 for st in idle["stage_s"])
    tail = idle["tail_stage_s"]
    from baton.bench.fairness import percentile
    slowest = [t for t in idle["ttft_s"] if t >= percentile(idle["ttft_s"], 0.9)]
    assert sum(tail.values()) == pytest.approx(sum(slowest) / len(slowest))
    assert "Where the slowest 10% of probes waited" in printed


@pytest.mark.slow
def test_route_quick_measures_prediction_precision_across_a_restart(tmp_path, capsys):
    document, printed = run_suite("route", tmp_path, capsys)
    runs = document["runs"]
    assert set(runs) == {"memory", "round-robin"}  # --quick; the full suite adds Redis and a bounded index
    for name, run in runs.items():
        assert run["restarted_at_s"] is not None and run["requests"] == 40
        assert run["failed"] == 0, (name, run["failures"])  # the restart's requests moved to the other worker
        assert 0 < run["reused_tokens"] <= document["optimum_saved_tokens"]
        assert run["route_s_p50"] > 0
    assert runs["memory"]["precision"] is not None
    assert document["routing_rate"]["memory"]["routes_per_s"] > 0 and "redis" not in document["routing_rate"]
    assert "precision" in printed and "routes/s" in printed


def test_serve_says_what_to_install_when_aiperf_is_missing(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("BATON_AIPERF", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no aiperf on it
    document, printed = run_suite("serve", tmp_path, capsys)
    assert document["problems"]["aiperf"].startswith("unavailable: no aiperf") and document["points"] == []


def test_serve_compares_baton_with_vllm_at_the_rates_both_ran():
    from baton.bench.serve import Point, compare

    def point(system, rate, ttft, goodput):
        return Point(system, "chat", rate, ttft, 2 * ttft, 50.0, 60.0, 30.0, rate, goodput, 16, 0)

    rows = compare([point("baton", 0.5, 100.0, 0.5), point("vllm", 0.5, 200.0, 0.25), point("baton", 2.0, 1.0, 1.0)])
    assert rows == [{"workload": "chat", "rate": 0.5, "ttft_p50": 0.5, "ttft_p99": 0.5, "itl_p50": 1.0,
                     "itl_p99": 1.0, "output_tokens_per_s": 1.0, "goodput": 2.0}]


@pytest.mark.slow
def test_residency_quick_counts_the_streams_baton_decodes_at_once(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("BATON_VLLM_PYTHON", raising=False)
    document, printed = run_suite("residency", tmp_path, capsys)
    settings = document["settings"]
    assert settings["servers"] == ["baton"] and document["problems"] == {}  # --quick: Baton alone
    baton = document["servers"]["baton"]
    assert len(baton["streams"]) == settings["streams"] == 4
    assert all(st["error"] is None and st["chunk_s"] for st in baton["streams"])
    assert baton["streams_with_a_token"] == 4 and baton["ttft_median_s"] > 0 and baton["tokens_per_s"] > 0
    assert len(baton["decoding_per_window"]) == 3
    assert 0 <= baton["decoding_at_sample"] <= baton["peak_decoding"] <= 4
    assert any("rows_in_use" in sample for sample in baton["server_samples"])  # what the decode worker said
    assert "decoding at 3 s" in printed and "Streams decoding in each second" in printed


def test_residency_skips_vllm_without_its_python(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("BATON_VLLM_PYTHON", raising=False)
    document, _ = run_suite("residency", tmp_path, capsys, "--servers", "vllm")
    assert document["problems"]["vllm"].startswith("skipped: no vLLM python") and document["servers"] == {}


def test_residency_counts_a_stream_decoding_by_its_tokens_after_the_first():
    from baton.bench.openai_servers import vllm_metrics
    from baton.bench.residency import summarize

    streams = [{"chunk_s": [0.5, 0.6, 1.5, 2.9], "finish_reason": None},  # decodes through the count
               {"chunk_s": [0.7], "finish_reason": None},  # its first token only: waiting for a row
               {"chunk_s": [2.5, 2.6], "finish_reason": None},  # admitted late
               {"chunk_s": [], "finish_reason": None}]
    got = summarize(streams, 3.0)
    assert got["decoding_per_window"] == [1, 1, 2] and got["receiving_per_window"] == [2, 1, 2]
    assert got["decoding_at_sample"] == 2 and got["peak_decoding"] == 2
    assert got["first_token_s"] == [0.5, 0.7, 2.5, None] and got["streams_with_a_token"] == 3
    assert got["chunks_per_stream"] == [4, 1, 2, 0] and got["tokens_per_s"] == pytest.approx(7 / 3)
    text = ('# HELP vllm:num_requests_running x\nvllm:num_requests_running{model_name="m",engine="0"} 5.0\n'
            'vllm:num_requests_waiting{model_name="m",engine="0"} 11.0\nvllm:kv_cache_usage_perc{engine="0"} 0.25\n')
    assert vllm_metrics(text) == {"running": 5.0, "waiting": 11.0, "kv_cache_usage": 0.25}


@pytest.mark.slow
def test_served_quick_streams_the_relay_set_at_each_concurrency(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("BATON_VLLM_PYTHON", raising=False)
    document, printed = run_suite("served", tmp_path, capsys)
    settings = document["settings"]
    assert (settings["concurrency"], settings["queries"], settings["max_tokens"]) == ([1, 4], 6, 24)
    assert document["problems"]["vllm"].startswith("skipped: no vLLM python") and set(document["servers"]) == {"baton"}
    # `baton up`'s default dtype, read back from the decode worker's model fingerprint
    dtype = document["dtype"]
    assert dtype["requested"] == "auto" and dtype["baton"] == dtype["resolved_here"] in ("bfloat16", "float32")
    baton = document["servers"]["baton"]
    assert [r["concurrency"] for r in baton["runs"]] == [1, 4] and document["rows"]["baton"] == 8
    for r in baton["runs"]:
        assert (r["requests"], r["errors"], r["tokens_counted_as"]) == (6, 0, "usage")
        assert r["wall_s"] > 0 and r["ttft_p50_s"] > 0 and r["tpot_p50_s"] > 0 and r["output_tokens_per_s"] > 0
        assert all(x["text"] and 1 <= x["tokens"] <= 24 for x in r["per_request"])
    from baton.engine.cpu import kernels as cpu_kernels

    # batch invariance (README: "what each dtype promises"): the same answers at 1 and 4 streams
    assert len(baton["identical_per_request"]) == 6
    assert baton["identical"] == 6 or not cpu_kernels.available()
    assert f"baton: identical at every concurrency: {baton['identical']} of 6" in printed
    assert "vLLM did not run" in printed and (tmp_path / "served_wall.png").is_file()


def test_served_rejects_a_bad_concurrency_list(tmp_path, capsys):
    for bad in ("1,x", "0,8", "8,8", ","):
        with pytest.raises(SystemExit) as exc:
            main(["served", "--quick", "--concurrency", bad, "--out", str(tmp_path)])
        assert exc.value.code == 2
        assert "argument --concurrency" in capsys.readouterr().err


def test_served_counts_identical_answers_and_time_per_output_token():
    from baton.bench.served import (dtype_of_fingerprint, first_difference, identical_at_every_concurrency,
                                    summarize, tpot_s)

    # a chunk may carry several tokens: TPOT divides by the usage event's tokens, not the chunks
    several = {"sent": 0.0, "chunks": [0.5, 0.7, 1.3], "usage": {"completion_tokens": 5}, "error": None}
    assert tpot_s(several) == pytest.approx(0.2)
    by_chunks = {"sent": 0.5, "chunks": [1.0, 1.1, 1.2], "usage": None, "error": None}  # no usage: one per chunk
    assert tpot_s(by_chunks) == pytest.approx(0.1)
    one = {"sent": 0.0, "chunks": [0.3], "usage": {"completion_tokens": 1}, "error": None}
    assert tpot_s(one) is None
    failed = {"sent": 0.0, "chunks": [], "usage": None, "error": "HTTP 500"}
    got = summarize([several, by_chunks, one, failed], wall_s=2.0)
    assert (got["requests"], got["errors"], got["output_tokens"]) == (4, 1, 9)
    assert got["ttft_p50_s"] == pytest.approx(0.5) and got["tpot_p50_s"] == pytest.approx(0.15)
    assert got["output_tokens_per_s"] == pytest.approx(4.5) and got["tokens_counted_as"] == "chunks"
    # texts[k][i]: request i at the k-th concurrency; a failed request is never identical
    assert identical_at_every_concurrency([["a", "b", "c", "d"], ["a", "B", "c", "d"], ["a", "b", None, "d"]]) == [
        True, False, False, True]
    assert identical_at_every_concurrency([["x", None]]) == [True, False]
    assert first_difference("hello", "help") == 3 and first_difference("ab", "abc") == 2
    assert first_difference("same", "same") is None
    assert dtype_of_fingerprint("LlamaForCausalLM/bfloat16/0a1b") == "bfloat16" and dtype_of_fingerprint(None) is None


@pytest.mark.slow
def test_goodput_quick_runs_each_admission_rule(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("BATON_VLLM_PYTHON", raising=False)
    document, printed = run_suite("goodput", tmp_path, capsys)
    runs = document["runs"]
    assert [r["rule"] for r in runs] == [-1, 2] and all("unavailable" not in r for r in runs)
    for r in runs:
        assert r["requests"] > 0 and r["errors"] == 0 and 0 <= r["good"] <= r["requests"]
        assert r["ttft_p50"] > 0 and r["goodput_rps"] == pytest.approx(r["good"] / document["settings"]["seconds"])
    assert "baton, queue 2" in printed


def test_goodput_counts_a_request_good_only_within_both_objectives():
    from baton.bench.goodput import summarize

    s = {"ttft": 1.0, "itl": 0.1, "seconds": 10.0}
    requests = [{"sent": 0.0, "chunks": [0.5, 0.6, 0.7], "error": None},  # good
                {"sent": 0.0, "chunks": [1.5, 1.6], "error": None},  # TTFT too long
                {"sent": 0.0, "chunks": [0.2, 0.3, 2.3], "error": None},  # a first token, then a stall: ITL 1.05 s
                {"sent": 0.0, "chunks": [], "error": "HTTP 500"}]
    got = summarize(requests, s)
    assert (got["requests"], got["errors"], got["good"]) == (4, 1, 1)
    assert got["goodput_rps"] == pytest.approx(0.1) and got["throughput_rps"] == pytest.approx(0.3)
    assert got["longest_gap_p99"] == pytest.approx(2.0, abs=0.05)


def test_goodput_mixed_workload_is_batons_table_1_shapes():
    from baton.bench.goodput import queries_for

    kinds = [q.kind for q in queries_for({"workload": "mixed", "max_tokens": 200})]
    assert len(kinds) == 24 and kinds.count("short-short") == 12 and kinds.count("long-short") == 6
    assert {q.kind for q in queries_for({"workload": "relay", "max_tokens": 200})} == {"short"}


def test_planner_suite_runs_the_planner_on_a_simulated_day(tmp_path, capsys):
    document, printed = run_suite("planner", tmp_path, capsys)
    day = document["days"]["2.0"]  # JSON keys are strings
    assert set(day["results"]) >= {"planner"} and day["requests"] > 1000
    assert all(r["unfinished"] == 0 for r in day["results"].values())
    assert "both met" in printed and "bound the workload allows" in printed
    assert all(Path(p).is_file() for p in document["plots"])


def test_chat_quick_runs_conversations_and_later_turns_find_their_kv(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("BATON_VLLM_PYTHON", raising=False)
    document, printed = run_suite("chat", tmp_path, capsys, "--servers", "baton,baton-disagg")
    assert document["problems"] == {} and set(document["servers"]) == {"baton", "baton-disagg"}
    for server, result in document["servers"].items():
        for run in result["runs"]:
            assert run["errors"] == 0 and run["requests"] == 5  # 2 conversations of 2 and 3 turns
            later = run["later_turns"]
            assert later["cached_tokens"] > 0 and later["cached_unreported"] == 0, server
    local = document["servers"]["baton"]["runs"][0]["server_said_after"]
    assert local["routing"]["local_requests"] > 0 and local["local_prefills"] > 0  # turns prefilled there
    memory = document["servers"]["baton"]["runs"][0]["memory"]  # sampled while the run went on
    assert memory["samples"] and set(memory["rss"]) == {"router", "prefill", "decode"}
    assert all(m["max_mib"] >= m["first_mib"] > 0 for m in memory["rss"].values())
    assert memory["kv_pages_total"] > 0 and memory["max_retained_pages"] is not None
    assert "Baton vs vLLM" in printed and "baton memory over the run" in printed


def test_local_quick_times_a_turn_prefilled_where_its_conversation_is(tmp_path, capsys):
    document, printed = run_suite("local", tmp_path, capsys)
    assert set(document["results"]) == {"allowed", "prefill worker"}
    for mode, by_rest in document["results"].items():
        for figures in by_rest.values():
            assert figures["ttft_s"] > 0 and figures["cached"] > 0, mode
            if mode == "prefill worker":
                assert all(run["prefill_worker"] for run in figures["runs"])
            # the router weighed the decode worker holding the conversation, and says so
            assert all("holds" in run["route"] for run in figures["runs"]), mode
    assert "prefilled there" in printed


def test_long_quick_times_new_prompts_through_a_cluster_and_compares_the_host_transport(tmp_path, capsys):
    document, printed = run_suite("long", tmp_path, capsys, "--against-generate")
    assert document["lengths"] == [64, 256] and set(document["runs"]) == {"default", "grpc"}
    for figures in document["by_length"].values():
        assert figures["ttft_s"] > 0 and figures["prefill_s"] > 0 and figures["transfer_s"] >= 0
    assert document["transports"] == {"shm": 4}  # this host, no GPU: shared memory (SDK and OpenAI API)
    assert document["runs"]["grpc"]["transports"] == {"grpc": 4}
    assert all(len(r["output"]) == 8 for r in document["runs"]["default"]["requests"])
    assert document["identical_with_grpc"] == 2
    assert all(r["openai_ttft_s"] > 0 and r["openai_text"] == r["text"] for r in document["runs"]["default"]["requests"])
    assert "TTFT of 256 tokens over 64" in printed and "the OpenAI API's text is the SDK's for 2 of 2" in printed
    assert document["as_generate"] == 2 and "generate's (float32) for 2 of 2 prompts" in printed


def test_quant_quick_races_quantized_weights_and_measures_what_they_lose(tmp_path, capsys):
    document, printed = run_suite("quant", tmp_path, capsys)
    assert set(document["results"]) == {"bf16", "int8", "int8-i8"}  # gguf: the default model's file only
    for name, result in document["results"].items():
        assert result["race"]["tokens"] > 0 and result["shape"]["decode_tokens_per_s"] > 0, name
    assert document["results"]["int8"]["weight_bytes"] < 0.6 * document["results"]["bf16"]["weight_bytes"]
    assert set(document["accuracy"]) == {"int8", "int8-i8", "fp8"}  # fp8: its accuracy alone (a GPU's format)
    for name, measured in document["accuracy"].items():
        assert 0 <= measured["kl_mean"] < (0.05 if name != "fp8" else 1.0) and measured["perplexity"] > 0, name
    assert "accuracy against the float model" in printed


@pytest.mark.all_cores  # two ranks, a core each
def test_tp_quick_times_tp1_and_tp2_on_the_same_cores_and_compares_their_bits(tmp_path, capsys):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("tp compares two ranks on two cores")
    document, printed = run_suite("tp", tmp_path, capsys)
    (model,) = document["models"]
    assert model["same_bits"], "TP=2's logits differ from TP=1's"
    assert set(model["runs"]) == {"TP=1, 2 cores", "TP=2, 1 core/rank", "TP=1, 1 core"}
    for run in model["runs"].values():
        assert run["prefill_s"] > 0 and run["step_ms_1"] > 0 and run["step_ms_4"] > 0
    assert "TP=2's logits are TP=1's bits" in printed


def test_the_gpu_check_script_parses_and_says_what_to_prepare(tmp_path):
    """bench/gpu_check.sh runs where nothing can be fixed between tries (a GPU lent for minutes):
    it must at least parse, and without its prepared folder say how to make it, before any work."""
    script = Path(__file__).parents[1] / "bench" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "gpu_check.sh").write_text(script.read_text())
    done = subprocess.run(["bash", str(tmp_path / "bench" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 1 and "bash bench/gpu_check.sh prepare" in done.stderr
