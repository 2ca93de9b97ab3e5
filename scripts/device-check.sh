#!/usr/bin/env bash
# The GPU check: one call of at most 8 minutes on one GPU (the README's GPU section has the device call). Its full log
# and a summary table go to $OUT (unset: ./device-check-out); the summary is printed last.
#   scripts/device-check.sh            on the GPU machine
#   scripts/device-check.sh --dry-run  every part on the CPU at tiny sizes (CI runs it): the same Python and every
#                                      code path short of the CUDA calls
# Parts, each under its time limit and all within DEVICE_CHECK_SECONDS (default 450):
#   wheels   .whl/ (made on a machine with the network by ../shared/tools/device-wheels.sh, carried) installed into
#            /tmp/site; every import dtorch and the checks need, the missing ones named in one line (then it stops);
#   native   dtorch's C++ CPU kernels compiled (the CPU rows of device_check compare with them);
#   pytest   the tests marked cuda: the op table on cuda against the CPU references, Triton kernels compiled for the
#            GPU, the CUDA graph recorder (on the CPU they skip, after their modules import);
#   device_check  bench/device_check.py: the runtime on DeviceMesh.cuda() (stream order, the caching allocator across
#            streams, NCCL, per-kernel overhead) and a random Llama written on the spot as GGUF (Q8_0/Q4_0/Q4_1) and
#            as a Hugging Face directory, decoded on every path against a reference;
#   gpu_decode    bench/gpu_decode.py: decode tok/s at batch 1 and 32 on a random Qwen3-0.6B-shaped bfloat16
#            checkpoint, dtorch eager and captured against transformers, peak memory, host syncs per decode step.
# Uses .venv when there is one, else the python3 on PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
case "${1:-}" in
  --dry-run) dry=1 ;;
  "") ;;
  *) echo "usage: scripts/device-check.sh [--dry-run]" >&2; exit 2 ;;
esac
out=${OUT:-$PWD/device-check-out}
mkdir -p "$out"
if [ -z "${DEVICE_CHECK_LOGGED:-}" ]; then  # once more, with everything also going to the log
  DEVICE_CHECK_LOGGED=1 bash "$PWD/scripts/device-check.sh" "$@" 2>&1 | tee "$out/device-check.log"
  exit "${PIPESTATUS[0]}"
fi
rm -f "$out/summary.txt" "$out/device_check.txt" "$out/gpu_decode.txt"  # no table of an earlier run
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
deadline=$((SECONDS + ${DEVICE_CHECK_SECONDS:-450}))
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# -- wheels and imports --------------------------------------------------------------------------------------------
# the install line ../shared/tools/device-wheels.sh prints (tests/test_device_check.py keeps the two equal)
INSTALL='python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD'
NEEDS="torch triton transformers gguf numpy safetensors tokenizers jinja2 tqdm yaml pytest dtorch"
wheels=(.whl/*.whl)
if [ -e "${wheels[0]}" ] && [ "$dry" = 1 ]; then
  echo "dry run: ${#wheels[@]} wheels in .whl/ are for the GPU machine's python 3.12, not installed here; would run:"
  echo "  $INSTALL"
elif [ -e "${wheels[0]}" ]; then
  echo "+ $INSTALL"
  eval "$INSTALL" || { echo "device-check: installing the wheels of .whl/ failed (above)"; exit 2; }
fi
missing=$(python3 - $NEEDS <<'EOF'
import importlib
import sys

missing = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - each failing import is named
        missing.append(f"{name} ({type(e).__name__}: {str(e)[:120]})")
print(", ".join(missing))
EOF
) || missing="python3 itself failed (above)"
if [ -n "$missing" ]; then
  echo "device-check: missing imports: $missing. On a machine with the network run ../shared/tools/device-wheels.sh" \
       "[NAME==VERSION ...], carry .whl and start the device command with the line it prints."
  exit 2
fi
if [ "$dry" = 1 ]; then
  where="CPU (dry run)"
elif ! where=$(python3 -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null); then
  echo "device-check: no CUDA device visible; nothing checked here (--dry-run rehearses every part on the CPU)"
  exit 1
fi
echo "device-check on $where: $(python3 -c 'from importlib.metadata import version
print(", ".join(f"{n} {version(n)}" for n in ("torch", "triton", "transformers", "gguf")))')"

# -- the parts -----------------------------------------------------------------------------------------------------
summary=()
part() {  # part NAME SECONDS COMMAND...: run under min(SECONDS, the time left); keep "NAME: ok|FAIL ... in N s"
  local name=$1 limit=$2; shift 2
  local left=$((deadline - SECONDS - 10))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 0 ]; then summary+=("$name: FAIL (not run: no time left)"); return; fi
  local t0=$SECONDS
  echo "=== $name (at most $limit s): $*"
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$tmp/$name.log"
  local rc=${PIPESTATUS[0]} what=ok
  [ "$rc" -eq 0 ] || what="FAIL (exit $rc$([ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo ', timed out'))"
  summary+=("$name: $what in $((SECONDS - t0)) s")
}
mode=(); [ "$dry" = 1 ] && mode=(--dry-run)
mapfile -t cuda_tests < <(grep -l 'pytest.mark.cuda' tests/test_*.py)
part native 60 python3 -m dtorch.kernels.native.build
part pytest 170 python3 -m pytest -v -m cuda -p no:cacheprovider --tb=short "${cuda_tests[@]}"  # -v: a line a test
part device_check 120 python3 bench/device_check.py --quick --out "$out" "${mode[@]}"
part gpu_decode 170 python3 bench/gpu_decode.py --tokens 64 --repeats 2 --out "$out" "${mode[@]}"

# -- the summary ---------------------------------------------------------------------------------------------------
{
  echo "=== summary: device-check on $where in $SECONDS s"
  printf '%s\n' "${summary[@]}"
  echo "pytest says: $(grep -E '(passed|failed|skipped|error)' "$tmp/pytest.log" | tail -1)"
  grep -oE '^tests/[^ ]+ (FAILED|ERROR)' "$tmp/pytest.log" | head -40  # also when it ran out of time
  for table in device_check gpu_decode; do
    echo "--- $table"
    cat "$out/$table.txt" 2>/dev/null || echo "(no table: see $table in the log)"
  done
} > "$out/summary.txt"
cat "$out/summary.txt"
for s in "${summary[@]}"; do case $s in *FAIL*) exit 1 ;; esac; done
