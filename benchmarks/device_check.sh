#!/usr/bin/env bash
# The GPU checks of benchmarks/ in one command, sized for a lent GPU machine's 10-minute call:
#   1. the CUDA tests of the suite;
#   2. real steps (benchmarks.run --only cpu): measured CUDA peak vs predicted vs the budget, step
#      time vs plain, beside hand checkpointing, checkpoint_sequential and torch.compile's budget replay;
#   3. time truth (benchmarks.time_truth): predicted vs measured overhead at 0.6 and 0.4, every strategy;
#   4. Inductor (benchmarks.compile_budget): fxremat + Inductor beside plain Inductor on the U-Net
#      (INDUCTOR_NET=resnet_chain etc. for another net), each budget also with the DP's other
#      weighting (on CUDA with the early stop, off there by default; on the CPU with whole segments)
#      and without the fit to the compiled step's peak (fit_compiled_peak=False), in the same loop;
#   5. torchvision's ResNet-50 at batch 64 through `fxremat bench` (measured and predicted peaks);
#   6. (not in the default parts) time truth with dp_early_stop=True, to compare with part 3:
#      on this CPU its plans ran slower than predicted (benchmarks/results/early_stop.md);
#   7. (not in the default parts) Inductor on all four nets at once (U-Net, PSPNet, ResNet chain,
#      transformer): each process on a quarter of the cores, compiling beside the others and timing
#      only under a lock (`compile_budget --cores --timing-lock`), each budget also planned without
#      the fit to the compiled step's peak (`--unfitted`; UNFITTED=0 leaves those rows out): four nets'
#      peaks in one call (run it alone: ~6 minutes on an H200 before the fit's rows), step ratios disturbed
#      by the others' compiles.
# Each part has its own time limit, so one that fails or runs long leaves the others their time;
# every part writes its table as it goes.
#
#   OUT=benchmarks/results/cuda bash benchmarks/device_check.sh [BATCH_SCALE]   # default 16
#   DEVICE=cpu OUT=/tmp/check bash benchmarks/device_check.sh 1                 # the same on this CPU
#   PARTS="1 4" ...                                                             # some parts only
set -u
out=${OUT:-benchmarks/results/cuda}
device=${DEVICE:-cuda}
scale=${1:-16}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
parts=" ${PARTS:-1 2 3 4 5} "  # e.g. PARTS="1 4" runs the tests and the Inductor rows only
want() { [[ $parts == *" $1 "* ]]; }
{
    date -u
    nvidia-smi -L 2>/dev/null
    $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
    if $py setup.py build_ext --inplace >/tmp/fxremat_build_ext.log 2>&1; then
        echo "kernels: compiled (fxremat/_dp.pyx)"
    else
        export FXREMAT_PURE_PYTHON=1
        tail -5 /tmp/fxremat_build_ext.log
        echo "kernels: pure Python (build_ext failed)"
    fi
    want 1 && echo "== 1. CUDA tests" &&
    timeout 60 $py -m pytest -p no:cacheprovider tests/test_training.py tests/test_surprises.py tests/test_cli.py -k cuda
    want 2 && echo "== 2. real steps" &&
    timeout "${T_RUN:-200}" $py -m benchmarks.run --only cpu --device "$device" --batch-scale "$scale" \
        --rockmate-python none --out "$out"
    want 3 && echo "== 3. time truth" &&
    timeout "${T_TIME:-150}" $py -m benchmarks.time_truth --budgets ${BUDGETS:-0.6 0.4} --repeats 7 --device "$device" \
        --batch-scale "$scale" --out "$out"
    want 4 && echo "== 4. Inductor" &&
    timeout "${T_INDUCTOR:-180}" $py -m benchmarks.compile_budget --net "${INDUCTOR_NET:-unet}" --device "$device" \
        --batch-scale "$scale" --fractions 1.0 0.5 --fxremat-inductor ${INDUCTOR_BUDGETS:-0.7 min} --repeats 11 \
        $( [[ $device == cuda ]] && echo --early-stop || echo --whole-segments ) --unfitted --out "$out"
    want 5 && echo "== 5. a torchvision ResNet-50 at 0.5 (plain and compiled: measured and predicted peaks, step times)" &&
    timeout "${T_ZOO:-100}" $py -m fxremat.cli bench torchvision:resnet50 --input 64x3x224x224 --budget 0.5 \
        --device "$device" --autotune 0
    want 6 && echo "== 6. time truth, dp_early_stop=True" &&
    timeout "${T_EARLY:-150}" $py -m benchmarks.time_truth --budgets ${BUDGETS:-0.6 0.4} --repeats 7 --device "$device" \
        --batch-scale "$scale" --out "$out" --dp-early-stop
    if want 7 && (( $(nproc) < 4 )); then
        echo "== 7. skipped: four nets at once need 4 cores or more, this machine has $(nproc)"
    elif want 7; then
        echo "== 7. Inductor on four nets at once (compiled side by side, timed one at a time)"
        lock=$(mktemp) quarter=$(( $(nproc) / 4 ))
        i=0
        for net in unet pspnet resnet_chain transformer; do
            timeout "${T_FOUR:-500}" $py -m benchmarks.compile_budget --net $net --device "$device" \
                --batch-scale "$scale" --fractions 1.0 0.5 0.3 --fxremat-inductor ${FOUR_BUDGETS:-0.7 0.5} $( [[ ${UNFITTED:-1} == 1 ]] && echo --unfitted ) \
                --repeats 11 --compiled-only --timing-lock "$lock" --cores $(( i * quarter ))-$(( i * quarter + quarter - 1 )) \
                --out "$out" > "/tmp/compile_inductor_$net.log" 2>&1 &
            i=$(( i + 1 ))
        done
        wait
        tail -n 12 /tmp/compile_inductor_*.log
    fi
    date -u
} 2>&1 | tee "$out/device_check.log"
