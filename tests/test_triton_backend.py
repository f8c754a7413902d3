"""The engine with the Triton backend forced (interpreter on CPU) decodes the same greedy tokens."""
import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json
    from baton.local import LocalEngine
    from baton.decode_worker.core import DecodeConfig
    from baton.engine.model import load_model
    from baton.sampling import SamplingParams

    model = load_model("tiny-random", dtype="float32")
    # rows continuing it share its KV pages (the paged decode kernel), and prefill over its
    # cached blocks (the prefill kernel with a shared prefix)
    document = list(range(1000, 1080))
    prompts = [[5, 6, 7], list(range(100, 140)), [9], list(range(300, 317)), document + [7, 8], document + [9],
               document + [4, 5, 6]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    result = {}
    for backend in ("torch", "triton"):
        engine = LocalEngine(model, DecodeConfig(max_rows=2), attention_backend=backend, prefix_cache_bytes=1 << 24)
        engine.generate([document + [3]], params)  # caches the document's blocks
        result[backend] = [o.token_ids for o in engine.generate(prompts, params)]
        result[backend + "_backend"] = engine.runner.backend
        result[backend + "_sharing"] = engine.decode.scheduler.rows_sharing_total
        result[backend + "_cached"] = engine.prefill.cached_tokens_total  # prefills continuing a prefix
    print(json.dumps(result))
""")


def test_triton_backend_matches_torch_backend():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["torch_backend"] == "torch" and result["triton_backend"] == "triton"
    assert result["triton"] == result["torch"]
    assert result["triton_sharing"] >= 1 and result["torch_sharing"] >= 1
    assert result["triton_cached"] >= 64 and result["torch_cached"] >= 64  # the shared-prefix prefill kernel ran
