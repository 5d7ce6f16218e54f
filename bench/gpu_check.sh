#!/usr/bin/env bash
# The prepared GPU check: kernels vs the torch reference, graph replay tests, latency bench.
# Every stage is time-boxed (8 minutes in all); a failing stage is recorded and the rest
# still run. All output lands in ${OUT:-out}/gpu_check.txt.
#   bash bench/gpu_check.sh            (from the repository root, on a CUDA machine)
#   WHEELS_DIR=/path/to/wheels ...     install from local wheels only (no index)
set -euo pipefail

OUT_DIR=${OUT:-out}
LOG="$OUT_DIR/gpu_check.txt"
export WHEELS_DIR=${WHEELS_DIR:-wheels}
mkdir -p "$OUT_DIR"
: >"$LOG"
SUMMARY=()

stage() {  # stage NAME SECONDS CMD...: run CMD with a time limit, log it, record the result
  local name=$1 secs=$2 rc=0
  shift 2
  printf '\n===== %s (limit %ss): %s\n' "$name" "$secs" "$*" >>"$LOG"
  local start=$SECONDS
  # bash -c so a stage may be one of the functions exported below
  timeout "$secs" bash -c '"$@"' stage "$@" >>"$LOG" 2>&1 || rc=$?
  local verdict=PASS
  if [ "$rc" -ne 0 ]; then verdict="FAIL rc=$rc"; fi
  if [ "$rc" -eq 124 ]; then verdict="TIMEOUT"; fi
  SUMMARY+=("$(printf '%-14s %-10s %4ss' "$name" "$verdict" "$((SECONDS - start))")")
}

install() {
  if [ -d "$WHEELS_DIR" ]; then
    python -m pip install --no-index --find-links "$WHEELS_DIR" -e ".[test]"
    # flash-attn is optional: its tests skip (with the reason) when it is missing
    python -m pip install --no-index --find-links "$WHEELS_DIR" flash-attn \
      || echo "no flash-attn wheel in $WHEELS_DIR"
  else
    python -m pip install -e ".[test]"
  fi
}

versions() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python - <<'EOF'
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
try:
    import flash_attn
    print("flash_attn", flash_attn.__version__)
except ImportError as exc:
    print("flash_attn missing:", exc)
EOF
}

export -f install versions
stage install 45 install
stage versions 15 versions
stage kernels 150 env -u TRITON_INTERPRET python -m pytest -q -rs -p no:cacheprovider \
  tests/test_triton_kernels.py tests/test_flash_attn_backend.py
stage graph-tests 150 env -u TRITON_INTERPRET python -m pytest -q -rs -p no:cacheprovider \
  tests -k graph
stage latency 120 env -u TRITON_INTERPRET rung bench latency --model bench-llama \
  --batch-sizes 1,8,32 --iters 20 --json "$OUT_DIR/latency.json"

{
  printf '\n===== summary\n'
  printf '%s\n' "${SUMMARY[@]}"
} | tee -a "$LOG"
! printf '%s\n' "${SUMMARY[@]}" | grep -qv ' PASS '
