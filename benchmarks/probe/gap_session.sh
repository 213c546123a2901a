set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
timeout 150 python3 benchmarks/probe/dist_gap.py --inprocess --chunks 8 --out $OUT/inproc 2>&1 | grep -v '^{' | tail -5
B=$(python3 -c "import json;print(*json.load(open('$OUT/inproc/dist-gap-inprocess-c8.json'))['balance'])")
echo "inproc balance $B"
timeout 150 torchrun --nproc-per-node 2 benchmarks/probe/dist_gap.py --chunks 8 --timeline --out $OUT/own 2>&1 | grep -v '^{' | tail -5
timeout 150 torchrun --nproc-per-node 2 benchmarks/probe/dist_gap.py --chunks 8 --timeline --balance $B --out $OUT/same 2>&1 | grep -v '^{' | tail -5
timeout 150 python3 benchmarks/probe/dist_gap.py --inprocess --chunks 8 --balance $(python3 -c "import json;print(*json.load(open('$OUT/own/dist-gap-0-c8.json'))['balance'])") --out $OUT/inproc-own 2>&1 | grep -v '^{' | tail -5
for f in $OUT/*/*.json; do python3 -c "import json,sys;d=json.load(open('$f'));d.pop('timeline',None);print('$f',json.dumps(d))"; done
