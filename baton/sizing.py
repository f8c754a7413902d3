"""Defaults a decode worker sizes at start from its device, its model and its container, for the
settings left at 0: batch rows and the host KV pool. (The KV budget is sized in
engine/paged_kv.py, threads in engine/threads.py; each is an `Amount`, logged once at start with
how it was chosen, exported in /metrics and reported to the router's GetModelInfo.)

Plain arithmetic on numbers the worker measured, so that every rule is tested without a device.
"""
from __future__ import annotations

from baton.resources import Amount

# vLLM's default on a GPU (max_num_seqs): rows are a cap; admission is by free KV pages.
GPU_ROWS = 256
# On a CPU a step's time grows with its rows: a few rows per thread keep every core busy through
# the step's matrix products without stretching each token's time (8 on 2 cores, as measured).
CPU_ROWS_PER_THREAD = 4
MIN_ROWS = 8
# A row is worth admitting when the KV holds this many of its tokens: fewer rows where the budget
# holds less, so that rows do not stand waiting for pages they will never get.
TOKENS_PER_ROW = 256

MIN_STAGING_BYTES = 512 << 20
HOST_STAGING_SHARE = 0.25  # of the host memory this process may still take (the container's limit)
STAGED_CONTEXTS = 2  # the pool holds this many longest prompts' KV (one landing while one waits)


def decode_rows(configured: int, device_type: str, threads: int, kv_tokens: int) -> Amount:
    """Decode batch rows: `configured` where set (> 0), else as the device allows."""
    if configured > 0:
        return Amount(configured, "decode.max_rows")
    if device_type == "cuda":
        rows, how = GPU_ROWS, f"{GPU_ROWS} on a GPU"
    else:
        rows, how = CPU_ROWS_PER_THREAD * threads, f"{CPU_ROWS_PER_THREAD} per torch thread, {threads} threads"
    by_kv = max(1, kv_tokens // TOKENS_PER_ROW)
    if by_kv < rows:
        rows, how = by_kv, f"the KV budget holds {kv_tokens} tokens, {TOKENS_PER_ROW} a row"
    if rows < MIN_ROWS <= by_kv:
        rows, how = MIN_ROWS, f"at least {MIN_ROWS}"
    return Amount(rows, how)


def staging_bytes(configured: int, host: Amount, bytes_per_token: int, longest_prompt_tokens: int) -> Amount:
    """The host KV pool (landed KV waiting for a row, and parked rows' KV): `configured` where set
    (> 0), else room for STAGED_CONTEXTS of the longest prompt this worker takes, at least
    MIN_STAGING_BYTES, within HOST_STAGING_SHARE of what the host (or the container) has left."""
    if configured > 0:
        return Amount(configured, "decode.staging_bytes")
    wanted = max(MIN_STAGING_BYTES, STAGED_CONTEXTS * longest_prompt_tokens * bytes_per_token)
    cap = int(HOST_STAGING_SHARE * host.value)
    if wanted <= cap:
        return Amount(wanted, f"{STAGED_CONTEXTS} prompts of {longest_prompt_tokens} tokens, at least "
                              f"{MIN_STAGING_BYTES >> 20} MiB")
    return Amount(cap, f"{HOST_STAGING_SHARE:g} of {host.value} bytes: {host.source}")


# A prompt prefilled on a decode worker (conditional disaggregation) runs a chunk between decode
# steps; while rows decode, a chunk is sized to take about one step, so their tokens come at most
# about twice as far apart. Until both times are measured, a small probe.
LOCAL_PROBE_TOKENS = 16
LOCAL_MIN_TOKENS = 8


def local_chunk_tokens(most: int, rows_decoding: int, step_s: float | None, token_s: float | None) -> int:
    """Tokens of the next local prefill chunk: `most` with no row decoding, else what fits in one
    decode step of `step_s` at `token_s` a token (measured), within LOCAL_MIN_TOKENS..most."""
    if not rows_decoding:
        return most
    if not step_s or not token_s:
        return min(most, LOCAL_PROBE_TOKENS)
    return max(min(most, LOCAL_MIN_TOKENS), min(most, int(step_s / token_s)))


def moving_mean(previous: float | None, value: float, weight: float = 0.2) -> float:
    """A moving average of a measured time: the latest readings count most."""
    return value if previous is None else (1 - weight) * previous + weight * value
