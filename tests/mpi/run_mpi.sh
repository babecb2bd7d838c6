#!/usr/bin/env bash
# Runs the MPI tests under mpirun: the test binary on 4 and 3 ranks, then a job whose
# rank 2 fails, which must end every rank promptly, non-zero, naming rank 2; the parity
# matrix on 8 ranks in one launch; and a training job whose rank 1 fails in the middle
# of a step, which must end the same way, naming rank 1.
#   run_mpi.sh MPIRUN TEST_MPI FAIL_RANK TEST_PARITY_MPI FAIL_MID_STEP
set -uo pipefail
mpirun=$1
test_mpi=$2
fail_rank=$3
test_parity_mpi=$4
fail_mid_step=$5

# More ranks than cores (CI has two); mpirun refuses that without --oversubscribe.
flags=(--oversubscribe)
# Containers and CI run as root, which mpirun refuses without this flag.
[ "$(id -u)" -eq 0 ] && flags+=(--allow-run-as-root)
# Open MPI's shared-memory transport copies large messages straight between processes
# (CMA, process_vm_readv), which the default seccomp profile of Docker and similar
# containers forbids: transfers then fail with "Read -1, expected ..., errno = 1".
# Copying through the shared segment works everywhere and the messages here are small.
export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}

failures=0

for np in 4 3; do
  echo "== test_mpi on $np ranks"
  if timeout 120 "$mpirun" "${flags[@]}" -np "$np" "$test_mpi" --no-colors < /dev/null; then
    echo "ok: test_mpi on $np ranks"
  else
    echo "FAIL: test_mpi on $np ranks (exit status $?)"
    failures=$((failures + 1))
  fi
done

# expect_job_failure WHAT LIMIT EXPECTED_TEXT COMMAND...: a rank fails; mpirun must exit
# non-zero well within LIMIT seconds (124 is the limit's own status: a rank hung) and
# say why on stderr.
expect_job_failure() {
  local what=$1 limit=$2 expected=$3 err status start elapsed
  shift 3
  err=$(mktemp)
  start=$(date +%s)
  timeout "$limit" "$mpirun" "${flags[@]}" "$@" < /dev/null > /dev/null 2> "$err"
  status=$?
  elapsed=$(( $(date +%s) - start ))
  if [ "$status" -eq 0 ] || [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "FAIL: $what: mpirun exit status $status after ${elapsed} s"
    failures=$((failures + 1))
  elif ! grep -qF "$expected" "$err"; then
    echo "FAIL: $what: stderr lacks '$expected':"
    tail -n 20 "$err"
    failures=$((failures + 1))
  else
    echo "ok: $what: mpirun exit status $status after ${elapsed} s;" \
         "$(grep -F "$expected" "$err" | head -n 1)"
  fi
  rm -f "$err"
}
expect_job_failure "rank 2 fails (throw)" 60 "fail_rank: rank 2: bad batch on this rank" -np 4 "$fail_rank" throw
expect_job_failure "rank 2 fails (abort)" 60 "tessera: rank 2 gave up: loss is NaN" -np 4 "$fail_rank" abort

# Rank 1 throws in the backward of step 2 while the others are in that step's
# collectives: the job ends promptly, naming rank 1 and its error.
expect_job_failure "rank 1 fails mid-step" 120 \
  "fail_mid_step: rank 1: injected failure in the backward of layers.3 at step 2" -np 4 "$fail_mid_step"

# Outside mpirun, before MPI starts: the same helper prints the reason and exits 1.
expected_early="fail_rank: bad configuration before MPI started"
out=$(timeout 60 "$fail_rank" early 2>&1 > /dev/null)
status=$?
if [ "$status" -eq 1 ] && [ "$out" = "$expected_early" ]; then
  echo "ok: failure before MPI starts: exit status 1; $out"
else
  echo "FAIL: failure before MPI starts: exit status $status, stderr '$out' (expected 1, '$expected_early')"
  failures=$((failures + 1))
fi

# The parity matrix: tensor parallelism, every pipeline schedule, their compositions
# with FSDP and HSDP, every data-parallel layout and checkpoint mode, all in one launch
# of 8 ranks split into groups (about 250 CPU-seconds: 2 minutes on two idle cores,
# 5 or more where the cores are shared).
echo "== test_parity_mpi on 8 ranks"
start=$(date +%s)
timeout 900 "$mpirun" "${flags[@]}" -np 8 "$test_parity_mpi" --no-colors < /dev/null
status=$?
elapsed=$(( $(date +%s) - start ))
if [ "$status" -eq 0 ]; then
  echo "ok: test_parity_mpi on 8 ranks in ${elapsed} s"
else
  echo "FAIL: test_parity_mpi on 8 ranks: exit status $status after ${elapsed} s"
  failures=$((failures + 1))
fi

[ "$failures" -eq 0 ] && echo "mpi: all checks passed"
[ "$failures" -eq 0 ]
