# Device call: message times (p2p_time.py) and the 8-chunk distributed step under NCCL P2P settings.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
timeout 60 python3 benchmarks/probe/p2p_time.py --copy 2>&1 | grep '^{'
timeout 60 torchrun --nproc-per-node 2 benchmarks/probe/p2p_time.py 2>&1 | grep '^{'
NCCL_P2P_USE_CUDA_MEMCPY=1 timeout 60 torchrun --nproc-per-node 2 benchmarks/probe/p2p_time.py 2>&1 | grep '^{'
NCCL_MIN_P2P_NCHANNELS=16 timeout 60 torchrun --nproc-per-node 2 benchmarks/probe/p2p_time.py 2>&1 | grep '^{'
NCCL_MIN_P2P_NCHANNELS=32 NCCL_MAX_P2P_NCHANNELS=32 timeout 60 torchrun --nproc-per-node 2 benchmarks/probe/p2p_time.py 2>&1 | grep '^{'
for e in "X=1" "NCCL_P2P_USE_CUDA_MEMCPY=1" "NCCL_MIN_P2P_NCHANNELS=16"; do
  echo "== dist c8 with $e"
  env $e timeout 120 torchrun --nproc-per-node 2 benchmarks/probe/dist_gap.py --chunks 8 --balance 109 236 --out $OUT/$e 2>&1 | grep '^{' | python3 -c "
import json,sys
for l in sys.stdin:
    d=json.loads(l); g=list(d['per_gpu'].values())[0]; print(d['probe'], 'wall', g['wall_ms'], 'compute', g['compute_ms'], 'nccl', g['nccl_ms'], 'overlap', g['nccl_overlapping_compute_ms'])"
done
