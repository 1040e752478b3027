set -o pipefail
export PYTHONUNBUFFERED=1
pip install -q --no-index --no-deps --target /tmp/hfsite .carry/hf/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD/src:/tmp/hfsite
nvidia-smi --query-gpu=name --format=csv,noheader
( timeout 230 python -m pytest -q -rfEs -p no:cacheprovider -x tests/test_training_step.py tests/test_hf_models.py -k "not examples" 2>&1 | tail -15 ) | tee $OUT/tests.log
timeout 340 python benchmarks/train_hf.py --models llama-1b --modes eager,liger,xrt,xrt-auto,xrt-auto-again,xrt-frozen 2>&1 | tee $OUT/train.log
