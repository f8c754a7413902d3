"""The engine with the Triton backend forced (interpreter on CPU) decodes the same greedy tokens."""
import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json
    from baton.launch.local import LocalEngine
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


INVARIANT_SCRIPT = textwrap.dedent("""
    import dataclasses
    import json
    import os
    import torch
    from baton.decode_worker.core import DecodeConfig, DecodeCore
    from baton.engine import fp8
    from baton.engine.llama import LlamaRunner
    from baton.engine.model import _finish, load_model, tiny_random_model
    from baton.engine.request import GenerationRequest
    from baton.launch.local import LocalEngine
    from baton.prefill_worker.core import PrefillCore
    from baton.sampling import SamplingParams

    # CUDA's batch-invariant kernels (Triton GEMM, RMSNorm, the query-tiled attention decode and
    # prefill share, the fused steps), interpreted on CPU (compiled where BATON_TEST_DEVICE=cuda:
    # test_cuda.py); bf16 storage and activations as on a GPU; then the same with fp8 weights
    # (engine.fp8). A 512-token vocabulary (ids the default tokenizer decodes): the interpreter
    # takes seconds for a 49152-row LM head
    device = os.environ.get("BATON_TEST_DEVICE", "cpu")
    floats = _finish(tiny_random_model(vocab_size=512), load_model("tiny-random").tokenizer, "tiny-512",
                     torch.bfloat16, device)
    quantized = dataclasses.replace(floats, quantization="fp8", tensors={
        k: fp8.quantize(w) if k.endswith("proj.weight") else w for k, w in floats.tensors.items()})
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    # short prompts: the interpreter runs each prompt token's attention as a program of its own
    target = list(range(300, 320))
    others = [[7, 8, 9], list(range(100, 125)), [11]]
    results = {}
    for name, model in (("bf16", floats), ("fp8", quantized)):
        runner = LlamaRunner(model, "triton", cuda_graphs=device == "cuda", layout="triton")
        alone = LocalEngine(model, DecodeConfig(max_rows=1), runner=runner).generate([target], params)[0].token_ids
        mixed = LocalEngine(model, DecodeConfig(max_rows=4), runner=runner).generate(
            others[:2] + [target] + others[2:], params)[2].token_ids
        whole = runner.prefill(target)
        kv = None
        for end in (7, 13, 20):  # chunked prefill, each chunk continuing the last one's KV
            out = runner.prefill_batch([target[:end]], kv)[0]
            kv = out.kv
        chunked = torch.equal(out.kv.data, whole.kv.data) and torch.equal(out.logits, whole.logits)
        core = DecodeCore(runner, DecodeConfig(max_rows=3, page_size=8))
        prefill = PrefillCore(runner, prefix_cache_bytes=0)
        for rid, p in (("a", target), ("b", others[1])):
            core.add(prefill.prefill([GenerationRequest(rid, p, params)])[0])
        core.step()  # one decode step: "a" has 2 of its 3 tokens when it is taken out
        ev = core.evict("a")
        reprefilled = torch.equal(ev.kv.data.cpu(), runner.prefill(target + ev.token_ids[:-1]).kv.data.cpu())
        results[name] = {"alone": alone, "mixed": mixed, "chunked": chunked, "reprefilled": reprefilled,
                         "layout": runner.layout, "invariant": runner.invariant_attention}
    print(json.dumps(results))
""")


def test_cuda_batch_invariant_kernels_in_the_interpreter():
    """The path CUDA takes in bf16/fp16, with float and with fp8 weights: a request's tokens are the
    same beside other rows, chunked prefill gives one whole prefill's KV bits, and decode writes the
    KV a re-prefill computes."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", INVARIANT_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for weights in ("bf16", "fp8"):  # fp8: the projections as e4m3 codes (engine.fp8) on the fp8 GEMM
        run = result[weights]
        assert run["layout"] == "triton" and run["invariant"]
        assert len(run["alone"]) == 3 and run["mixed"] == run["alone"], weights
        assert run["chunked"] and run["reprefilled"], weights
