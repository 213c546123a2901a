export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
for v in "plan resnet18 16 4" "nohooks resnet18 16 4" "plan-gc resnet18 16 4" "eagerfwd resnet18 16 4" "eagerstep resnet18 16 4" "plan resnet50 32 4" "nohooks resnet50 32 4" "eagerfwd resnet50 32 4"; do
  timeout 100 python3 benchmarks/probe/capture_probe2.py $v 2>&1 | grep -v Warning | tail -3
done
