# On a lent GPU machine (benchmarks/device/kit.py says how it gets there): install the kit, then the CUDA tests,
# benchmarks/gpu.py on a SmolLM2-135M-shaped model with random weights, and the whole suite (auto -> cuda).
# Results land in $OUT; the suite's summary is printed even when its time runs out.
#     bash benchmarks/device/run.sh [PYTEST_ARGS...]
# With arguments, only pytest with them (15 workers, --device auto -> cuda): a re-check of the files a fix touched.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 SITE=$(mktemp -d -t kvchat-site.XXXXXX)  # the kit, installed afresh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE \
    .device-kit/wheels/*.whl || exit 9
export PYTHONPATH=$SITE:$PWD
python3 benchmarks/device/kit.py unpack $SITE || exit 8
[ -e kvchat/profiles ] || ln -s ../profiles kvchat/profiles  # what the wheel's package-dir mapping does
nvidia-smi -L
if [ $# -gt 0 ]; then
    OMP_NUM_THREADS=1 python3 -m pytest -q -p no:cacheprovider -n 15 -rfE -W ignore "$@" 2>&1 | tail -30
    exit
fi
echo "== CUDA tests"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE -m cuda tests 2>&1 | tail -8
echo "== benchmarks/gpu.py"
# --allow-busy: the load the check would see is the CUDA tests' above, on a 16-core machine; gpu.md states it.
timeout 150 python3 benchmarks/gpu.py --model $SITE/model --models-dir $SITE/models --out $OUT/gpu.md \
    --allow-busy 2>&1 | tail -12
echo "== suite (${SUITE_SECONDS:=220} s at most)"
# -v: xdist names each failure as it happens, so a suite cut short still says which failed.
OMP_NUM_THREADS=1 timeout -s INT -k 20 $SUITE_SECONDS python3 -m pytest -v -p no:cacheprovider -n 15 -rfE \
    --junitxml=$OUT/suite.xml tests > $OUT/suite.log 2>&1
echo "suite exit $?"; grep -E " (FAILED|ERROR) |^(FAILED|ERROR)|[0-9]+ passed" $OUT/suite.log | cut -c1-200 | tail -40
