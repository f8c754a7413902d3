"""Chained block hashes: stable across processes, position- and model-sensitive, fast."""
from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from baton.block_hash import MAX_BLOCK_HASH, BlockHasher, hash_prompt

FP = "llama|sha256:abc|bfloat16"


def test_hashes_are_one_per_full_block_and_skip_the_partial_tail():
    hasher = BlockHasher(FP, block_size=4)
    assert hasher.hash_prompt([]) == []
    assert hasher.hash_prompt([1, 2, 3]) == []
    assert len(hasher.hash_prompt(list(range(8)))) == 2
    assert hasher.hash_prompt(list(range(11))) == hasher.hash_prompt(list(range(8)))
    assert all(type(h) is int and 0 <= h <= MAX_BLOCK_HASH for h in hasher.hash_prompt(list(range(40))))


def test_hashes_are_stable_across_processes_and_hash_seeds():
    # Pinned values: a change here invalidates every cache and index in a running cluster.
    expected = [13058103838742314727, 17194876784643733713]
    assert hash_prompt(list(range(32)), FP) == expected
    code = ("from baton.block_hash import hash_prompt; "
            f"print(hash_prompt(list(range(32)), {FP!r}))")
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                             capture_output=True, text=True).stdout
        assert out.strip() == str(expected)


def test_hash_is_blake2b_over_the_documented_encoding():
    hasher = BlockHasher(FP, block_size=2)
    seed = hashlib.blake2b(b"2|" + FP.encode(), digest_size=8, person=b"baton.blockseed").digest()
    first = hashlib.blake2b(seed + struct.pack("<2I", 7, 9), digest_size=8,
                            person=b"baton.blockhash").digest()
    assert hasher.seed == int.from_bytes(seed, "little")
    assert hasher.hash_prompt([7, 9]) == [int.from_bytes(first, "little")]


def test_same_tokens_at_another_position_or_after_another_prefix_hash_differently():
    hasher = BlockHasher(FP, block_size=4)
    block = [5, 6, 7, 8]
    a = hasher.hash_prompt(block + block)
    assert a[0] != a[1]
    b = hasher.hash_prompt([1, 1, 1, 1] + block)
    assert b[1] != a[1] and b[1] != a[0]
    # Sharing a prefix shares its hashes, and only those.
    c = hasher.hash_prompt(block + [9, 9, 9, 9])
    assert c[0] == a[0] and c[1] != a[1]


def test_model_fingerprint_and_block_size_change_every_hash():
    tokens = list(range(64))
    base = hash_prompt(tokens, FP, block_size=16)
    other_model = hash_prompt(tokens, FP + "x", block_size=16)
    assert not set(base) & set(other_model)
    # Same first 32 tokens, but a chain with 32-token blocks is another chain.
    assert hash_prompt(tokens, FP, block_size=32)[0] not in base


def test_extend_continues_a_chain():
    hasher = BlockHasher(FP, block_size=4)
    tokens = list(range(24))
    full = hasher.hash_prompt(tokens)
    assert hasher.extend(full[1], tokens[8:]) == full[2:]
    assert hasher.extend(None, tokens) == full


@given(st.lists(st.integers(0, 2**32 - 1), max_size=70), st.integers(1, 9))
def test_a_prefix_of_the_prompt_hashes_to_a_prefix_of_the_hashes(tokens, block_size):
    hasher = BlockHasher(FP, block_size)
    full = hasher.hash_prompt(tokens)
    cut = len(tokens) // 2
    assert full[: cut // block_size] == hasher.hash_prompt(tokens[:cut])


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["a"]])
def test_bad_token_ids_are_refused_with_a_clear_error(bad):
    with pytest.raises(ValueError, match="token ids"):
        BlockHasher(FP, block_size=1).hash_prompt(bad)


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="fingerprint"):
        BlockHasher("")
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(FP, block_size=0)
    with pytest.raises(ValueError, match="64-bit"):
        BlockHasher(FP).extend(-1, [1] * 16)


def test_an_8k_token_prompt_hashes_in_a_few_milliseconds():
    hasher = BlockHasher(FP)
    tokens = list(range(8192))
    hasher.hash_prompt(tokens)
    start = time.perf_counter()
    for _ in range(10):
        hashes = hasher.hash_prompt(tokens)
    per_prompt_ms = (time.perf_counter() - start) / 10 * 1e3
    assert len(hashes) == 512
    assert per_prompt_ms < 10, f"{per_prompt_ms:.2f} ms per 8k-token prompt"
