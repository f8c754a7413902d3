"""A cluster on quantized weights (model.quantization int8: Q8_0 blocks made at load) answers
exactly as its own engine does, through a decode worker killed mid-stream and a prefill worker
drained: the failover's re-prefill and the KV pushed between workers are the quantized model's."""
from __future__ import annotations

import signal
import threading
import time

import pytest

from baton.client import BatonClient, BatonError
from baton.decode_worker.core import DecodeConfig
from baton.engine.cpu import kernels as cpu_kernels
from baton.engine.model import load_model
from baton.launch.local import LocalEngine
from baton.launch.up import LocalCluster
from baton.sampling import SamplingParams

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cpu_kernels.available(), reason="Baton's CPU kernels did not build here")]
MAX_TOKENS = 400


def test_a_quantized_cluster_answers_as_its_engine_through_a_kill_and_a_drain():
    prompts = [[400 + 13 * i + j for j in range(3 + i % 19)] for i in range(16)]
    loaded = load_model("tiny-random", dtype="bfloat16", module=False, quantization="int8")
    engine = LocalEngine(loaded, DecodeConfig(max_rows=4))  # batch-invariant: as alone
    expected = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    with LocalCluster(prefill=2, decode=2, model="tiny-random", max_rows=4,
                      extra_env={"BATON_MODEL_QUANTIZATION": "int8", "BATON_MODEL_DTYPE": "bfloat16"}) as cluster:
        procs = dict(cluster.procs)
        with BatonClient(cluster.router_address, timeout=120) as client:
            assert client.model_info().model_fingerprint == str(loaded.fingerprint)  # the Q8_0 blocks
            results, streaming = {}, threading.Semaphore(0)

            def run(i: int) -> None:
                tokens = []
                try:
                    for chunk in client.stream(token_ids=prompts[i], max_tokens=MAX_TOKENS, ignore_eos=True):
                        if not tokens and chunk.token_ids:
                            streaming.release()
                        tokens.extend(chunk.token_ids)
                    results[i] = tokens
                except BatonError as err:
                    results[i] = err

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for _ in range(6):  # six streams decoding (of the 8 rows): both workers hold rows
                assert streaming.acquire(timeout=60), "the streams did not start"
            procs[cluster.decode_addrs[0]].send_signal(signal.SIGKILL)
            procs[cluster.prefill_addrs[0]].send_signal(signal.SIGTERM)
            for t in threads:
                t.join(timeout=150)
            assert not any(t.is_alive() for t in threads), "a request hung"
            assert procs[cluster.prefill_addrs[0]].wait(timeout=60) == 0, "the drained prefill worker did not exit"
            assert client.cluster_status().routing["prefilled_again"] > 0  # the killed worker's rows moved
    for i, want in enumerate(expected):
        assert results[i] == want, f"request {i}: {results[i]}"
