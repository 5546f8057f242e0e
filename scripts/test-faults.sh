#!/usr/bin/env bash
# Faults as users meet them, each bounded in time (a hang fails the script,
# it never blocks CI):
#  1. `kill -9` of one rank under `mpirun -n 3` mid-step: the job exits
#     non-zero within 10 s.
#  2. `kill -STOP` of one rank with `--timeout-s 5`: the job exits non-zero
#     within 15 s, and the message names the collective and says what to
#     check. And the converse: stopping every rank for longer than the
#     deadline (a suspended job) and continuing them must not end the job.
#  3. The trainer killed with `kill -9` at random moments while it saves a
#     checkpoint every step into step directories, keeping 3 (threads, then
#     `mpirun -n 2`), resumed each time with `--resume DIR`: after at least
#     15 kills the final weights are bitwise equal to an uninterrupted
#     run's; after every kill `latest` names a complete checkpoint no older
#     than the one the run resumed from, and every manifest points only at
#     files that exist with the recorded length and checksum; at the end no
#     temporary file or half-removed step directory is left, and at most 3
#     step directories. Then the same with `--checkpoint-async` (threads):
#     kills land while the writer threads write in the background, and
#     `latest` must still only ever name a complete checkpoint.
#  4. Preemption: SIGTERM to the trainer (threads), SIGUSR1 to one rank or
#     to mpirun (`mpirun -n 2`) at a random step: exit 143 within 30 s, the
#     step and the resume command printed, `latest` on that step, and the
#     resumed run's weights bitwise equal to an uninterrupted run's; two
#     SIGTERMs back to back exit at once, leaving a loadable checkpoint.
#
# FAULTS_SEED=<n> replays the kill moments of an earlier run (it is printed).
# FAULTS_KILLS=<n> sets the kills per backend (default 15);
# FAULTS_PREEMPTS=<n> the preemptions per case (default 3).
# Needs Open MPI (scripts/install-deps.sh), python3 and pgrep. Run from
# anywhere; takes about 90 s on 2 cores once built. The trainer is the
# dev-profile build that scripts/test-mpi.sh makes (same packages and
# features), so that the test suite does not build every dependency again
# in release.
set -euo pipefail
cd "$(dirname "$0")/.."

for tool in mpirun python3 pgrep timeout; do
    command -v "$tool" >/dev/null || {
        echo "test-faults: $tool not found; install it (mpirun: scripts/install-deps.sh;" \
            "python3, pgrep (procps), timeout (coreutils): apt-get install python3 procps coreutils)" >&2
        exit 1
    }
done

# Same launcher conventions as scripts/test-mpi.sh: containers have no
# CMA/ptrace for vader's single-copy path, more ranks than cores, CI as root.
export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
export OMPI_MCA_rmaps_base_oversubscribe=1
MPIRUN=(mpirun --oversubscribe --allow-run-as-root)
MIN_KILLS=${FAULTS_KILLS:-15}
seed=${FAULTS_SEED:-$(( $(date +%s) % 100000 ))}
RANDOM=$seed
script_start=$(date +%s.%N)

echo "== building train and weights-diff (dev profile, --features mpi)"
json=$(cargo build -p zero-examples --features mpi --bin train --bin weights-diff \
    --message-format=json)
executable() {
    printf '%s\n' "$json" | grep -o "\"executable\":\"[^\"]*/$1\"" | sed -E 's/.*:"(.*)"/\1/' | tail -1
}
train=$(executable train)
diff_bin=$(executable weights-diff)
[ -x "$train" ] && [ -x "$diff_bin" ] || {
    echo "test-faults: cargo built no train/weights-diff executables" >&2
    exit 1
}

work=$(mktemp -d)
# The processes of the current check (this script's jobs and the ranks of
# its mpirun), so that a failing check leaves nothing running, or stopped,
# behind. Emptied once a check has seen them all end, so that a pid the
# system has since reused is never signalled.
started=()
cleanup() {
    local pid cmdline
    for pid in "${started[@]}"; do
        cmdline=$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" || true)
        case "$cmdline" in
        *"$train"* | mpirun* | *test-faults.sh*) ;;
        *) continue ;;
        esac
        kill -CONT "$pid" 2>/dev/null || true
        kill -9 "$pid" 2>/dev/null || true
    done
    rm -rf "$work"
}
trap cleanup EXIT

fail() {
    echo "test-faults: FAILED: $*" >&2
    exit 1
}
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
le() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a <= b) }'; }
# sleep_ms N
sleep_ms() { sleep "$(awk -v ms="$1" 'BEGIN { printf "%.3f", ms / 1000 }')"; }

# wait_bounded PID SECONDS [keep]: waits for PID (a child of this shell) and
# sets `status`; returns 1 if it still runs after SECONDS, after killing it
# unless `keep` is given.
wait_bounded() {
    local pid=$1 limit=$2 keep=${3:-} start
    start=$(now)
    while kill -0 "$pid" 2>/dev/null; do
        if ! le "$(elapsed "$start")" "$limit"; then
            if [ -z "$keep" ]; then
                kill -9 "$pid" 2>/dev/null || true
                wait "$pid" 2>/dev/null || true
            fi
            return 1
        fi
        sleep 0.05
    done
    set +e
    wait "$pid"
    status=$?
    set -e
}

# rank_pid MPIRUN_PID RANK: the pid of that world rank, once mpirun has
# started it (empty if it has not).
rank_pid() {
    local p r
    for p in $(pgrep -P "$1" || true); do
        r=$(tr '\0' '\n' 2>/dev/null <"/proc/$p/environ" | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')
        if [ "$r" = "$2" ]; then
            echo "$p"
            return
        fi
    done
}

# children_gone PID: whether every child of PID has exited (or is a zombie
# PID has not reaped).
children_gone() {
    local children
    children=$(pgrep -P "$1" || true)
    [ -z "$children" ] || gone $children
}

# wait_for_ranks MPIRUN_PID N: the pids of ranks 0..N-1, waiting (at most
# 30 s) until mpirun has started them all.
wait_for_ranks() {
    local start r pid pids
    start=$(now)
    while le "$(elapsed "$start")" 30; do
        pids=()
        for ((r = 0; r < $2; r++)); do
            pid=$(rank_pid "$1" "$r")
            [ -n "$pid" ] && pids+=("$pid")
        done
        if [ "${#pids[@]}" -eq "$2" ]; then
            echo "${pids[@]}"
            return
        fi
        kill -0 "$1" 2>/dev/null || fail "mpirun ended before starting its $2 ranks"
        sleep 0.05
    done
    fail "mpirun did not start $2 ranks within 30 s"
}

# spawn LOG COMMAND...: runs COMMAND in the background (stderr to LOG) under
# a wrapper subshell, whose pid is $!. The wrapper turns a kill -9 of the
# command into an exit status of 137, without the shell's "Killed" notice.
spawn() {
    local log=$1
    shift
    ("$@" 2>"$log"; exit $?) 2>/dev/null &
}

# gone PID...: whether every PID has exited (a zombie has: it runs nothing).
gone() {
    local pid state
    for pid in "$@"; do
        state=$(ps -o stat= -p "$pid" 2>/dev/null || true)
        [ -z "$state" ] || [ "${state:0:1}" = Z ] || return 1
    done
}

# wait_gone PID...: waits (at most 10 s) until every PID has exited: the
# ranks of a job that ended must not outlive it.
wait_gone() {
    local start
    start=$(now)
    until gone "$@"; do
        le "$(elapsed "$start")" 10 || fail "rank(s) $* still run 10 s after their job ended"
        sleep 0.05
    done
}

long_run=(--hidden 8 --batch-size 8 --steps 100000000 --quiet)

# --- 1. kill -9 of one rank ----------------------------------------------
echo "== kill -9 of rank 1 under mpirun -n 3, mid-step: the job must exit non-zero within 10 s"
"${MPIRUN[@]}" -n 3 "$train" --backend mpi "${long_run[@]}" >"$work/kill.log" 2>&1 &
job=$!
started+=("$job")
read -r -a ranks <<<"$(wait_for_ranks "$job" 3)"
[ "${#ranks[@]}" -eq 3 ] || fail "could not find the 3 ranks of mpirun $job"
started+=("${ranks[@]}")
sleep 1.5 # well into training (startup takes well under a second)
kill -0 "$job" 2>/dev/null || { cat "$work/kill.log"; fail "the job ended before the kill"; }
kill -9 "${ranks[1]}"
t0=$(now)
wait_bounded "$job" 10 || { cat "$work/kill.log"; fail "the job still ran 10 s after rank 1 was killed"; }
took=$(elapsed "$t0")
[ "$status" -ne 0 ] || { cat "$work/kill.log"; fail "the job exited 0 after rank 1 was killed"; }
wait_gone "${ranks[@]}"
started=()
echo "ok: exit $status ${took} s after the kill"

# --- 2. kill -STOP of one rank, and of every rank --------------------------
echo "== kill -STOP of rank 1 under mpirun -n 3 with --timeout-s 5: the job must exit non-zero"
echo "   within 15 s, naming the collective and saying what to check"
"${MPIRUN[@]}" -n 3 "$train" --backend mpi "${long_run[@]}" --timeout-s 5 >"$work/stop.log" 2>&1 &
job=$!
started+=("$job")
read -r -a ranks <<<"$(wait_for_ranks "$job" 3)"
[ "${#ranks[@]}" -eq 3 ] || fail "could not find the 3 ranks of mpirun $job"
started+=("${ranks[@]}")
sleep 1.5
kill -0 "$job" 2>/dev/null || { cat "$work/stop.log"; fail "the job ended before the stop"; }
kill -STOP "${ranks[1]}"
t0=$(now)
wait_bounded "$job" 15 || { cat "$work/stop.log"; fail "the job still ran 15 s after rank 1 was stopped"; }
took=$(elapsed "$t0")
[ "$status" -ne 0 ] || { cat "$work/stop.log"; fail "the job exited 0 with rank 1 stopped"; }
collective='(all_reduce|reduce_scatter|all_gather|all_gather_bytes|all_gather_varlen|gather_varlen|broadcast|reduce|barrier|split|MPI_Finalize) #[0-9]+'
want="rank [02] failed: $collective did not complete within the 5.0 s deadline"
line=$(grep -E -m1 "$want" "$work/stop.log") ||
    { cat "$work/stop.log"; fail "no line matching '$want'"; }
grep -q "Check that every rank is still running" <<<"$line" ||
    { cat "$work/stop.log"; fail "the message does not say what to check"; }
grep -q -- "--timeout-s" <<<"$line" ||
    { cat "$work/stop.log"; fail "the message does not name --timeout-s"; }
if grep -q "rank 1 failed" "$work/stop.log"; then
    cat "$work/stop.log"
    fail "the stopped rank blamed its peers (its frozen time counted against the deadline)"
fi
le 4.9 "$took" || fail "the job ended ${took} s after the stop, before the 5 s deadline"
echo "ok: exit $status ${took} s after the stop; the first report:"
echo "   $line"
wait_gone "${ranks[@]}"
started=()

echo "== kill -STOP of every rank for 5 s with --timeout-s 2, then kill -CONT (a suspended job):"
echo "   the job must go on (time frozen is not time waited)"
"${MPIRUN[@]}" -n 2 "$train" --backend mpi "${long_run[@]}" --timeout-s 2 >"$work/suspend.log" 2>&1 &
job=$!
started+=("$job")
read -r -a ranks <<<"$(wait_for_ranks "$job" 2)"
[ "${#ranks[@]}" -eq 2 ] || fail "could not find the 2 ranks of mpirun $job"
started+=("${ranks[@]}")
sleep 1
kill -0 "$job" 2>/dev/null || { cat "$work/suspend.log"; fail "the job ended before the suspend"; }
kill -STOP "${ranks[@]}"
sleep 5
kill -CONT "${ranks[@]}"
sleep 4 # twice the deadline
kill -0 "$job" 2>/dev/null || { cat "$work/suspend.log"; fail "the job ended after the suspend"; }
kill -TERM "$job"
wait_bounded "$job" 10 || fail "mpirun still ran 10 s after kill -TERM"
wait_gone "${ranks[@]}"
started=()
if grep -q "failed" "$work/suspend.log"; then
    cat "$work/suspend.log"
    fail "a rank reported a failure after the suspend"
fi
echo "ok: still training 4 s after the suspend"

# --- 3. kill -9 while checkpointing, resume ---------------------------------
# KEEP: the --keep-checkpoints of the killed runs (prunes get killed too).
KEEP=3
# check_dir DIR MIN_STEP [final]: DIR holds step directories (`step-000123`)
# and `latest`. `latest`, if there is one, names a step of at least MIN_STEP
# (the step the attempt resumed from: a kill never moves it back) whose
# manifest records that step and lists only files that exist with the
# recorded length and SHA-256; so does every other step directory with a
# manifest. With `final`: `latest` must exist, no temporary file
# (`.<name>.tmp.<pid>.<n>`) may be left in its step directory or beside it,
# no half-removed step directory (`.step-N.removing`), and at most KEEP
# complete step directories.
check_dir() {
    KEEP=$KEEP python3 - "$@" <<'PY'
import hashlib, json, os, re, sys

root, min_step, final = sys.argv[1], int(sys.argv[2]), len(sys.argv) > 3
keep = int(os.environ["KEEP"])
temp = re.compile(r"\..+\.tmp\.\d+\.\d+")

def verify(ckpt, step):
    """The number of files the manifest of `ckpt` lists, all verified."""
    path = os.path.join(ckpt, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    files = manifest.get("files", {})
    info = manifest.get("checkpoint") or {}
    model = info.get("model_file")
    if not model or model not in files:
        sys.exit(f"{path}: model file {model!r} is not among the files it lists")
    saved = (info.get("user") or {}).get("step")
    if saved != step:
        sys.exit(f"{path}: records step {saved}, its directory says {step}")
    for name, record in files.items():
        p = os.path.join(ckpt, name)
        if not os.path.isfile(p):
            sys.exit(f"{path} points at {name}, which is missing")
        with open(p, "rb") as f:
            data = f.read()
        if len(data) != record["len"] or hashlib.sha256(data).hexdigest() != record["sha256"]:
            sys.exit(f"{path}: {name} has {len(data)} bytes / another checksum than recorded")
    return len(files)

names = sorted(os.listdir(root)) if os.path.isdir(root) else []
steps = {int(m.group(1)): n for n in names if (m := re.fullmatch(r"step-(\d+)", n))}
complete = sorted(s for s, n in steps.items()
                  if os.path.isfile(os.path.join(root, n, "manifest.json")))
for s in complete:
    verify(os.path.join(root, steps[s]), s)
summary = f"{len(complete)} complete step dir(s), {len(steps) - len(complete)} incomplete"
latest_path = os.path.join(root, "latest")
if not os.path.exists(latest_path):
    if final or min_step > 0:
        sys.exit(f"no {latest_path}")
    print(f"no latest yet; {summary}")
    sys.exit(0)
with open(latest_path) as f:
    text = f.read()
m = re.fullmatch(r"step-(\d{6,})\n", text)
if not m:
    sys.exit(f"{latest_path} holds {text!r}, not a step directory's name")
step = int(m.group(1))
if step not in complete:
    sys.exit(f"{latest_path} names step {step}, which is not a complete checkpoint ({summary})")
if step < min_step:
    sys.exit(f"{latest_path} went back from step {min_step} to {step}")
if final:
    left = [n for n in names if temp.fullmatch(n) or re.fullmatch(r"\.step-\d+\.removing", n)]
    left += [n for n in os.listdir(os.path.join(root, steps[step])) if temp.fullmatch(n)]
    if left:
        sys.exit(f"left behind in {root}: {left}")
    if len(complete) > keep:
        sys.exit(f"{len(complete)} complete step dirs, more than --keep-checkpoints {keep}")
print(f"latest at step {step}, verified; {summary}")
PY
}

# latest_step DIR: the step DIR/latest names (0 if none).
latest_step() {
    local text
    text=$(cat "$1/latest" 2>/dev/null || true)
    text=${text#step-}
    text=$(sed 's/^0*//' <<<"$text")
    echo "${text:-0}"
}

# kill_and_resume NAME STEPS LAUNCH...: trains STEPS steps with a checkpoint
# every step, killing the job with kill -9 at random moments and resuming it,
# until MIN_KILLS kills have landed; then lets it finish and compares its
# weights with an uninterrupted run's.
kill_and_resume() {
    local name=$1 steps=$2
    shift 2
    local launch=("$@")
    local dir="$work/$name"
    local common=(--hidden 8 --batch-size 8 --optimizer adam --lr 0.01 --seed 3 --quiet
        --steps "$steps" --timeout-s 30)
    mkdir -p "$dir"

    local t0 took
    t0=$(now)
    timeout 300 "${launch[@]}" "${common[@]}" --checkpoint-dir "$dir/reference-ckpt" \
        --checkpoint-every 1 --save "$dir/reference.safetensors" ||
        fail "$name: the uninterrupted run failed"
    took=$(elapsed "$t0")
    # Kill moments are drawn from the first third of an uninterrupted run,
    # so that they land in startup, loading, steps and saves alike.
    local window_ms
    window_ms=$(awk -v s="$took" 'BEGIN { printf "%d", s * 1000 / 3 + 1 }')
    echo "   uninterrupted run: ${took} s for $steps steps; kills within ${window_ms} ms of each start"

    local kills=0 rounds=0 attempts resume before delay victim pid state wrapper main r attempt_start
    local ranks candidates what
    local ckpt="$dir/ckpt"
    while [ "$kills" -lt "$MIN_KILLS" ]; do
        rounds=$((rounds + 1))
        rm -rf "$ckpt"
        attempts=0
        while true; do
            attempts=$((attempts + 1))
            [ "$attempts" -le 200 ] || fail "$name: no end after 200 restarts; is the checkpoint advancing?"
            resume=()
            if [ -f "$ckpt/latest" ] || compgen -G "$ckpt/step-*/manifest.json" >/dev/null; then
                resume=(--resume "$ckpt")
            fi
            before=$(latest_step "$ckpt")
            rm -f "$dir/final.safetensors"
            if [ "$kills" -ge "$MIN_KILLS" ]; then
                # Enough kills: this run must finish, within a bound.
                timeout 300 "${launch[@]}" "${common[@]}" --checkpoint-dir "$ckpt" \
                    --checkpoint-every 1 --keep-checkpoints "$KEEP" \
                    --save "$dir/final.safetensors" "${resume[@]}" ||
                    fail "$name: the last resumed run failed or hung (exit $?)"
                break
            fi
            spawn "$dir/attempt.log" "${launch[@]}" "${common[@]}" --checkpoint-dir "$ckpt" \
                --checkpoint-every 1 --keep-checkpoints "$KEEP" \
                --save "$dir/final.safetensors" "${resume[@]}"
            wrapper=$!
            attempt_start=$(now)
            started+=("$wrapper")
            delay=$(( (RANDOM * 32768 + RANDOM) % window_ms ))
            sleep_ms "$delay"
            # The trainer (or mpirun), once the wrapper has started it.
            main=""
            while [ -z "$main" ] && kill -0 "$wrapper" 2>/dev/null; do
                main=$(pgrep -P "$wrapper" || true)
                [ -n "$main" ] || sleep 0.01
            done
            ranks=()
            victim=""
            if [ -n "$main" ]; then
                started+=("$main")
                candidates=("$main")
                if [ "${launch[0]}" = mpirun ]; then
                    # mpirun itself or one of its ranks (those it has started).
                    for r in 0 1; do
                        pid=$(rank_pid "$main" "$r")
                        [ -n "$pid" ] && ranks+=("$pid")
                    done
                    started+=("${ranks[@]}")
                    candidates+=("${ranks[@]}")
                fi
                victim=${candidates[RANDOM % ${#candidates[@]}]}
                kill -9 "$victim" 2>/dev/null || true
            fi
            if ! wait_bounded "$wrapper" 30 keep; then
                # Open MPI 4.1's mpirun, its job aborted by a rank killed
                # while starting, can hang after every rank has exited
                # ("PMIX ERROR: UNREACHABLE"): the launcher's hang, not the
                # trainer's. Any rank still running is a failure.
                if [ "${launch[0]}" = mpirun ] && [ -n "$main" ] && kill -0 "$main" 2>/dev/null &&
                    children_gone "$main"; then
                    echo "   mpirun still ran 30 s after kill -9 of $victim with every rank exited" \
                        "(an mpirun hang after an abort at startup); killing mpirun"
                    kill -9 "$main" 2>/dev/null || true
                    wait_bounded "$wrapper" 10 || fail "$name: mpirun outlived kill -9"
                else
                    kill -9 "$wrapper" 2>/dev/null || true
                    fail "$name: the job still ran 30 s after kill -9 of $victim"
                fi
            fi
            wait_gone "${ranks[@]}"
            started=()
            if [ "$status" -eq 0 ]; then
                # It finished before the kill: this round is complete. A
                # whole run that fast (fsync times vary with the disk's
                # load) narrows the window, so that kills land mid-run again.
                if [ "$attempts" -eq 1 ]; then
                    took=$(elapsed "$attempt_start")
                    window_ms=$(awk -v s="$took" 'BEGIN { printf "%d", s * 1000 / 3 + 1 }')
                    echo "   a whole run took ${took} s, before its kill; kills now within ${window_ms} ms"
                fi
                break
            fi
            [ "$status" -eq 137 ] || {
                cat "$dir/attempt.log"
                fail "$name: a run exited $status, not killed by the test (137)"
            }
            kills=$((kills + 1))
            state=$(check_dir "$ckpt" "$before" 2>&1) || fail "$name: after kill $kills: $state"
            if [ "$victim" = "$main" ]; then
                what="$(basename "${launch[0]}")"
            else
                what="a rank"
            fi
            echo "   kill $kills ($what, ${delay} ms after the start): $state"
        done
        state=$(check_dir "$ckpt" "$steps" final 2>&1) || fail "$name: after the last run: $state"
        "$diff_bin" "$dir/final.safetensors" "$dir/reference.safetensors" --tol 0 >/dev/null ||
            fail "$name: the resumed weights differ from the uninterrupted run's:" \
                "$("$diff_bin" "$dir/final.safetensors" "$dir/reference.safetensors" --tol 0 2>&1)"
        echo "   round $rounds finished after $attempts start(s): weights bitwise equal to the" \
            "uninterrupted run's; $state"
    done
    echo "ok: $name: $kills kills in $rounds round(s)"
}

echo "== kill -9 at random moments while checkpointing every step, resumed each time"
echo "   (>= $MIN_KILLS kills per backend; random moments from FAULTS_SEED=$seed)"
echo "-- threads backend, world size 2"
kill_and_resume threads 150 "$train" --backend threads --world-size 2
echo "-- MPI backend, mpirun -n 2"
kill_and_resume mpi 50 "${MPIRUN[@]}" -n 2 "$train" --backend mpi
echo "-- threads backend, world size 2, background saves (--checkpoint-async)"
kill_and_resume threads-async 150 "$train" --backend threads --world-size 2 --checkpoint-async

# --- 4. preemption: a signal, then --resume ----------------------------------
# preempt_and_resume NAME STEPS TARGET LAUNCH...: PREEMPTS times, trains
# STEPS steps with --checkpoint-dir (no periodic checkpoint: only the
# preemption saves) and, at a random moment once it trains, signals TARGET:
# `trainer` (SIGTERM), `mpirun` (SIGUSR1, which mpirun forwards to every
# rank) or `rank` (SIGUSR1 to one rank alone: its peers must stop with it).
# The job must exit with 143 within 30 s, print the step it stopped after
# and the command that resumes, and leave `latest` on that step; resumed,
# it must end with an uninterrupted run's weights, bitwise. With `double`
# as TARGET: two SIGTERMs back to back while it checkpoints every step; the
# second exits at once (143), `latest` stays on a complete checkpoint, and
# the resumed run again ends bitwise equal.
preempt_and_resume() {
    local name=$1 steps=$2 target=$3
    shift 3
    local launch=("$@")
    local dir="$work/preempt-$name-$target"
    local common=(--hidden 8 --batch-size 8 --optimizer adam --lr 0.01 --seed 3
        --steps "$steps" --timeout-s 30)
    mkdir -p "$dir"
    local t0 took window_ms
    t0=$(now)
    timeout 300 "${launch[@]}" "${common[@]}" --quiet --save "$dir/reference.safetensors" ||
        fail "preempt $name: the uninterrupted run failed"
    took=$(elapsed "$t0")
    window_ms=$(awk -v s="$took" 'BEGIN { printf "%d", s * 1000 / 2 + 1 }')

    local ckpt="$dir/ckpt" log="$dir/run.log" preempted=0 tries=0
    local wrapper main victim signal delay step start every state resume
    every=()
    [ "$target" = double ] && every=(--checkpoint-every 1)
    while [ "$preempted" -lt "$PREEMPTS" ]; do
        tries=$((tries + 1))
        [ "$tries" -le 20 ] || fail "preempt $name: no preemption landed in 20 tries"
        rm -rf "$ckpt" "$dir/final.safetensors"
        spawn "$log" "${launch[@]}" "${common[@]}" --checkpoint-dir "$ckpt" "${every[@]}" \
            --save "$dir/final.safetensors"
        wrapper=$!
        started+=("$wrapper")
        # Rank 0 logs step 1: the handlers are in place and it trains.
        start=$(now)
        until grep -q "^step 1:" "$log" 2>/dev/null; do
            kill -0 "$wrapper" 2>/dev/null || { cat "$log"; fail "preempt $name: the run ended before step 1"; }
            le "$(elapsed "$start")" 30 || fail "preempt $name: no step 1 within 30 s"
            sleep 0.01
        done
        delay=$(( (RANDOM * 32768 + RANDOM) % window_ms ))
        sleep_ms "$delay"
        main=$(pgrep -P "$wrapper" || true)
        [ -n "$main" ] && started+=("$main")
        signal=USR1 victim=""
        if [ -n "$main" ]; then
            case $target in
            trainer | double) victim=$main signal=TERM ;;
            mpirun) victim=$main ;;
            rank) victim=$(rank_pid "$main" $((RANDOM % 2))) ;;
            esac
        fi
        if [ -n "$victim" ]; then
            kill -"$signal" "$victim" 2>/dev/null || true
            [ "$target" = double ] && { kill -TERM "$victim" 2>/dev/null || true; }
        fi
        wait_bounded "$wrapper" 30 || { cat "$log"; fail "preempt $name: still ran 30 s after SIG$signal"; }
        started=()
        # It finished before the signal (or the signal reached mpirun after
        # rank 0 logged `done:`, while it collected the ranks: Open MPI no
        # longer forwards it then and dies of it): a narrower window.
        if [ "$status" -eq 0 ] || { [ "$status" -gt 128 ] && grep -q "^done:" "$log"; }; then
            window_ms=$((window_ms / 2 + 1))
            continue
        fi
        [ "$status" -eq 143 ] || { cat "$log"; fail "preempt $name: exit $status after SIG$signal, not 143"; }
        if [ "$target" = double ]; then
            state=$(check_dir "$ckpt" 0 2>&1) || fail "preempt $name: after two signals: $state"
            step=$(latest_step "$ckpt")
        else
            step=$(sed -n 's/^preempted: stopped after step \([0-9]*\) of .*/\1/p' "$log")
            [ -n "$step" ] || { cat "$log"; fail "preempt $name: no 'preempted: stopped after step' line"; }
            grep -q -- "^resume with.*: .* --resume $ckpt\$" "$log" ||
                { cat "$log"; fail "preempt $name: no resume command naming $ckpt"; }
            state=$(check_dir "$ckpt" "$step" final 2>&1) || fail "preempt $name: $state"
            [ "$(latest_step "$ckpt")" -eq "$step" ] ||
                fail "preempt $name: stopped after step $step, latest names another: $state"
        fi
        resume=()
        [ -f "$ckpt/latest" ] && resume=(--resume "$ckpt")
        timeout 300 "${launch[@]}" "${common[@]}" --quiet --checkpoint-dir "$ckpt" \
            --save "$dir/final.safetensors" "${resume[@]}" ||
            fail "preempt $name: the resumed run failed or hung (exit $?)"
        "$diff_bin" "$dir/final.safetensors" "$dir/reference.safetensors" --tol 0 >/dev/null ||
            fail "preempt $name: the resumed weights differ from the uninterrupted run's"
        preempted=$((preempted + 1))
        echo "   SIG$signal to $target ${delay} ms after step 1: exit 143, latest at step $step;" \
            "resumed: weights bitwise equal"
    done
    echo "ok: preempt $name ($target): $preempted preemption(s) in $tries run(s)"
}

PREEMPTS=${FAULTS_PREEMPTS:-3}
echo "== preemption: a signal at a random step, exit 143, --resume bitwise equal"
echo "-- threads backend, world size 2: SIGTERM"
# Long enough (about a second) that a signal after step 1 lands mid-run.
preempt_and_resume threads 600 trainer "$train" --backend threads --world-size 2
echo "-- threads backend, world size 2: two SIGTERMs (the second exits at once)"
preempt_and_resume threads 600 double "$train" --backend threads --world-size 2
echo "-- MPI backend, mpirun -n 2: SIGUSR1 to one rank, then to mpirun"
preempt_and_resume mpi 600 rank "${MPIRUN[@]}" -n 2 "$train" --backend mpi
preempt_and_resume mpi 600 mpirun "${MPIRUN[@]}" -n 2 "$train" --backend mpi

echo "test-faults: all passed in $(elapsed "$script_start") s"
