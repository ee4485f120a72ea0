#!/usr/bin/env bash
# Run every benchmark RUNS times (default 3) and keep rank 0's JSON lines under benchmarks/results/.
#   bash benchmarks/run_all.sh [RUNS [ONLY]]
#   python benchmarks/summarize.py benchmarks/results/*.<commit>-?.jsonl            # the table
#   python benchmarks/summarize.py --plot benchmarks/plots benchmarks/results/*.<commit>-?.jsonl
# Files are named <what is measured>.<commit>-<run>.jsonl; ONLY runs just the benchmarks whose
# name contains it.
#
# autopar is edited in parallel, so the benchmarks measure a frozen snapshot of the committed
# HEAD (git archive -> /tmp/autopar-bench-<commit>, put first on PYTHONPATH, commands run from
# there so `python -m autopar.launch` also comes from the snapshot).  AUTOPAR_BENCH_LIVE=1
# measures the working tree instead.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$repo/benchmarks/results
bench=$repo/benchmarks
mkdir -p "$out"
export OMP_NUM_THREADS=1
if [[ "${AUTOPAR_BENCH_LIVE:-0}" != 1 ]]; then
    commit=$(git -C "$repo" rev-parse --short HEAD)
    snap=/tmp/autopar-bench-$commit
    if [[ ! -f $snap/SNAPSHOT_COMMIT ]]; then
        rm -rf "$snap" && mkdir -p "$snap"
        git -C "$repo" archive HEAD autopar | tar -x -C "$snap"
        echo "$commit" > "$snap/SNAPSHOT_COMMIT"
    fi
    export PYTHONPATH=$snap${PYTHONPATH:+:$PYTHONPATH}
    cd "$snap"
    echo "measuring autopar $commit from $snap" >&2
else
    cd "$repo"
fi
runs=${1:-3}
only=${2:-}
commit=${commit:-$(git -C "$repo" rev-parse --short HEAD)-live}
run() {  # name, command...
    local name=$1.$commit-$n; shift
    if [[ -n "$only" && "$name" != *"$only"* ]]; then return; fi
    echo "== $name: $*" >&2
    "$@" 2> "$out/$name.stderr" | sed -n 's/^\(\[rank0\]: \)\{0,1\}\({"bench".*\)$/\2/p' > "$out/$name.jsonl"
    echo "   $(wc -l < "$out/$name.jsonl") records -> $out/$name.jsonl" >&2
}
for n in $(seq "${FIRST_RUN:-1}" "$runs"); do  # FIRST_RUN=k resumes at run k
    run dispatch_1rank  python -m autopar.launch --nproc_per_node 1 "$bench/bench_dispatch.py"
    run dispatch_4ranks python -m autopar.launch --nproc_per_node 4 "$bench/bench_dispatch.py"
    run reshard_4ranks  python -m autopar.launch --nproc_per_node 4 "$bench/bench_reshard.py"
    run tp_mlp_2ranks   python -m autopar.launch --nproc_per_node 2 "$bench/bench_tp_mlp.py"
    run tp_mlp_4ranks   python -m autopar.launch --nproc_per_node 4 "$bench/bench_tp_mlp.py"
    run zero_2ranks     python -m autopar.launch --nproc_per_node 2 "$bench/bench_zero.py"
    run zero_4ranks     python -m autopar.launch --nproc_per_node 4 "$bench/bench_zero.py"
    run gpt_4ranks      python -m autopar.launch --nproc_per_node 4 "$bench/bench_gpt.py"
    # the same tiny GPT with one rank per core (4 ranks share 2 cores above: every wait is a context switch)
    run gpt_2ranks      python -m autopar.launch --nproc_per_node 2 "$bench/bench_gpt.py" --reps 30
    # the ANCHORS.md size: a 3.7 M-parameter GPT on 2 ranks (DP 2; DP x TP is TP 2)
    run gpt_3m7_2ranks  python -m autopar.launch --nproc_per_node 2 "$bench/bench_gpt.py" --dim 256 --layers 4 --vocab 1024 --heads 8 --seq 128 --batch 8 --reps 10
    run gpt_accum4_3m7_2ranks  python -m autopar.launch --nproc_per_node 2 "$bench/bench_gpt.py" --dim 256 --layers 4 --vocab 1024 --heads 8 --seq 128 --batch 8 --reps 5 --accum 4
    run optim_2ranks    python -m autopar.launch --nproc_per_node 2 "$bench/bench_optim.py"
    # a checkpoint of the 3.7 M GPT's model and optimizer: blocking against async_save=True
    run async_save_2ranks python -m autopar.launch --nproc_per_node 2 "$bench/bench_async_save.py"
    run optim_small_2ranks python -m autopar.launch --nproc_per_node 2 "$bench/bench_optim.py" --dim 64 --layers 2
    # pipeline schedules, one rank per core: 1F1B x8 vs one micro-batch vs torch.distributed.pipelining
    run pipeline_2ranks python -m autopar.launch --nproc_per_node 2 "$bench/bench_pipeline.py"
    # 4 stages (two per rank for the interleaved schedules) against torch's interleaved ones
    run pipeline_4ranks python -m autopar.launch --nproc_per_node 4 "$bench/bench_pipeline.py"
    run scaling_1rank   python -m autopar.launch --nproc_per_node 1 "$bench/bench_scaling.py" --reps 7
    run scaling_2ranks  python -m autopar.launch --nproc_per_node 2 "$bench/bench_scaling.py"
    run scaling_4ranks  python -m autopar.launch --nproc_per_node 4 "$bench/bench_scaling.py"
    run resnet_2ranks  python -m autopar.launch --nproc_per_node 2 "$bench/bench_resnet.py"
    # a Mixtral MoE layer under expert parallel against the same dispatch by hand (all_to_all_single)
    run moe_2ranks     python -m autopar.launch --nproc_per_node 2 "$bench/bench_moe.py"
    # context parallel attention: ring and Ulysses against attention on gathered K/V
    run cp_2ranks      python -m autopar.launch --nproc_per_node 2 "$bench/bench_context_parallel.py" --seqs 4096,8192,16384
    run cp_4ranks      python -m autopar.launch --nproc_per_node 4 "$bench/bench_context_parallel.py" --seqs 8192,16384,32768
    # the planner's layout against the hand layout of parallelize_llama and plain dp, 8 ranks on 2 cores
    run plan_8ranks    python -m autopar.launch --nproc_per_node 8 "$bench/bench_plan.py"
    # predict_step against measured steps (it launches each case itself)
    run predict        python "$bench/bench_predict.py"
done
