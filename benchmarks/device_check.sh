#!/usr/bin/env bash
# The checks and benchmarks run on a lent GPU machine (see the closing notes): one short script, so that one call does
# them all. Writes logs under $OUT (default ./device-out). Needs jax (with the GPU plugin), flax, typer, rich, pyyaml,
# pytest, pytest-xdist and hypothesis there; rngaudit is taken from this checkout (PYTHONPATH).
set -u
OUT=${OUT:-./device-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
py=python3
t() { local s=$(date +%s%N); "$@"; local rc=$?; echo "[rc=$rc, $(( ($(date +%s%N) - s) / 1000000 )) ms] $*"; }

echo "== machine"
nvidia-smi -L
$py -c "import sys, jax, jaxlib, flax; print(sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__); print(jax.devices())"

echo "== derive: values drawn on the GPU against the CPU (bit for bit)"
for s in rngaudit/examples/guide.yaml rngaudit/examples/nnx_guide.yaml fixtures/guide/scan_split.yaml fixtures/guide/vmap_params_split.yaml fixtures/guide/shard_map_device3.yaml fixtures/guide/training_loop_step.yaml; do
  JAX_PLATFORMS=cuda $py -m rngaudit derive "$s" --format json -o "$OUT/gpu.json" >/dev/null 2>"$OUT/gpu.err"; g=$?
  JAX_PLATFORMS=cpu $py -m rngaudit derive "$s" --format json -o "$OUT/cpu.json" >/dev/null 2>"$OUT/cpu.err"; c=$?
  if cmp -s "$OUT/gpu.json" "$OUT/cpu.json"; then same=identical; else same=DIFFERENT; cp "$OUT/gpu.json" "$OUT/diff-gpu-$(basename "$s").json"; cp "$OUT/cpu.json" "$OUT/diff-cpu-$(basename "$s").json"; fi
  echo "$s: gpu rc=$g cpu rc=$c $same"; head -c 300 "$OUT/gpu.err"
done
rm -f "$OUT/gpu.json" "$OUT/cpu.json" "$OUT/gpu.err" "$OUT/cpu.err"

echo "== shard-check on the GPU"
t $py -m rngaudit shard-check rngaudit/examples/guide.yaml --platform gpu
t $py -m rngaudit shard-check --platform gpu --fn fixtures/shard/guide_forward.py:forward
t $py -m rngaudit shard-check --platform gpu --fn fixtures/shard/train_steps.py:dropout_step --args fixtures/shard/train_steps.py:dropout_args
t $py -m rngaudit shard-check --platform gpu --fn fixtures/shard/train_steps.py:whole_key_step --args fixtures/shard/train_steps.py:whole_key_args
t $py -m rngaudit shard-check --platform gpu --fn fixtures/shard/train_steps.py:mlp_step --args fixtures/shard/train_steps.py:mlp_args --format json -o "$OUT/mlp_step.json"

echo "== benchmarks (CPU devices forced on this machine's CPUs)"
t $py benchmarks/bench_shard.py --runs 3
t $py benchmarks/bench_shard_step.py --runs 3
t $py benchmarks/bench_derive.py --sites 200000
t $py benchmarks/bench_startup.py --runs 3

echo "== tests under this machine's JAX and Flax (default run, not --slow)"
timeout "${TEST_SECONDS:-240}" $py -m pytest -q -p no:cacheprovider -n 14 --timeout 200 -x tests 2>&1 | tail -60 | tee "$OUT/tests.log"
