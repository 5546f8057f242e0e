#!/usr/bin/env bash
# Builds the MPI tests with `--features mpi` and runs them under mpirun with
# 2, 3 and 4 ranks, then checks the failure path: a rank that panics (or gives
# up on an error) ends the whole job, non-zero, within seconds, naming itself.
# Then the trainer under mpirun: parity with the thread backend, the overlap
# schedules bitwise equal, checkpoints across backends, failing cleanly.
# Fails on the first error. Needs Open MPI (scripts/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

command -v mpirun >/dev/null || {
    echo "test-mpi: mpirun not found; run scripts/install-deps.sh" >&2
    exit 1
}

# Containers: no CMA/ptrace for vader's single-copy path; more ranks than cores.
export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
export OMPI_MCA_rmaps_base_oversubscribe=1
MPIRUN=(mpirun --oversubscribe --allow-run-as-root)
TIMEOUT=${TEST_MPI_TIMEOUT:-600}

# Unit tests, and the MPI tests run alone (they print why they skip).
cargo test -p zero-mpi-gloo --features mpi

# Test binaries (test profile, optimized) and the failure example.
json=$(cargo test -p zero-mpi-gloo --features mpi --no-run --message-format=json)
tests=$(printf '%s\n' "$json" | grep '"executable":"' | grep '"kind":\["test"\]' |
    sed -E 's/.*"executable":"([^"]+)".*/\1/')
[ -n "$tests" ] || { echo "test-mpi: no test binaries were built" >&2; exit 1; }
cargo build -p zero-mpi-gloo --features mpi --example mpi_fail
target_dir=${CARGO_TARGET_DIR:-target}
fail_bin=$target_dir/debug/examples/mpi_fail

for n in 2 3 4; do
    for t in $tests; do
        echo "== mpirun -n $n $(basename "$t")"
        timeout "$TIMEOUT" "${MPIRUN[@]}" -n "$n" "$t"
    done
done

# The failure path: must exit non-zero, quickly, with the failed rank named.
for mode in panic error hang hang-async hang-at-exit; do
    echo "== failure path ($mode): rank 1 fails, the job must end"
    want="rank 1 failed"
    # A hanging rank is caught by the others' deadline (2 s in mpi_fail),
    # in a collective (blocking, or asynchronous on the progress thread) or
    # in MPI_Finalize.
    [ "$mode" = hang ] && want="did not complete within"
    [ "$mode" = hang-async ] && want="all_reduce_async #[0-9]* did not complete within"
    [ "$mode" = hang-at-exit ] && want="MPI_Finalize #[0-9]* did not complete within"
    set +e
    out=$(timeout 60 "${MPIRUN[@]}" -n 3 "$fail_bin" "$mode" 2>&1)
    status=$?
    set -e
    if [ "$status" -eq 0 ]; then
        echo "$out"; echo "test-mpi: the job exited 0 after rank 1 failed" >&2; exit 1
    fi
    if [ "$status" -eq 124 ]; then
        echo "$out"; echo "test-mpi: the job hung after rank 1 failed ($mode)" >&2; exit 1
    fi
    if ! grep -q "$want" <<<"$out"; then
        echo "$out"; echo "test-mpi: no '$want' in the output ($mode)" >&2; exit 1
    fi
    echo "ok: exit $status, $(grep -m1 "$want" <<<"$out")"
done

# The trainer under mpirun trains the same weights as the thread backend at
# the same world size (the ring adds in another order: float noise only).
cargo build -p zero-examples --features mpi --bin train --bin weights-diff
train=$target_dir/debug/train
diff=$target_dir/debug/weights-diff
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--hidden 16 --optimizer adam --lr 0.01 --seed 3 --quiet)
for n in 2 3 4; do
    for stage in 0 1 2; do
        echo "== trainer parity: mpirun -n $n vs threads, stage $stage"
        timeout "$TIMEOUT" "${MPIRUN[@]}" -n "$n" "$train" --backend mpi --stage "$stage" \
            "${common[@]}" --steps 8 --batch-size 8 --save "$work/mpi.safetensors"
        "$train" --backend threads --world-size "$n" --stage "$stage" "${common[@]}" \
            --steps 8 --batch-size 8 --save "$work/threads.safetensors"
        "$diff" "$work/mpi.safetensors" "$work/threads.safetensors" --tol 1e-5
    done
done

# Hybrid sharding under mpirun: groups of two of four ranks (and `node`,
# Open MPI's local size: all four here, one group) train the weights of full
# sharding on threads; a checkpoint saved in groups resumes without them.
for stage in 2 3; do
    echo "== shard groups: mpirun -n 4, stage $stage, vs threads"
    hybrid=("${common[@]}" --stage "$stage" --steps 8 --batch-size 8 --persist-numel 64)
    for group in 2 node; do
        timeout "$TIMEOUT" "${MPIRUN[@]}" -n 4 "$train" --backend mpi "${hybrid[@]}" \
            --shard-group "$group" --save "$work/mpi-g$group.safetensors"
    done
    "$train" --backend threads --world-size 4 "${hybrid[@]}" --save "$work/threads-full.safetensors"
    for group in 2 node; do
        "$diff" "$work/mpi-g$group.safetensors" "$work/threads-full.safetensors" --tol 1e-5
    done
done
rm -rf "$work/groups-ckpt"
timeout "$TIMEOUT" "${MPIRUN[@]}" -n 4 "$train" --backend mpi "${common[@]}" --stage 2 --steps 4 \
    --batch-size 8 --shard-group 2 --checkpoint-dir "$work/groups-ckpt" --checkpoint-every 4
"$train" --backend threads --world-size 2 "${common[@]}" --stage 2 --steps 8 --batch-size 16 \
    --resume "$work/groups-ckpt" --save "$work/resumed.safetensors"
"$train" --backend threads --world-size 4 "${common[@]}" --stage 2 --steps 8 --batch-size 8 \
    --save "$work/straight.safetensors"
"$diff" "$work/resumed.safetensors" "$work/straight.safetensors" --tol 1e-4

# The three overlap schedules train bitwise-identical weights under mpirun:
# the same collectives over the same buckets, issued at other times and from
# the engine's communication thread. Tiny buckets (--bucket-mb 0.0002, about
# 50 elements) make many of them; with 3 ranks, --grad-accum 2 (stage 2
# reduce-scatters every micro-step). Interleaved cannot clip, so no case
# clips. `cmp` holds the files to the bit (`--tol 0` lets -0.0 equal 0.0).
overlap_common=(--hidden 16,16 --optimizer adam --lr 0.01 --seed 5 --quiet --steps 4
    --batch-size 6 --bucket-mb 0.0002)
for n in 2 3; do
    accum=1
    [ "$n" = 3 ] && accum=2
    for stage in 0 1 2; do
        echo "== overlap schedules: mpirun -n $n, stage $stage, --grad-accum $accum, bitwise"
        for overlap in none after-backward interleaved; do
            timeout "$TIMEOUT" "${MPIRUN[@]}" -n "$n" "$train" --backend mpi --stage "$stage" \
                "${overlap_common[@]}" --grad-accum "$accum" --overlap "$overlap" \
                --save "$work/overlap-$overlap.safetensors"
        done
        for overlap in after-backward interleaved; do
            "$diff" "$work/overlap-none.safetensors" "$work/overlap-$overlap.safetensors" --tol 0
            cmp "$work/overlap-none.safetensors" "$work/overlap-$overlap.safetensors"
        done
        # Stages 1 and 2 can leave a step's all-gathers to a thread of
        # their own, running into the next forward: the same weights.
        if [ "$stage" != 0 ]; then
            timeout "$TIMEOUT" "${MPIRUN[@]}" -n "$n" "$train" --backend mpi --stage "$stage" \
                "${overlap_common[@]}" --grad-accum "$accum" --defer-gathers \
                --save "$work/overlap-deferred.safetensors"
            cmp "$work/overlap-none.safetensors" "$work/overlap-deferred.safetensors"
        fi
    done
done

# Stage 3 under mpirun trains the weights of stage 2 under mpirun,
# bitwise, and agrees with the threads. With MPI_THREAD_MULTIPLE (Debian's
# Open MPI provides it) the gathers run on their own thread and
# communicator beside the reductions: every request of a sharded layer
# found its gather issued ahead (rank 0's counts in the last metrics line).
for n in 2 3; do
    echo "== stage 3: mpirun -n $n vs stage 2 (bitwise) and vs threads"
    s3_common=(--hidden 16,16 --optimizer adam --lr 0.01 --seed 4 --quiet --steps 5
        --batch-size 6 --bucket-mb 0.0005 --persist-numel 64)
    for stage in 2 3; do
        timeout "$TIMEOUT" "${MPIRUN[@]}" -n "$n" "$train" --backend mpi --stage "$stage" \
            "${s3_common[@]}" --save "$work/mpi-s$stage.safetensors" \
            --metrics "$work/mpi-s$stage.jsonl"
    done
    "$diff" "$work/mpi-s2.safetensors" "$work/mpi-s3.safetensors" --tol 0
    "$train" --backend threads --world-size "$n" --stage 3 "${s3_common[@]}" \
        --save "$work/threads-s3.safetensors" --metrics "$work/threads-s3.jsonl"
    "$diff" "$work/mpi-s3.safetensors" "$work/threads-s3.safetensors" --tol 1e-5
    python3 - "$work/mpi-s3.jsonl" "$work/threads-s3.jsonl" <<'PY'
import json, sys
mpi, threads = (json.loads(open(p).read().splitlines()[-1])["gathers"] for p in sys.argv[1:])
assert mpi["on_thread"], f"stage 3 gathered on the caller's thread under mpirun: {mpi}"
assert mpi["prefetch_misses"] == 0 and mpi["prefetch_hits"] > 0, mpi
assert mpi == threads, f"under mpirun {mpi}, on threads {threads}"
print("stage 3 gathers under mpirun, as on threads:", mpi)
PY
    # Layers gathered in 256-byte pieces (split rows sum in another order:
    # f32 rounding apart).
    timeout "$TIMEOUT" "${MPIRUN[@]}" -n "$n" "$train" --backend mpi --stage 3 \
        "${s3_common[@]}" --gather-mb 0.000244140625 --save "$work/mpi-s3-pieces.safetensors"
    "$diff" "$work/mpi-s2.safetensors" "$work/mpi-s3-pieces.safetensors" --tol 1e-5
done

# 16-bit models with f32 master weights (and f16 loss scaling) train under
# mpirun as on threads (the ring adds in another order: a 16-bit rounding
# step at most), stage 3 included (it gathers the masters; `common`'s
# hidden layer of 16 is sharded by --persist-numel 0, ignored below stage 3).
for precision in "bf16 --stage 2" "f16 --stage 1" "bf16 --stage 3"; do
    read -r p stage_flag stage <<<"$precision"
    echo "== trainer parity, --precision $p: mpirun -n 2 vs threads, stage $stage"
    timeout "$TIMEOUT" "${MPIRUN[@]}" -n 2 "$train" --backend mpi "$stage_flag" "$stage" \
        --precision "$p" --persist-numel 0 "${common[@]}" --steps 8 --batch-size 8 \
        --save "$work/mpi16.safetensors"
    "$train" --backend threads --world-size 2 "$stage_flag" "$stage" --precision "$p" \
        --persist-numel 0 "${common[@]}" --steps 8 --batch-size 8 \
        --save "$work/threads16.safetensors"
    "$diff" "$work/mpi16.safetensors" "$work/threads16.safetensors" --tol 0.02
done

# A checkpoint saved under MPI resumes under threads, at another world size
# and stage with the same global batch, within float noise of a run that
# never stopped.
echo "== checkpoint: saved by mpirun -n 4 (stage 2), resumed on 2 threads (stage 1)"
timeout "$TIMEOUT" "${MPIRUN[@]}" -n 4 "$train" --backend mpi --stage 2 "${common[@]}" \
    --steps 4 --batch-size 8 --checkpoint-dir "$work/ckpt" --checkpoint-every 4
"$train" --backend threads --world-size 2 --stage 1 "${common[@]}" --steps 8 --batch-size 16 \
    --resume "$work/ckpt" --save "$work/resumed.safetensors"
"$train" --backend threads --world-size 4 --stage 2 "${common[@]}" --steps 8 --batch-size 8 \
    --save "$work/straight.safetensors"
"$diff" "$work/resumed.safetensors" "$work/straight.safetensors" --tol 1e-4

# A failing rank under the trainer ends the job with its reason.
echo "== trainer: a bad --init on every rank ends the job with the reason"
set +e
out=$(timeout 120 "${MPIRUN[@]}" -n 2 "$train" --backend mpi --init /nonexistent.safetensors 2>&1)
status=$?
set -e
if [ "$status" -eq 0 ] || [ "$status" -eq 124 ] || ! grep -q "nonexistent.safetensors" <<<"$out"; then
    echo "$out"; echo "test-mpi: the trainer did not fail cleanly (exit $status)" >&2; exit 1
fi

echo "test-mpi: all passed"
