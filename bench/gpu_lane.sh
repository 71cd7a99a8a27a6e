#!/usr/bin/env bash
# The GPU lane on the lent GPU machine, in one command from the checkout (../shared/gpu.md):
#   here, once:   the wheels in .whl/ (transformers, peft, liger-kernel; see ../shared/gpu.md); for the SFT
#                 case also trl==1.16.0 datasets==5.2.0 pyarrow dill multiprocess xxhash (skipped without them)
#   there:        bash bench/gpu_lane.sh      -> $OUT/gpu-lane.log (and its exit status)
# LANE_TIMEOUT (seconds, default 560) bounds the whole pytest run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs}
mkdir -p "$OUT"
log="$OUT/gpu-lane.log"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing the wheels failed" | tee "$log"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'peft', peft.__version__, 'cuda', torch.cuda.is_available())"; git log -1 --oneline 2>/dev/null; } \
    >"$log" 2>&1
lane=(make test-gpu GPU_PYTHON=python3)
command -v make >/dev/null || lane=(env PYTHONPATH="$PWD:${PYTHONPATH:-}" python3 -m pytest -m cuda tests -q)  # the same
timeout "${LANE_TIMEOUT:-560}" "${lane[@]}" >>"$log" 2>&1
rc=$?
echo "lane rc=$rc" >>"$log"
tail -n 40 "$log"
exit $rc
