set -o pipefail
export PYTHONUNBUFFERED=1
[ -d /tmp/hfsite ] || pip install -q --no-index --no-deps --target /tmp/hfsite .carry/hf/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD/src:/tmp/hfsite
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 560 python benchmarks/train_hf.py --models llama-1b --modes eager,compile,xrt,xrt-auto,xrt-auto-again,xrt-frozen,xrt-compile 2>&1 | tee $OUT/train.log
