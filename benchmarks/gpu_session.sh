#!/usr/bin/env bash
# One device-tool call (nvidia-h200-x2 for the pipeline rows; one-GPU kinds put partitions on one GPU):
# install seqify without dependencies (the image has torch, torchvision, transformers, networkx), then run
# the step named by $1 (tests, graphs, resnet, resnet-graphs, unet, llama, llama-bf16, dist, side-by-side [fp32|bf16],
# dist-gap, casts, llama-side, channels-last, busy [SECONDS], check [SECONDS], families SECONDS [FAMILY...], scaling-start SECONDS,
# scaling-wait SECONDS, scaling-stop). Output goes to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the install below can succeed without seqify importable
python3 -c 'import seqify' 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
  >/dev/null 2>&1 || export PYTHONPATH=$PWD
python3 -c 'import seqify.zoo' 2>/dev/null || ln -sfn ../zoo seqify/zoo  # the package maps seqify.zoo to zoo/
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "gpus", torch.cuda.device_count())'
case "${1:-tests}" in
  tests)
    timeout 300 python3 -m pytest -q -p no:xdist -m gpu tests/test_gpu.py tests/test_tied.py -x --timeout 240 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
    ;;
  resnet)
    timeout 540 python3 benchmarks/pipeline_bench.py --batch 256 --precision fp32 --chunks 4 8 --loops 1 2 \
      --schedule gpipe 1f1b interleaved zb-h1 --skip-seqify --steps 4 --warm 2 --out "$OUT" 2>&1 | tee "$OUT/resnet.log" | tail -60
    ;;
  graphs)
    timeout 240 python3 -m pytest -q -p no:xdist -p no:cacheprovider -m gpu tests/test_gpu_graphs.py -x --timeout 200 2>&1 | tee "$OUT/gpu-graphs-tests.log" | tail -30
    timeout 330 python3 benchmarks/pipeline_bench.py --batch 128 --precision fp32 --chunks 8 --loops 1 2 \
      --schedule gpipe 1f1b zb-h1 --schedule-graphs both --inference --skip-seqify --steps 4 --warm 2 --out "$OUT" 2>&1 | tee "$OUT/graphs.log" | tail -40
    ;;
  resnet-graphs)
    timeout 560 python3 benchmarks/pipeline_bench.py --batch 256 --precision fp32 --chunks 4 8 16 --loops 1 2 \
      --schedule gpipe 1f1b zb-h1 --schedule-graphs graphs --inference --skip-seqify --steps 4 --warm 2 --out "$OUT" 2>&1 | tee "$OUT/resnet-graphs.log" | tail -60
    ;;
  unet)
    timeout 280 python3 benchmarks/unet_graphs.py --batch 32 --res 512 --chunks 4 2>&1 | tee "$OUT/unet-graphs.log" | tail -20
    timeout 280 python3 benchmarks/unet_memory.py 2>&1 | tee "$OUT/unet-memory.log" | tail -20
    ;;
  llama-bf16)
    timeout 90 python3 benchmarks/probe/skip_values.py --device cuda --bf16 2>&1 | tee "$OUT/llama-skips.log" | tail -12
    timeout 480 python3 benchmarks/llama_bench.py --precision bf16 --balance time --chunks 8 16 --loops 1 \
      --schedules gpipe 1f1b zb-h1 --graphs both --steps 3 --warmup 1 --out "$OUT/llama-bf16.json" 2>&1 | tee "$OUT/llama-bf16.log" | tail -30
    ;;
  llama-side)  # the Llama rows in one call: one GPU, seqify's ZB-H1 and interleaved (graphs, casts once)
    # and torch.distributed.pipelining on hand cuts at decoder-layer boundaries
    timeout 330 python3 benchmarks/llama_bench.py --precision bf16 --balance time --chunks 4 8 --schedules zb-h1 \
      interleaved --graphs graphs --loops 1 2 4 --steps 5 --warmup 2 --out "$OUT/llama.json" > "$OUT/llama.log" 2>&1
    timeout 230 torchrun --nproc-per-node 2 benchmarks/llama_anchor.py --chunks 4 8 --out "$OUT" > "$OUT/llama-torchpp.log" 2>&1
    python3 benchmarks/llama_anchor.py --table "$OUT/llama.json" "$OUT/llama-torchpp.json" | tee "$OUT/llama-side-by-side.txt"
    ;;
  llama)
    timeout 560 python3 benchmarks/llama_bench.py --precision fp32 --steps 3 --warmup 1 --out "$OUT/llama.json" 2>&1 | tee "$OUT/llama.log" | tail -40
    ;;
  dist)
    timeout 560 torchrun --nproc-per-node 2 benchmarks/distributed_bench.py --batch 256 --chunks 4 8 16 \
      --schedules gpipe 1f1b --balance time --graphs on --out "$OUT" 2>&1 | tee "$OUT/dist.log" | grep '^{'
    ;;
  side-by-side)  # the distributed comparison in one call: one GPU, in-process 1F1B graphs, seqify.distributed, torch pipelining
    p=${2:-fp32}; flag=(); tag=""; [ "$p" = bf16 ] && flag=(--bf16) && tag=-bf16
    timeout 200 python3 benchmarks/pipeline_bench.py --batch 256 --precision "$p" --chunks 4 8 16 --schedule 1f1b \
      --schedule-graphs graphs --skip-seqify --steps 6 --warm 2 --out "$OUT" > "$OUT/inproc$tag.log" 2>&1
    timeout 200 torchrun --nproc-per-node 2 benchmarks/distributed_bench.py --batch 256 --chunks 4 8 16 \
      --schedules 1f1b --balance time --graphs on --steps 6 --warm 2 "${flag[@]}" --out "$OUT" > "$OUT/dist$tag.log" 2>&1
    timeout 170 torchrun --nproc-per-node 2 benchmarks/torchpp_anchor.py --batch 256 --chunks 4 8 16 --cuts 0 3 \
      --steps 6 --warm 2 "${flag[@]}" --out "$OUT" > "$OUT/torchpp$tag.log" 2>&1
    python3 benchmarks/side_by_side.py "$OUT/pipeline_bench_$p.json" "$OUT/distributed$tag.json" "$OUT/torchpp$tag.json" \
      | tee "$OUT/side-by-side$tag.txt"
    ;;
  dist-gap)  # the 8-chunk gap: GPU busy, NCCL and idle time per GPU, in-process against seqify.distributed
    timeout 150 python3 benchmarks/probe/dist_gap.py --inprocess --chunks 8 --out "$OUT" 2>&1 | grep '^{'
    timeout 150 torchrun --nproc-per-node 2 benchmarks/probe/dist_gap.py --chunks 8 --out "$OUT" 2>&1 | grep '^{'
    ;;
  channels-last)  # the 16-chunk row, NCHW then NHWC: scaling_run.sh's step of that name, here and now
    STEPS=channels-last bash benchmarks/scaling_run.sh "$OUT"
    ;;
  busy)  # ResNet-101's pipelined step against the ceiling its micro-batch size allows (GPU busy and gaps)
    timeout "${2:-240}" python3 benchmarks/probe/resnet_pipe_busy.py --chunks 4 8 16 --schedules 1f1b zb-h1 \
      --out "$OUT" 2>&1 | tee "$OUT/resnet-busy.log" | grep -v '^    '
    ;;
  check)  # every GPU test, seqify installed as a package (subprocess and torchrun workers import it)
    timeout "${2:-330}" python3 -m pytest -q -p no:xdist -p no:cacheprovider -m gpu tests --timeout 240 2>&1 \
      | tee "$OUT/gpu-check.log" | tail -30
    ;;
  casts)  # weights cast once per step under autocast, over two GPUs: Llama bf16 ZB-H1 (the Llama rows) with and
    # without, then the GPU tests that check it bit-equal and the tied-module fix
    timeout 70 python3 -m pytest -q -p no:xdist -p no:cacheprovider -m gpu tests/test_casts.py tests/test_tied.py \
      --timeout 60 2>&1 | tail -3
    timeout 480 python3 benchmarks/llama_bench.py --precision bf16 --balance time --chunks 4 8 --schedules zb-h1 \
      --graphs graphs --loops 1 --cast both --steps 4 --warmup 2 --out "$OUT/llama-cast-once.json" 2>&1 \
      | tee "$OUT/llama-cast-once.log" | tail -8
    ;;
  families)  # every zoo family with the automatic configuration; $2: seconds, then family names
    # and FAMILY=N batch overrides
    budget=${2:-400}; shift 2; names=(); sizes=()
    for a in "$@"; do case "$a" in *=*) sizes+=(--batch "$a");; *) names+=("$a");; esac; done
    timeout $((budget + 170)) python3 benchmarks/families_pipeline.py --budget "$budget" --out "$OUT/families.jsonl" \
      "${sizes[@]}" ${names[0]:+--families "${names[@]}"} 2>&1 | grep -v "^seqify \(profile\|tune\)" | tee "$OUT/families.log" | tail -40
    ;;
  scaling-stop)  # end a detached scaling job (its whole process group; torchrun stops its workers)
    [ -s /tmp/scaling/pgid ] && kill -TERM -- "-$(cat /tmp/scaling/pgid)" 2>/dev/null; sleep 5
    rm -f /tmp/scaling/pgid; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
    ;;
  scaling-start)  # start benchmarks/scaling_run.sh detached (it outlives this call), then wait as below;
    # refused while one runs (two at once share the GPUs and spoil each other's numbers)
    if [ -s /tmp/scaling/pgid ] && kill -0 -- "-$(cat /tmp/scaling/pgid)" 2>/dev/null; then
      echo "a scaling job is running (process group $(cat /tmp/scaling/pgid)): scaling-wait, or scaling-stop first"; exit 1
    fi
    rm -rf /tmp/scaling; mkdir -p /tmp/scaling
    MODELS=${MODELS:-} STEPS=${STEPS:-} setsid nohup bash benchmarks/scaling_run.sh /tmp/scaling > /tmp/scaling/run.log 2>&1 < /dev/null &
    ;&
  scaling-wait)  # wait up to $2 seconds for the detached job, then bring back what it has written so far
    end=$((SECONDS + ${2:-500}))
    while [ $SECONDS -lt $end ] && [ ! -e /tmp/scaling/done ]; do sleep 5; done
    for f in scaling.json torchpp.jsonl table.txt run.log scaling.png busy.log gpu-check.log hand-picked.log \
        families.jsonl families.log layer-lines.jsonl probe.log tune-tests.log pipeline_bench_fp32.json \
        zb-h2.log zb-h2.json zb-h2-nhwc.log zb-h2-nhwc.json; do
      cp "/tmp/scaling/$f" "$OUT/" 2>/dev/null
    done
    tail -25 /tmp/scaling/run.log; cat /tmp/scaling/table.txt 2>/dev/null
    ;;
esac
