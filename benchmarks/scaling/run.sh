#!/usr/bin/env bash
# The scaling benchmark of one machine as one detached job (start it with setsid; it runs for hours): per model,
# scaling.py over 1, 2, 4 (and 8) GPUs, then torch pipelining on the same cuts at each count, then the merged
# table and plot; also the GPU tests, the hand-picked ResNet-101 anchor and a busy probe. Writes to $1.
# STEPS orders the steps (below); SCALING_ARGS / TORCHPP_ARGS add arguments (a CPU rehearsal: "--tiny --device cpu" / "--device cpu").
set -u
R=${1:-/tmp/scaling}; mkdir -p "$R"
echo $$ > "$R/pgid"  # its process group: kill -- -$(cat "$R/pgid") stops every step
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
have=${GPUS:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
counts=1; for n in 2 4 8; do [ "$have" -ge $n ] && counts="$counts $n"; done
table() { python3 benchmarks/scaling/main.py --table "$R/scaling.json" "$R/torchpp.jsonl" --plot "$R/scaling.png" > "$R/table.txt" 2>&1; }
touch "$R/torchpp.jsonl"
model() {
  local m=$1
  echo "== $m: seqify over $counts GPUs ($(date -u +%T))"
  timeout 1200 python3 benchmarks/scaling/main.py --models "$m" --gpus $counts --out "$R/scaling.json" ${SCALING_ARGS:-} 2>&1 | grep -v '^seqify \(profile\|tune\)'
  for n in $counts; do
    [ "$n" -gt 1 ] || continue
    echo "== $m: torch pipelining on $n GPUs ($(date -u +%T))"
    for try in 1 2 3 4 5 6; do  # a launch ends at a schedule that fails mid-step; the next skips what is recorded
      timeout 600 torchrun --nproc-per-node "$n" benchmarks/scaling/torchpp.py --rows "$R/scaling.json" --models "$m" \
        --out "$R/torchpp.jsonl" ${TORCHPP_ARGS:-} > "$R/torchpp-$m-$n.log" 2>&1 && break
    done
    grep -c . "$R/torchpp.jsonl"
  done
  table
}
busy() {  # where ResNet-101's 4-GPU weak-scaling step loses its time: busy and idle per GPU
  [ "$have" -ge 4 ] || return 0
  echo "== ResNet-101 on 4 GPUs, batch 1024: GPU busy and gaps ($(date -u +%T))"
  timeout 420 python3 benchmarks/busy_time/main.py --gpus 4 --batch 1024 --one-gpu-batch 256 --chunks 8 \
    --schedules zb-h2 1f1b --out "$R" > "$R/busy.log" 2>&1
  grep -v '^    ' "$R/busy.log" | tail -12
}
hand_picked() {
  echo "== hand-picked ResNet-101 on 2 GPUs ($(date -u +%T))"
  CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 benchmarks/two_gpus/main.py --batch 256 --precision fp32 --chunks 4 \
    --schedule zb-h2 --schedule-graphs graphs --skip-seqify --steps 6 --warm 2 --out "$R" > "$R/hand-picked.log" 2>&1
  tail -12 "$R/hand-picked.log"
}
families() {  # every zoo family with the automatic configuration on 2 GPUs, predicted against measured
  echo "== every family on 2 GPUs ($(date -u +%T))"
  eval "local more=(${FAMILIES_ARGS:-})"  # FAMILIES_ARGS='--time-limit 600 --batch "Wide ResNet=256"': quoted words kept
  CUDA_VISIBLE_DEVICES=0,1 timeout ${FAMILIES_S:-1000} python3 benchmarks/families/main.py --out "$R/families.jsonl" \
    "${more[@]}" > "$R/families.log" 2>&1
  grep '^|' "$R/families.log" | tail -25
}
probe() {  # the tuner's anchor: eager and replayed one-GPU steps against the raw profile
  echo "== anchor probe on 1 GPU ($(date -u +%T))"
  eval "local more=(${PROBE_ARGS:---families MaxViT LR-ASPP --chunks 2 4})"
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/layer_lines/main.py "${more[@]}" --out "$R" > "$R/probe.log" 2>&1
  grep anchor_eager "$R/probe.log"
}
tune_tests() {
  echo "== the tuner's GPU tests ($(date -u +%T))"
  CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 -m pytest -q -p no:xdist -p no:cacheprovider -m gpu tests/tuning/test_tune.py \
    --timeout 180 > "$R/tune-tests.log" 2>&1
  tail -3 "$R/tune-tests.log"
}
channels_last() {  # the 16-chunk row: ZB-H2 with graphs at 4 and 16 chunks, NCHW then NHWC (baseline too)
  echo "== NCHW against NHWC on 2 GPUs ($(date -u +%T))"
  for f in "" --channels-last; do
    CUDA_VISIBLE_DEVICES=0,1 timeout 270 python3 benchmarks/two_gpus/main.py --batch 256 --precision fp32 --chunks 4 16 \
      --schedule zb-h2 --schedule-graphs graphs --skip-seqify --steps 6 --warm 2 $f --out "$R" > "$R/zb-h2${f:+-nhwc}.log" 2>&1
    grep '^|' "$R/zb-h2${f:+-nhwc}.log"; mv "$R/pipeline_bench_fp32.json" "$R/zb-h2${f:+-nhwc}.json"
  done
}
tests() {
  echo "== GPU tests on 2 GPUs ($(date -u +%T))"
  CUDA_VISIBLE_DEVICES=0,1 timeout 330 python3 -m pytest -q -p no:xdist -p no:cacheprovider -m gpu tests --timeout 240 \
    > "$R/gpu-check.log" 2>&1
  tail -3 "$R/gpu-check.log"
}
# STEPS: model names and busy / hand-picked / tests / families / probe / tune-tests / channels-last, in the order to
# run (short steps first, the Llama, the longest, last); MODELS: the models, in that order
if [ -n "${MODELS:-}" ]; then order="tests $MODELS hand-picked busy"; else order="tests resnet101 amoebanet_d unet hand-picked busy llama"; fi
for step in ${STEPS:-$order}; do
  case $step in
    busy) busy ;;
    hand-picked) hand_picked ;;
    tests) tests ;;
    families) families ;;
    probe) probe ;;
    tune-tests) tune_tests ;;
    channels-last) channels_last ;;
    *) model "$step" ;;
  esac
done
echo "== done ($(date -u +%T))"
rm -f "$R/pgid"
touch "$R/done"
