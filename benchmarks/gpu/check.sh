#!/usr/bin/env bash
# The GPU check: what autopar must show on one GPU, in one script (under 8 minutes on an H100,
# nothing downloaded).
#
#   bash benchmarks/gpu/check.sh             # on a GPU machine: record its figures in BENCHMARKS.md
#   bash benchmarks/gpu/check.sh --dry-run   # on this machine's CPU at toy size (the suite runs it)
#
# 1. The CUDA kernels' rules (attention, fp8 and grouped products, the fused optimizer and
#    GradScaler ops) and the step meter: their tests, which check the CUDA kernels through their
#    meta implementations and simulated worlds (skipped by --dry-run: the suite runs them).
# 2. benchmarks/gpu/llama_step.py: a 1 B Llama, sequence 2048, bf16, plain torch against autopar
#    on a 1-rank mesh (tokens/s, MFU, peak memory, autopar's step over plain's: the goal is
#    within 3%) and rank 0 of a dp 4 x mp 2 job simulated with this GPU computing its pieces
#    (no attention gathers); non-zero exit on a loss mismatch or a gather.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
dry_run=""
if [ "${1:-}" = "--dry-run" ]; then dry_run="--dry-run"; fi

python -c "import torch; print('torch', torch.__version__, '| device:', torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU only')"
if [ -z "$dry_run" ]; then
    python -m pytest -q -p no:cacheprovider tests/test_rules_cuda_attention.py tests/test_rules_scaled_grouped_mm.py \
        tests/test_rules_optim.py tests/test_meter.py
fi
python benchmarks/gpu/llama_step.py $dry_run
