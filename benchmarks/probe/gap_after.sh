# Device call: the 8-chunk timeline (seqify.distributed, balance fixed) and the distributed side-by-side (fp32).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
timeout 100 torchrun --nproc-per-node 2 benchmarks/probe/dist_gap.py --chunks 8 --timeline --balance 109 236 --out $OUT/gap 2>&1 | grep '^{' | python3 -c "
import json,sys
for l in sys.stdin:
    d=json.loads(l); g=list(d['per_gpu'].values())[0]; print(d['probe'], 'wall', g['wall_ms'], 'compute', g['compute_ms'], 'nccl', g['nccl_ms'])"
bash benchmarks/gpu_session.sh side-by-side fp32 2>&1 | tail -30
