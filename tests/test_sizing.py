"""The sizes a decode worker chooses at start where its config leaves them at 0 (baton/sizing.py),
and the progress lines of long loads (baton/logs.py): plain arithmetic, no device."""
from __future__ import annotations

import logging

from baton.logs import Progress
from baton.resources import Amount
from baton.sizing import GPU_ROWS, MIN_STAGING_BYTES, decode_rows, staging_bytes

GIB = 1 << 30
LLAMA_8B_TOKEN = 32 * 2 * 8 * 128 * 2  # bytes of one token's KV: layers, keys and values, KV heads, head dim, bf16


def test_rows_follow_the_device_and_the_threads_unless_set():
    assert decode_rows(12, "cuda", 16, 10**6) == Amount(12, "decode.max_rows")
    gpu = decode_rows(0, "cuda", 16, 300_000)
    assert gpu.value == GPU_ROWS and "GPU" in gpu.source
    assert decode_rows(0, "cpu", 2, 10**6).value == 8  # this machine's 2 cores: as measured
    assert decode_rows(0, "cpu", 32, 10**6).value == 128
    assert decode_rows(0, "cpu", 1, 10**6).value == 8  # never fewer than 8 where the KV holds them


def test_rows_are_fewer_where_the_kv_budget_holds_fewer():
    small = decode_rows(0, "cuda", 16, 10 * 256)
    assert small.value == 10 and "KV budget holds 2560 tokens" in small.source
    assert decode_rows(0, "cpu", 2, 100).value == 1  # a budget of 100 tokens: one row at a time


def test_staging_holds_two_longest_prompts_within_a_quarter_of_the_memory_left():
    host = Amount(512 * GIB, "the host's MemAvailable")
    assert staging_bytes(123, host, LLAMA_8B_TOKEN, 8191) == Amount(123, "decode.staging_bytes")
    # the 8B shape at an 8k context: 1 GiB a prompt, twice over (512 MiB refused a 7,000-token prompt)
    chosen = staging_bytes(0, host, LLAMA_8B_TOKEN, 8191)
    assert chosen.value == 2 * 8191 * LLAMA_8B_TOKEN and "2 prompts of 8191 tokens" in chosen.source
    # a small model still gets the floor
    assert staging_bytes(0, host, 46_080, 2047).value == MIN_STAGING_BYTES
    # a 2 GiB pod leaves at most a quarter of its memory to the pool, and says so
    pod = Amount(2 * GIB, "the cgroup memory limit 2147483648 bytes less 0 in use (/sys/fs/cgroup/pod)")
    capped = staging_bytes(0, pod, LLAMA_8B_TOKEN, 8191)
    assert capped.value == GIB // 2 and "cgroup memory limit" in capped.source


def test_progress_speaks_only_for_work_that_lasts(caplog, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("baton.logs.time.monotonic", lambda: clock[0])
    log = logging.getLogger("test.progress")
    with caplog.at_level(logging.INFO, logger="test.progress"):
        quick = Progress(log, "loading quick", 1000)
        quick.advance(1000)  # done within every_s: nothing said
        slow = Progress(log, "loading slow", 1000, every_s=5)
        for _ in range(4):
            clock[0] += 3
            slow.advance(100)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["loading slow: 200 of 1000 bytes (20%), about 24s left",
                     "loading slow: 400 of 1000 bytes (40%), about 18s left"]


def test_a_local_prefill_chunk_takes_about_one_decode_step_while_rows_decode():
    from baton.sizing import LOCAL_MIN_TOKENS, LOCAL_PROBE_TOKENS, local_chunk_tokens

    assert local_chunk_tokens(128, 0, 0.05, 0.003) == 128  # nobody waits: the most
    assert local_chunk_tokens(128, 4, None, None) == LOCAL_PROBE_TOKENS  # not measured yet
    assert local_chunk_tokens(128, 4, 0.05, 0.001) == 50  # 50 ms steps, 1 ms a token
    assert local_chunk_tokens(128, 4, 0.05, 0.0001) == 128  # within the most
    assert local_chunk_tokens(128, 4, 0.002, 0.003) == LOCAL_MIN_TOKENS  # always some progress
    assert local_chunk_tokens(4, 4, 0.002, 0.003) == 4
