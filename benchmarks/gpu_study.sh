#!/usr/bin/env bash
# One workflow plan run on a lent GPU machine that has neither Snakemake nor the hub mirror: the jobs exported here by
# `benchmarks/replay_jobs.py export` (results/gpujobs.json), replayed in dependency order, their inputs (tokenizer,
# packed blocks, GLUE parquet) carried along. Writes under OUT (default results/gpu_study/):
#   env.txt        GPU, driver, torch version, CPU count
#   replay.log     the runner's log: each job's start, end, exit status and seconds
#   jobs.json      the same per job (rule, command, state, seconds)
#   study.tar.gz   what the jobs wrote (results/pretrain, init, glue, swarm and logs), model weights left out
# Usage (repository root):  [PLAN=results/gpujobs.json] [WHEELS=".whl"] bash benchmarks/gpu_study.sh [SECONDS] [SLOTS]
# SECONDS (default 450): no job starts after it, running ones are stopped; SLOTS (default 12): jobs at a time;
# WHEELS: folders of wheels the image lacks (installed to /tmp/site first: hivemind's for a swarm plan).
set -u
OUT=${OUT:-results/gpu_study}
mkdir -p "$OUT"
DEADLINE=${1:-450}
SLOTS=${2:-12}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PLAN=${PLAN:-results/gpujobs.json}
for dir in ${WHEELS:-.whl}; do
    if compgen -G "$dir/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$dir"/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi
done
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, torch.cuda.get_device_name())"
    nproc
} >"$OUT/env.txt" 2>&1
python3 benchmarks/replay_jobs.py run "$PLAN" --slots "$SLOTS" --deadline-s "$DEADLINE" \
    --record "$OUT/jobs.json" >"$OUT/replay.log" 2>&1
rc=$?
tar czf "$OUT/study.tar.gz" --exclude='*.safetensors' results/pretrain results/init results/glue results/swarm logs \
    2>>"$OUT/replay.log"
exit $rc
