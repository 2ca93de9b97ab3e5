#!/usr/bin/env bash
# The GPU check, in one call and at most 8 minutes on one GPU; prints one summary at the end.
#   1. the tests marked cuda (the op table on cuda against the CPU references, Triton kernels compiled for the GPU,
#      the CUDA graph recorder), skipped where there is no GPU;
#   2. bench/device_check.py: the runtime on DeviceMesh.cuda() (compute/communicate stream order, the caching
#      allocator across streams, NCCL, per-kernel overhead) and the default model's decode;
#   3. bench/gpu_decode.py: decode tok/s at batch 1 and 32 on a random Qwen3-0.6B-shaped bfloat16 checkpoint,
#      dtorch eager and captured against transformers, peak memory, host syncs per decode step.
# Uses .venv when there is one, else the python on PATH (with torch, triton and transformers installed).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0
summary=()
part() {  # part NAME SECONDS COMMAND...: run with a time limit, keep "NAME: ok|FAIL (rc) in Ns"
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name"
  timeout "$limit" "$@"
  local rc=$?
  local what=ok
  [ "$rc" -eq 0 ] || what="FAIL (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out'))"
  summary+=("$name: $what in $((SECONDS - t0)) s")
}
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || { echo "device-check: no CUDA device visible; nothing to check here"; exit 0; }
part "pytest -m cuda" 200 python -m pytest -q -m cuda -p no:cacheprovider tests
part "device_check" 130 python bench/device_check.py --quick
part "gpu_decode" 150 python bench/gpu_decode.py --tokens 64 --repeats 3
echo "=== summary ($(python -c 'import torch; print(torch.cuda.get_device_name(0))'))"
printf '%s\n' "${summary[@]}"
for s in "${summary[@]}"; do case $s in *FAIL*) exit 1;; esac; done
