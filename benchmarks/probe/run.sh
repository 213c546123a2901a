export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
timeout 300 python3 benchmarks/probe/llama_profile.py 2>&1 | grep -v Warning
