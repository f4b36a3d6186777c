#!/usr/bin/env bash
# The GPU check as one call on a lent CUDA machine, whose python3 already holds a CUDA build of torch, pytest,
# pytest-timeout, hypothesis and transformers: the GPU test suite (tests/gpu), then `attnkit bench gpu`, each
# under its own time limit so that a slow part still leaves the other's output. Logs and the table go to $OUT
# when it is set (the device tool brings that folder back), else to bench/results.
#
#   bash bench/gpu_check.sh                 # every length (the bench is sized for under 5 minutes on an H100)
#   QUICK=1 bash bench/gpu_check.sh         # one length: a smoke run
#   TEST_LIMIT=200 BENCH_LIMIT=330 ...      # seconds for each part (these are the defaults)
#   TEST_WORKERS=4                          # test processes, where pytest-xdist is installed
set -u
cd "$(dirname "$0")/.." || exit 2
out=${OUT:-bench/results}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -c 'import torch
if not torch.cuda.is_available(): raise SystemExit("gpu_check: no CUDA device here (torch " + torch.__version__ + ")")
print("torch", torch.__version__, "on", torch.cuda.get_device_name())' || exit 2
# Each test compiles Flex kernels of its own (seconds each): with pytest-xdist at hand, four processes compile at
# once (the GPU has room for all of them); without it, one.
workers=()
python3 -c 'import xdist' 2>/dev/null && workers=(-n "${TEST_WORKERS:-4}" --dist load)
timeout "${TEST_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider -rs "${workers[@]}" tests/gpu 2>&1 \
  | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
timeout "${BENCH_LIMIT:-330}" python3 -m attnkit bench gpu ${QUICK:+--quick} --out "$out" 2>&1 | tee "$out/gpu_bench.log"
bench=${PIPESTATUS[0]}
echo "gpu_check: tests exit $tests, bench exit $bench (124: its time limit)"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
