#!/usr/bin/env bash
# The project's GPU paths in one call on a lent GPU machine (one GPU; the image's python3 with torch,
# no DeepSpeed, no network), each step under its own `timeout` so that one failure leaves the rest:
#   probe     nvidia-smi, torch and the carried packages' versions, the bf16 matmul peak (8192-wide)
#   stage_resume  the pretrain stage under torchrun (bf16, ZeRO-1, checkpoints), then resumed from its
#             checkpoint (bench/gpu_stage_resume.py)
#   mem_1b_*  bench/memory_plan.py --device cuda, flavour 1b, its default cuda cases in 4 parallel lanes
#             (each case is its own process; the peaks are per-process allocator statistics, so the
#             lanes do not disturb each other's figures, only each other's speed)
#   mem_moe   bench/memory_plan.py --device cuda, flavour moe-tiny (world of one: no ep2)
#   train     bench/train_throughput.py --device cuda, 1b, bf16: our step and the stage's DeepSpeed step
#             against transformers.Trainer, alternating step by step, alone on the GPU
#   decode    bench/decode_steps.py --device cuda, SmolLM2-135M's layers in bf16, batch 1: our
#             DecodeEngine (eager, preallocated; then compiled, its own step) against transformers'
#             generate, alone
# Logs and JSON go to a work folder, tarred into $OUT/gpu_checks.tgz; the summary table is printed last
# (the device tool returns the output's end) and written to $OUT/summary.txt and $OUT/summary.json.
#
# Here, once (CPU machine with the project's venv): build the wheels the device lacks into .whl/
# (git-ignored through .git/info/exclude):
#     bash bench/gpu_checks.sh wheels
# Check the script's commands start (no GPU needed):
#     bash bench/gpu_checks.sh check
# On the device, as one call of the device tool's `run` with carry [".whl"], timeout_s ~480:
#     bash bench/gpu_checks.sh
# GPU_CHECKS_BUDGET (seconds, default 440) bounds the whole run: each step's timeout is cut to what is left.
# 2026-11-30 on one H200: 375 s, the steps 15 / 56-97 (the memory lanes side by side) / 53 / 88 / 120 s
# (bench/README.md, gpu_checks.sh).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=${1:-run}
WHEELS=(transformers==5.23.0 peft==0.21.2 hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5
        annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 jsonschema==4.26.0
        jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1)

if [ "$MODE" = wheels ]; then  # here: DeepSpeed as built for the venv (pure Python), the rest for cp312
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
    mkdir -p .whl
    .venv/bin/pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8 || exit 1
    .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}" || exit 1
    ls -l .whl && du -sh .whl
    exit 0
fi

PY=${GPU_CHECKS_PY:-python3}  # the image's python3 on the device
if [ "$MODE" = check ]; then  # here: the commands parse their arguments; the summary runs on nothing
    PY=.venv/bin/python
    for script in memory_plan train_throughput decode_steps gpu_stage_resume; do
        $PY bench/$script.py --help > /dev/null || { echo "bench/$script.py --help failed"; exit 1; }
    done
    tmp=$(mktemp -d)
    $PY bench/gpu_summary.py "$tmp" "$tmp/summary.json" || exit 1
    rm -rf "$tmp"
    echo "check ok"
    exit 0
fi

OUT=${OUT:-$ROOT/bench/out/gpu_checks}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu_checks.XXXXXX)
BUDGET=${GPU_CHECKS_BUDGET:-440}
START=$(date +%s)
RESERVE=20  # seconds kept for the summary and the tar at the end
exec > >(tee -a "$OUT/gpu_checks.log") 2>&1

# the carried wheels into $SITE, ahead of the image's packages (its transformers is older)
SITE=${GPU_CHECKS_SITE:-/tmp/site}
if ls .whl/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || echo "wheel install FAILED"
fi
export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
printf 'step\trc\tseconds\tlimit\n' > "$WORK/steps.tsv"

left() { echo $(( BUDGET - RESERVE - ($(date +%s) - START) )); }

# step NAME LIMIT CMD...: run CMD under timeout min(LIMIT, budget left) into $WORK/NAME.log
step() {
    local name=$1 limit=$2 t0 rc
    shift 2
    local avail; avail=$(left)
    [ "$avail" -lt "$limit" ] && limit=$avail
    if [ "$limit" -lt 10 ]; then
        printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >> "$WORK/steps.tsv"
        echo "== $name skipped: budget spent"
        return
    fi
    echo "== $name (limit ${limit}s): $*"
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" > "$WORK/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" >> "$WORK/steps.tsv"
    echo "== $name rc=$rc in $(( $(date +%s) - t0 ))s"
    tail -n 25 "$WORK/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit,temperature.gpu \
    --format=csv > "$WORK/nvidia-smi.csv" 2>&1
cat "$WORK/nvidia-smi.csv"
step probe 60 $PY - "$WORK/probe.json" <<'EOF'
import json, sys, importlib.metadata as md
import torch
from stages.training.flops import peak_matmul_flops
out = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(),
       "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30, "python": sys.version.split()[0]}
for name in ("deepspeed", "transformers", "peft", "accelerate", "pydantic", "tokenizers", "huggingface_hub"):
    try:
        out[name] = md.version(name)
    except md.PackageNotFoundError:
        out[name] = None
import deepspeed, transformers, peft  # the carried ones import
out["peak_bf16_tflops"] = [peak_matmul_flops(torch.bfloat16, "cuda", n=8192, iters=20) / 1e12 for _ in range(3)]
print(json.dumps(out, indent=1))
json.dump(out, open(sys.argv[1], "w"), indent=1)
EOF

# the pretrain stage itself (torchrun, NCCL, bf16, ZeRO-1, checkpoints) and a rerun that resumes from its
# checkpoint: on 2026-12-01 that resume failed on the H200 (fused AdamW's step on the CPU), since fixed
step stage_resume 90 $PY bench/gpu_stage_resume.py --out "$WORK/stage_resume.json"

# memory: 4 lanes of 1b (two cases each, fresh process per case) and one of moe-tiny, side by side
MEM_LIMIT=220
mem() { step "$1" "$MEM_LIMIT" $PY bench/memory_plan.py --device cuda --steps 2 --out "$WORK/$1.json" "${@:2}"; }
lanes=()
mem mem_1b_a --flavours 1b --cases none stage3_bf16 & lanes+=($!)
mem mem_1b_b --flavours 1b --cases none_bf16 stage1_bf16_recompute & lanes+=($!)
mem mem_1b_c --flavours 1b --cases stage1_bf16 stage2_bf16_offload & lanes+=($!)
mem mem_1b_d --flavours 1b --cases stage2_bf16 lora_bf16 & lanes+=($!)
mem mem_moe --flavours moe-tiny --cases none stage1 none_bf16 stage1_bf16 lora_stage1 lora_experts_stage1 & lanes+=($!)
wait "${lanes[@]}"  # these only: a bare wait would also wait for the tee of the log (bash >= 5.1), forever

# throughput and decode: alone on the GPU
step train 150 $PY bench/train_throughput.py --device cuda --flavour 1b --vocab-size 32000 --batch-size 8 \
    --seq-len 1024 --steps 10 --warmup-steps 3 --no-compile --out "$WORK/train_throughput.json"
step decode 80 $PY bench/decode_steps.py --device cuda --dtype bfloat16 --flavour 135m --batch-sizes 1 \
    --new-tokens 32 --repeats 3 --no-compile --out "$WORK/decode_steps.json"
# the compiled engine with what is left (2026-11-30: 109 s in all, its first call 38 s; 120 s for
# 48 tokens x 3 repeats was too little)
step decode_compiled 170 $PY bench/decode_steps.py --device cuda --dtype bfloat16 --flavour 135m --batch-sizes 1 \
    --new-tokens 32 --repeats 3 --out "$WORK/decode_compiled.json"

nvidia-smi --query-gpu=clocks.sm,temperature.gpu,memory.used --format=csv >> "$WORK/nvidia-smi.csv" 2>&1
tar czf "$OUT/gpu_checks.tgz" -C "$WORK" . 2>/dev/null
echo
echo "total $(( $(date +%s) - START ))s; logs and JSON: \$OUT/gpu_checks.tgz"
$PY bench/gpu_summary.py "$WORK" "$OUT/summary.json" | tee "$OUT/summary.txt"
