#!/usr/bin/env bash
# The GPU checks of one short device lease, in priority order, each bounded by `timeout` so that a slow step
# cannot eat the next one's time. Writes everything under OUT (default results/gpu_checks/):
#   env.txt                    GPU, driver, torch / transformers versions
#   b256_compile.json / .log   crammed (static sparse prediction) vs HF BertForMaskedLM, paper shape
#                              (16 x 768, vocab 32768, seq 128), micro-batch 256, torch.compile default mode
#   pytest.log                 tests/test_cuda.py and the CUDA test of tests/test_hotloop.py (sync debug mode)
#   b512_compile.json / .log   the same as the first at micro-batch 512
#   b256_autotune.json / .log  crammed alone at micro-batch 256 under compile_mode max-autotune
#   steps.txt                  one line per step: name, exit status, seconds
# The second set (`sweep`) fills in the rest of the micro-batch x mode grid and looks for the missing MFU:
#   b128_compile, b128_eager, b256_eager, b512_eager   crammed-static vs HF as above
#   b1024_compile              crammed-static alone at micro-batch 1024, compiled
#   glu.json / .log            benchmarks/glu_backward.py at 512 x 128 tokens (formulations of the gated GELU)
#   b512_cdt                   crammed-static at 512 with inductor's coordinate-descent kernel tuning
# The third set (`confirm`), after a change to the model: b256_compile, b512_compile, b512_eager, glu and pytest again.
# Usage (repository root, on a machine with a CUDA GPU):  bash benchmarks/gpu_checks.sh [SECONDS] [first|sweep|confirm]
# SECONDS (default 540) is the whole script's budget; the last step gets what is left.
# Python packages the GPU image lacks may be put in .whl/ as wheels; they are installed to /tmp/site first.
set -u
OUT=${OUT:-results/gpu_checks}
mkdir -p "$OUT"
BUDGET=${1:-540}
SET=${2:-first}
START=$SECONDS
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

step() { # step NAME LIMIT_SECONDS COMMAND...: run COMMAND under a limit capped by the budget left
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - (SECONDS - START)))
    ((limit > left)) && limit=$left
    if ((limit < 20)); then
        echo "$name skipped 0" >>"$OUT/steps.txt"
        return
    fi
    local t0=$SECONDS
    timeout -s INT -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $((SECONDS - t0))" | tee -a "$OUT/steps.txt"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, torch.cuda.get_device_name())"
    nproc
} >"$OUT/env.txt" 2>&1

PAPER=(--layers 16 --hidden 768 --heads 12 --intermediate 3072 --vocab 32768 --seq 128 --device cuda
    --warmup 3 --steps 15)
BENCH=(python3 benchmarks/pretrain_throughput.py "${PAPER[@]}")
if [[ $SET == confirm ]]; then
    for batch in 256 512; do
        step "b${batch}_compile" 150 "${BENCH[@]}" --batch "$batch" --compile --models crammed-static,hf \
            --json "$OUT/b${batch}_compile.json"
    done
    step glu 60 python3 benchmarks/glu_backward.py --device cuda --tokens 65536 --json "$OUT/glu.json"
    step b512_eager 90 "${BENCH[@]}" --batch 512 --models crammed-static,hf --json "$OUT/b512_eager.json"
    step pytest 170 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_hotloop.py -k cuda
    echo "total $((SECONDS - START)) s" >>"$OUT/steps.txt"
    exit 0
fi
if [[ $SET == sweep ]]; then
    step b128_compile 150 "${BENCH[@]}" --batch 128 --compile --models crammed-static,hf --json "$OUT/b128_compile.json"
    step b256_eager 80 "${BENCH[@]}" --batch 256 --models crammed-static,hf --json "$OUT/b256_eager.json"
    step b512_eager 90 "${BENCH[@]}" --batch 512 --models crammed-static,hf --json "$OUT/b512_eager.json"
    step b128_eager 70 "${BENCH[@]}" --batch 128 --models crammed-static,hf --json "$OUT/b128_eager.json"
    step b1024_compile 100 "${BENCH[@]}" --batch 1024 --compile --models crammed-static --json "$OUT/b1024_compile.json"
    step glu 90 python3 benchmarks/glu_backward.py --device cuda --tokens 65536 --json "$OUT/glu.json"
    step b512_cdt 300 "${BENCH[@]}" --batch 512 --compile --coordinate-descent --models crammed-static \
        --json "$OUT/b512_cdt.json"
    echo "total $((SECONDS - START)) s" >>"$OUT/steps.txt"
    exit 0
fi
step b256_compile 170 python3 benchmarks/pretrain_throughput.py "${PAPER[@]}" --batch 256 --compile \
    --models crammed-static,hf --json "$OUT/b256_compile.json"
step pytest 170 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_hotloop.py -k cuda
step b512_compile 150 python3 benchmarks/pretrain_throughput.py "${PAPER[@]}" --batch 512 --compile \
    --models crammed-static,hf --json "$OUT/b512_compile.json"
step b256_autotune 600 python3 benchmarks/pretrain_throughput.py "${PAPER[@]}" --batch 256 --compile \
    --compile-mode max-autotune --models crammed-static --json "$OUT/b256_autotune.json"
echo "total $((SECONDS - START)) s" >>"$OUT/steps.txt"
