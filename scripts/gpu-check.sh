#!/usr/bin/env bash
# The GPU check, on a machine with a CUDA GPU, PyTorch and no Rust:
#   scripts/gpu-check.sh BUNDLE.tar.xz [LOG_DIR] [PART...]
# PART: suite, bench, train, sanitize, all (the default), or a command.
# BUNDLE comes from scripts/build-gpu-bundle.sh. Runs every test in the
# bundle with --include-ignored (the GPU suite), then `bench gpu` from the
# repository's root (so that it finds examples/pytorch/), then short trainer
# runs on one GPU (MLP and GPT, stages 0-3, f32 and bf16, 20 steps each, one
# rank on NCCL and four sharing the GPU with --backend cuda-threads, 38
# runs: the table shows each one's final loss), logging each to LOG_DIR (default:
# a temporary folder). `suite`, `bench` or `train` runs only that part;
# `sanitize` (not part of `all`) runs the tests of failing ranks and of
# teardown with gathers in flight under `compute-sanitizer` (memcheck: no
# CUDA error but the failure each test expects, no access to freed memory);
# anything else is run as a command inside the unpacked bundle (e.g.
# "./train --backend nccl --model gpt --steps 20"); several parts run in
# the order given (e.g. suite "./bench gpu-stage3": one device call).
# Exits non-zero if any test binary or the bench failed or was skipped;
# the last lines printed are the failures found in the logs and a table
# of what passed.
# Each run is stopped after GPU_CHECK_RUN_TIMEOUT seconds (default 600; rc
# 124 in the table), each test binary after GPU_CHECK_TEST_TIMEOUT (default
# 240: the slowest, gpu_hub.rs on a third of its fixtures, takes 74 s on
# an H200), so that one hung test leaves time for the rest; with GPU_CHECK_DEADLINE=SECONDS, also when that many
# seconds have passed since the script started, and the runs after it are
# skipped (rc "-" in the table), so that the table and the archive are
# written within a device call's limit; GPU_CHECK_ARCHIVE=FILE.tar.xz packs
# every log into FILE at the end. GPU_CHECK_SKIP names test binaries the
# suite leaves out (rc "-"), e.g. "zero-candle.gpu_hub" where the tree
# came without the hub fixtures (74 MB: over the device tool's 64 MiB with
# the bundle).
set -uo pipefail
cd "$(dirname "$0")/.."
bundle="$(realpath "${1:?usage: $0 BUNDLE.tar.xz [LOG_DIR] [suite|bench|train|all|CMD]...}")"
logs="$(realpath -m "${2:-$(mktemp -d)}")"
parts=("${@:3}")
[[ ${#parts[@]} -eq 0 ]] && parts=(all)
mkdir -p "$logs"
root="$(pwd)"
export ZERO_PYTORCH_DIR="$root/examples/pytorch"
unpacked="$(mktemp -d)"
tar -C "$unpacked" -xJf "$bundle" || exit 1

# cudarc and Candle open libnccl.so, libnvrtc.so, libcublas.so... by those
# names: PyTorch's wheels ship only the versioned files.
nvidia="$(python3 -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null)"
links="$unpacked/lib"
mkdir -p "$links"
if [[ -n "$nvidia" ]]; then
    for lib in nccl nvrtc cublas cublasLt curand cudart; do
        file="$(find "$nvidia" -name "lib$lib.so.*" | sort | head -1)"
        [[ -n "$file" ]] && ln -sf "$file" "$links/lib$lib.so"
    done
    dirs="$(find "$nvidia" -name 'lib*.so*' -printf '%h\n' | sort -u | paste -sd:)"
    export LD_LIBRARY_PATH="$links:$dirs:${LD_LIBRARY_PATH:-}"
else
    echo "warning: python3 has no nvidia packages (PyTorch's CUDA wheels); relying on the system's CUDA libraries"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$logs/gpu.txt"

# The tests keep the build machine's CARGO_TARGET_TMPDIR (nvrtc_ptx writes there).
for t in "$unpacked"/t/*; do
    dir="$(grep -a -o -m1 '/[A-Za-z0-9_./+-]*/target/cuda-[0-9.]*/tmp' "$t" | head -1 || true)"
    [[ -n "$dir" ]] && mkdir -p "$dir"
done

declare -a table
failed=0
run() {
    local name="$1"
    shift
    local start=$SECONDS
    local limit="${RUN_LIMIT:-${GPU_CHECK_RUN_TIMEOUT:-600}}"
    if [[ -n "${GPU_CHECK_DEADLINE:-}" ]]; then
        local left=$((GPU_CHECK_DEADLINE - SECONDS))
        if ((left < 5)); then
            table+=("$(printf '%-34s rc=%-3s %4ss  %s' "$name" - 0 "skipped: GPU_CHECK_DEADLINE")")
            failed=1
            return
        fi
        ((left < limit)) && limit=$left
    fi
    # A hung run (a collective a peer never joins) fails alone, not the check.
    timeout -k 5 "$limit" "$@" >"$logs/$name.log" 2>&1
    local rc=$?
    local summary
    summary="$(grep -E '^test result:|^done: final loss' "$logs/$name.log" | tail -1)"
    table+=("$(printf '%-34s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$summary")")
    if [[ $rc -ne 0 ]]; then
        failed=1
        echo "== $name failed (rc $rc); its failures:"
        grep -E -A25 '^failures:|panicked at' "$logs/$name.log" | head -60
    fi
}

# Stage 3 shards every weight (the trainer keeps small ones whole by
# default, and these models' are all small).
stage3_args() {
    [[ "$1" == 3 ]] && echo "--persist-numel 0"
}

extra=0
for what in "${parts[@]}"; do
    if [[ "$what" == all || "$what" == suite ]]; then
        for t in "$unpacked"/t/*; do
            if [[ " ${GPU_CHECK_SKIP:-} " == *" $(basename "$t") "* ]]; then
                table+=("$(printf '%-34s rc=%-3s %4ss  %s' "$(basename "$t")" - 0 "skipped: GPU_CHECK_SKIP")")
                continue
            fi
            RUN_LIMIT="${GPU_CHECK_TEST_TIMEOUT:-240}" \
                run "$(basename "$t")" "$t" --include-ignored --test-threads=1
        done
    fi
    if [[ "$what" == all || "$what" == bench ]]; then
        run bench-gpu "$unpacked/bench" gpu
        [[ -f "$logs/bench-gpu.log" ]] && grep -E 'gpu\.|failed|skipped' "$logs/bench-gpu.log" | tail -40
    fi
    if [[ "$what" == all || "$what" == train ]]; then
        for model in mlp gpt; do
            for stage in 0 1 2 3; do
                for precision in f32 bf16; do
                    run "train-$model-s$stage-$precision" env RANK=0 WORLD_SIZE=1 \
                        "$unpacked/train" --backend nccl --model "$model" --stage "$stage" \
                        --precision "$precision" --steps 20 $(stage3_args "$stage")
                done
            done
            # ZeRO-Offload: the optimizer's side in host memory (stepped after
            # backward here; each bucket as it lands is the default below).
            for precision in f32 bf16; do
                run "train-$model-s2-$precision-offload" env RANK=0 WORLD_SIZE=1 \
                    "$unpacked/train" --backend nccl --model "$model" --stage 2 \
                    --precision "$precision" --offload optimizer --overlap after-backward --steps 20
            done
            run "train-$model-s2-bf16-offload-interleaved" env RANK=0 WORLD_SIZE=1 \
                "$unpacked/train" --backend nccl --model "$model" --stage 2 --precision bf16 \
                --offload optimizer --overlap interleaved --steps 20
            run "train-$model-s2-bf16-offload-copy-stream" env RANK=0 WORLD_SIZE=1 \
                "$unpacked/train" --backend nccl --model "$model" --stage 2 --precision bf16 \
                --offload optimizer --overlap interleaved --offload-copy-stream --steps 20
            run "train-$model-s3-bf16-offload" env RANK=0 WORLD_SIZE=1 \
                "$unpacked/train" --backend nccl --model "$model" --stage 3 --precision bf16 \
                --offload optimizer --steps 20 $(stage3_args 3)
            # Four ranks sharing the GPU (no NCCL): the sharded paths at N > 1.
            for run_args in "0 f32" "1 bf16" "2 f32" "2 bf16" "3 f32" "3 bf16"; do
                read -r stage precision <<<"$run_args"
                run "train-$model-s$stage-$precision-n4" "$unpacked/train" --backend cuda-threads \
                    --world-size 4 --model "$model" --stage "$stage" --precision "$precision" \
                    --steps 20 $(stage3_args "$stage")
            done
        done
    fi
    if [[ "$what" == sanitize ]]; then
        for check in \
            "zero-candle.gpu_stage3 a_rank_failing_mid_forward_fails_its_peers_and_leaves_the_gpu_sound" \
            "zero-candle.gpu_stage3 a_stage_3_optimizer_dropped_right_after_a_forward_or_a_step_leaves_the_gpu_sound" \
            "zero-nccl.gpu_threads a_rank_that_dies_mid_forward_fails_its_peers_stage_3_gathers" \
            "zero-nccl.gpu_threads a_rank_that_panics_fails_its_peers_within_the_deadline" \
            "zero-nccl.gpu_threads different_calls_fail_every_rank_with_a_mismatch"; do
            read -r binary test <<<"$check"
            run "sanitize-$test" compute-sanitizer --tool memcheck --error-exitcode 99 \
                "$unpacked/t/$binary" --include-ignored --test-threads=1 --exact "$test"
        done
    fi
    if [[ "$what" != all && "$what" != suite && "$what" != bench && "$what" != train && "$what" != sanitize ]]; then
        extra=$((extra + 1))
        run "extra-$extra" bash -c "cd '$unpacked' && $what"
        [[ -f "$logs/extra-$extra.log" ]] && tail -30 "$logs/extra-$extra.log"
    fi
done
cd "$root"
# What failed, from every log (a bench reports a failed case and goes on,
# then exits 1), before the table, so that both fit a short tail.
echo "== failures in $logs:"
found="$(grep -H -E 'failed: |panicked at|case\(s\) failed' "$logs"/*.log 2>/dev/null | head -60)"
echo "${found:-(none)}"
printf '%s\n' "${table[@]}"
# GPU_CHECK_ARCHIVE=FILE.tar.xz: every log in one file (a device call
# brings back few files).
if [[ -n "${GPU_CHECK_ARCHIVE:-}" ]]; then
    tar -C "$logs" -cJf "$GPU_CHECK_ARCHIVE" . && echo "logs: $GPU_CHECK_ARCHIVE"
fi
exit $failed
