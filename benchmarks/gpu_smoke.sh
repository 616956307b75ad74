#!/usr/bin/env bash
# The GPU smoke: does the harness run on this machine's GPUs? One H200 (or more), a fresh clone,
# about 10 minutes. One line per item, PASS, FAIL (with the exit code and the run directory) or
# SKIP (with why); exit 1 when any item fails.
#
#   benchmarks/gpu_smoke.sh                      # on a GPU host, from a fresh clone
#   DEVICE=cpu INSTALL=0 STEPS=2 benchmarks/gpu_smoke.sh   # the same items on CPU (the tests run this)
#
# INSTALL=1 (the default) installs the project with its pins first: on a GPU host PyPI's
# torch 2.13.0 is the CUDA build, which the script then checks. One GPU hosts EP=2 as logical
# ranks (--ranks 1 --set ep=2); with 2 or more GPUs the CI gate of .github/workflows/gpu-gate.yml
# runs too. SET adds a --set to every run (a test plants a failure with it). ONLY="determinism pec"
# runs just those items, the others print SKIP: to rerun what failed. Items: cuda doctor parity
# (cold and warm) determinism retention pec fidelity parity-bf16 fidelity-bf16 abba gate.
set -u
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
INSTALL=${INSTALL:-1}
STEPS=${STEPS:-5}
OUT=${OUT:-$(mktemp -d)}
SET=${SET:-}
ONLY=${ONLY:-}
mkdir -p "$OUT"
failed=0
extra=()
[ -n "$SET" ] && extra=(--set "$SET")

wanted() {  # wanted ITEM: is ITEM among ONLY (or ONLY empty)? Prints the SKIP line when not.
  if [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; then return 0; fi
  echo "SKIP $1 (not in ONLY)"
  return 1
}

report() {  # report ITEM EXIT DETAIL
  if [ "$2" -eq 0 ]; then echo "PASS $1"; else echo "FAIL $1 (exit $2; $3)"; failed=1; fi
}

if [ "$INSTALL" = 1 ]; then
  pip install -q -c constraints.txt -e '.[test]' >"$OUT/install.log" 2>&1
  report "install" $? "$OUT/install.log"
fi
if [ "$DEVICE" = cuda ] && wanted cuda; then
  python -c 'import torch, sys; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)'
  report "torch with CUDA sees a GPU" $? "$(python -c 'import torch; print(torch.__version__)' 2>&1)"
fi
gpus=0
[ "$DEVICE" = cuda ] && gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
if wanted doctor; then
  if [ "$DEVICE" = cuda ]; then
    harness doctor --device cuda --ranks 1 >"$OUT/doctor.log" 2>&1
  else
    harness doctor --step --ranks 1 >"$OUT/doctor.log" 2>&1
  fi
  report "doctor (preflight and one training step)" $? "$OUT/doctor.log"
fi

run() {  # run ITEM SUITE [ARGS...]: one harness run of SUITE on one process hosting EP=2
  local item=$1 suite=$2 dir="$OUT/$1"
  shift 2
  [[ $item == parity-cold || $item == parity-warm ]] || wanted "$item" || return 0  # inside "wanted parity"
  harness run "$suite" --device "$DEVICE" --ranks 1 --set ep=2 --steps "$STEPS" --golden off \
    --out "$dir" "${extra[@]}" "$@" >"$dir.log" 2>&1
  report "$item" $? "$dir"
}

if wanted parity; then
  cache="$OUT/trace-cache"
  run parity-cold parity --trace-cache "$cache"
  grep -q '"cache": "miss"' "$OUT"/parity-cold/phases/*.jsonl 2>/dev/null
  report "parity-cold traced its graphs (trace cache miss)" $? "$OUT/parity-cold/phases"
  run parity-warm parity --trace-cache "$cache"
  grep -q '"cache": "hit"' "$OUT"/parity-warm/phases/*.jsonl 2>/dev/null && \
    ! grep -q '"cache": "miss"' "$OUT"/parity-warm/phases/*.jsonl
  report "parity-warm loaded its graphs (trace cache hit)" $? "$OUT/parity-warm/phases"
fi
run determinism determinism
run retention retention
run pec pec
run fidelity fidelity
run parity-bf16 parity-bf16
run fidelity-bf16 fidelity-bf16

if wanted abba; then
  harness abba parity --a eager --b graph --device "$DEVICE" --ranks 1 --set ep=2 --blocks 4 --steps 2 \
    --warmup 1 --max-slowdown 100 --out "$OUT/abba" "${extra[@]}" >"$OUT/abba.log" 2>&1
  code=$?
  timing=$([ "$DEVICE" = cuda ] && echo cuda-events || echo wall)
  [ "$code" -eq 0 ] && grep -q "\"timing\": \"$timing\"" "$OUT/abba/throughput.jsonl"
  report "abba eager vs graph, timed by $timing" $? "exit $code, $OUT/abba"
fi

if ! wanted gate; then
  :
elif [ "$gpus" -ge 2 ]; then
  harness ci parity logical-ranks strict-vs-stale pec --ranks 2 --device cuda --retries 1 --out "$OUT/gate" \
    >"$OUT/gate.log" 2>&1
  report "gpu-gate.yml gate on 2 GPUs" $? "$OUT/gate"
  harness run torchtitan-determinism --ranks 2 --device cuda --steps "$STEPS" --golden off \
    --out "$OUT/torchtitan" >"$OUT/torchtitan.log" 2>&1
  report "torchtitan-determinism: torchtitan's own trainer, FSDP and EP over 2 GPUs (nccl)" $? "$OUT/torchtitan"
  # torchtitan's EP chunking on CUDA, through MinimalAsyncEP (symmetric memory): not a shipped suite,
  # since every shipped suite loads on CPU, where that dispatcher is refused.
  cat >"$OUT/torchtitan-graph-cuda.toml" <<'TOML'
name = "torchtitan-graph-cuda"
description = "torchtitan's GraphTrainer: eager vs graph EP chunking over MinimalAsyncEP, exact"
subject = "torchtitan"
ranks = 2
steps = 5

[train]
trainer = "graph"
ep = 2
model = "cpu-tiny"
routing = "forced-balanced"
moe_comm_backend = "minimal_async_ep"

[arms.eager]
chunking = "eager"

[arms.graph]
chunking = "graph"

[[checks]]
kind = "exact"
arms = ["eager", "graph"]

[[checks]]
kind = "ranks-agree"
TOML
  harness run "$OUT/torchtitan-graph-cuda.toml" --ranks 2 --device cuda --steps "$STEPS" --golden off \
    --out "$OUT/torchtitan-graph" >"$OUT/torchtitan-graph.log" 2>&1
  report "torchtitan-graph-cuda: its GraphTrainer, eager vs graph EP chunking over MinimalAsyncEP" $? \
    "$OUT/torchtitan-graph"
else
  echo "SKIP gpu-gate.yml gate (needs 2 GPUs, $gpus visible)"
  echo "SKIP torchtitan-determinism with torchtitan's own EP (needs 2 GPUs, $gpus visible)"
  echo "SKIP torchtitan-graph-cuda: its EP chunking over MinimalAsyncEP (needs 2 GPUs, $gpus visible)"
fi
echo "logs: $OUT"
exit $failed
