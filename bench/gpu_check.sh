#!/usr/bin/env bash
# The prepared GPU check, for a machine with NO package registry: versions first, rung
# installed without touching torch/triton, then kernels, graph tests, capture, background
# capture between steps (live-switch), host syncs and latency.
# Every stage has a time limit (8 minutes in all); a failing stage is recorded and the
# rest still run. A summary table ends the run; JSON and logs land in OUT_DIR.
#   bash bench/gpu_check.sh OUT_DIR            (from the repository root, on a CUDA machine)
#   bash bench/gpu_check.sh OUT_DIR --dry-run  (print the stage plan, run versions + install)
#   PYTHON=/path/to/python ...                 (the interpreter to check; default python3)
#   LIMIT_SCALE=4 ...                          (stretch every limit, e.g. on a busy CPU box)
set -uo pipefail

usage() { echo "usage: bash bench/gpu_check.sh OUT_DIR [--dry-run]" >&2; exit 2; }
OUT_DIR="" DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) usage ;;
    -*) echo "unknown option $arg" >&2; usage ;;
    *) [ -z "$OUT_DIR" ] || usage; OUT_DIR=$arg ;;
  esac
done
[ -n "$OUT_DIR" ] || usage
cd "$(dirname "$0")/.."
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PYTHON=${PYTHON:-python3}
LIMIT_SCALE=${LIMIT_SCALE:-1}
MODEL=${MODEL:-bench-llama-30l}     # 30 layers, SmolLM2-135M shapes, random weights
export PYTHON OUT_DIR MODEL DRY_RUN
: >"$OUT_DIR/stages.tsv"

# NOTE: TRITON_INTERPRET would run the kernels on the CPU interpreter; pytest's conftest
# only sets it when CUDA is missing, and every stage runs with it unset.
RUNG="env -u TRITON_INTERPRET $PYTHON -m rung.cli.main"
PYTEST="env -u TRITON_INTERPRET $PYTHON -m pytest -q -rs -p no:cacheprovider"

# --- stage bodies (exported: `timeout` runs each in a fresh bash) ---------------------------
versions() {
  "$PYTHON" bench/gpu_check_report.py versions "$OUT_DIR/versions.json"
}

install() {
  # NOTE: --no-deps keeps pip away from torch/triton (the test extra pins a triton this
  # machine does not have); --no-build-isolation uses the installed setuptools instead of
  # downloading one; --no-index because no registry is reachable.
  if PIP_DISABLE_PIP_VERSION_CHECK=1 "$PYTHON" -m pip install --no-index --no-deps \
      --no-build-isolation -e .; then
    : >"$OUT_DIR/pythonpath"
  else
    echo "pip install failed: falling back to a path shim (no console script; stages use"
    echo "'python -m rung.cli.main')"
    mkdir -p "$OUT_DIR/shim/rung"
    for p in core runtime graphs kernels models bench cli server; do
      ln -sfn "$PWD/$p" "$OUT_DIR/shim/rung/$p"
    done
    echo "$OUT_DIR/shim" >"$OUT_DIR/pythonpath"
  fi
  PYTHONPATH="$(cat "$OUT_DIR/pythonpath")${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" \
    bench/gpu_check_report.py same-versions "$OUT_DIR/versions.json"
}

export -f versions install

# --- the plan: name, limit in seconds, command ----------------------------------------------
PLAN=(
  "versions|20|versions"
  "install|60|install"
  "kernels|90|RUNG_DEVICE_TEST_REPORT=$OUT_DIR/kernels.devices.json $PYTEST tests/test_triton_kernels.py tests/test_flash_attn_backend.py"
  "graph-tests|95|RUNG_DEVICE_TEST_REPORT=$OUT_DIR/graph-tests.devices.json $PYTEST tests/test_graph_replay.py tests/test_graph_ladder.py tests/test_descriptor_contract.py tests/test_triton_engine.py tests/test_full_uniform_metadata.py tests/test_no_jit_after_warmup.py tests/test_capture_accounting.py"
  "capture|80|$RUNG warmup --model $MODEL --dtype bfloat16 --mode full_and_piecewise --attention-backend TRITON --max-num-seqs 32 --json $OUT_DIR/warmup.json"
  "live-switch|40|env -u TRITON_INTERPRET $PYTHON -m rung.bench.live_switch --model $MODEL --dtype bfloat16 --num-reqs 8 --timeout 25 --json $OUT_DIR/live_switch.json"
  "host-syncs|20|env -u TRITON_INTERPRET $PYTHON -m rung.bench.host_syncs --device cuda --num-reqs 8 --max-tokens 12 --workloads sampled,ngram-sampled,mtp-sampled --json $OUT_DIR/host_syncs.json"
  "latency|75|$RUNG bench latency --model $MODEL --dtype bfloat16 --attention-backend TRITON --batch-sizes 1,8,32 --modes none,piecewise,full --input-len 32 --output-len 32 --iters 3 --json $OUT_DIR/latency.json"
)

stage() {  # stage NAME SECONDS CMD: run CMD with a time limit, log it, record the result
  local name=$1 secs=$2 cmd=$3 rc=0 start=$SECONDS
  local log="$OUT_DIR/$name.log" extra=""
  [ -s "$OUT_DIR/pythonpath" ] && extra="PYTHONPATH=$(cat "$OUT_DIR/pythonpath")${PYTHONPATH:+:$PYTHONPATH}"
  printf '===== %s (limit %ss): %s\n' "$name" "$secs" "$cmd"
  printf '%s\n' "$cmd" >"$log"
  timeout "$((secs * LIMIT_SCALE))" env $extra bash -c "$cmd" >>"$log" 2>&1 || rc=$?
  tail -n +2 "$log" | tail -n 15 | sed 's/^/    /'
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$secs" >>"$OUT_DIR/stages.tsv"
}

echo "gpu_check: python $PYTHON, output $OUT_DIR, model $MODEL"
total=0
for entry in "${PLAN[@]}"; do total=$((total + $(cut -d'|' -f2 <<<"$entry"))); done
echo "stage plan (limits add up to ${total} s):"
for entry in "${PLAN[@]}"; do
  IFS='|' read -r name secs cmd <<<"$entry"
  printf '  %-12s %4ss  %s\n' "$name" "$secs" "$cmd"
done
for entry in "${PLAN[@]}"; do
  IFS='|' read -r name secs cmd <<<"$entry"
  if [ "$DRY_RUN" = 1 ] && [ "$name" != versions ] && [ "$name" != install ]; then
    printf '%s\tskipped\t0\t%s\n' "$name" "$secs" >>"$OUT_DIR/stages.tsv"
    continue
  fi
  stage "$name" "$secs" "$cmd"
done
"$PYTHON" bench/gpu_check_report.py summary "$OUT_DIR"
