#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU only) as a benchmark peer; never part of CI or the tests.
#
# The llama.cpp sources come from the sdist of `llama-cpp-python` on PyPI (it vendors llama.cpp
# under vendor/llama.cpp), so the build needs PyPI only, not GitHub. Only the llama-server target
# is built, Release, with GGML_NATIVE=OFF and this CPU's instruction sets named one by one from
# /proc/cpuinfo: -march=native can pick extensions that a VM's CPU advertises but traps on.
# No CUDA, Metal, curl, OpenSSL or web UI.
#
# Idempotent: a build for the same version and flags is reused (an interrupted one resumes where
# it stopped). The binary's path is the one line
# this script writes on stdout (everything else goes to stderr):
#   BIN=$(bash bench/build_llama_server.sh)            # $HOME/.cache/maskwire-peers/...
#   bash bench/build_llama_server.sh --dir /tmp/peers --version 0.3.36 --jobs 2
# --cpu-flags "sse4_2 avx avx2 bmi2 fma f16c" builds for those instruction sets instead of this
# CPU's (an AVX2-only host's build, to run beside the other engines held to AVX2).
set -euo pipefail

VERSION=0.3.36
DIR="${HOME}/.cache/maskwire-peers"
JOBS=2
CPU_FLAGS=""
PYTHON="${PYTHON:-python3}"

while [[ $# -gt 0 ]]; do
    case "$1" in
        --dir) DIR="$2"; shift 2 ;;
        --version) VERSION="$2"; shift 2 ;;
        --jobs) JOBS="$2"; shift 2 ;;
        --cpu-flags) CPU_FLAGS="$2"; shift 2 ;;
        -h | --help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done

log() { echo "[build_llama_server] $*" >&2; }

# --- this CPU's instruction sets (or --cpu-flags), as ggml's cmake options ----------------------
flags=" ${CPU_FLAGS:-$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2)} "
has() { [[ "$flags" == *" $1 "* ]]; }
onoff() { if has "$1"; then echo ON; else echo OFF; fi; }
# GGML_AVX512 compiles with -mavx512f/cd/vl/dq/bw together, so it needs all five.
avx512=OFF
if has avx512f && has avx512cd && has avx512vl && has avx512dq && has avx512bw; then avx512=ON; fi
isa=(
    -DGGML_SSE42="$(onoff sse4_2)"
    -DGGML_AVX="$(onoff avx)"
    -DGGML_AVX2="$(onoff avx2)"
    -DGGML_BMI2="$(onoff bmi2)"
    -DGGML_FMA="$(onoff fma)"
    -DGGML_F16C="$(onoff f16c)"
    -DGGML_AVX_VNNI="$(onoff avx_vnni)"
    -DGGML_AVX512="$avx512"
)
if [[ $avx512 == ON ]]; then
    isa+=(
        -DGGML_AVX512_VBMI="$(onoff avx512vbmi)"
        -DGGML_AVX512_VNNI="$(onoff avx512_vnni)"
        -DGGML_AVX512_BF16="$(onoff avx512_bf16)"
    )
fi
isa+=(
    -DGGML_AMX_TILE="$(onoff amx_tile)"
    -DGGML_AMX_INT8="$(onoff amx_int8)"
    -DGGML_AMX_BF16="$(onoff amx_bf16)"
)

cmake_args=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=OFF
    -DGGML_CPU_ALL_VARIANTS=OFF
    -DGGML_BACKEND_DL=OFF
    -DGGML_CUDA=OFF
    -DGGML_METAL=OFF
    -DGGML_VULKAN=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_SERVER=ON
    "${isa[@]}"
)

# --- idempotency: one build directory per version and flag set ----------------------------------
key="llama-cpp-python==${VERSION} ${cmake_args[*]}"
tag="$(printf '%s' "$key" | sha256sum | cut -c1-10)"
build="${DIR}/llama-server-${VERSION}-${tag}"
bin="${build}/bin/llama-server"
if [[ -x "$bin" && -f "${build}/built.txt" ]] && [[ "$(head -1 "${build}/built.txt")" == "$key" ]]; then
    log "already built for this version and these flags"
    echo "$bin"
    exit 0
fi

# --- sources: the llama-cpp-python sdist from PyPI ----------------------------------------------
mkdir -p "$DIR"
sdist="${DIR}/llama_cpp_python-${VERSION}.tar.gz"
if [[ ! -f "$sdist" ]]; then
    log "downloading the llama-cpp-python ${VERSION} sdist from PyPI"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
        "llama-cpp-python==${VERSION}" -d "$DIR" >&2
fi
src="${DIR}/llama_cpp_python-${VERSION}"
if [[ ! -f "${src}/vendor/llama.cpp/CMakeLists.txt" ]]; then
    log "unpacking $sdist"
    rm -rf "$src"
    tar -xzf "$sdist" -C "$DIR"
fi
llama="${src}/vendor/llama.cpp"
[[ -f "${llama}/CMakeLists.txt" ]] || { log "no vendored llama.cpp in $src"; exit 1; }
# Older llama.cpp still has the curl option; newer ones warn that it is deprecated and ignored.
if grep -q 'option(LLAMA_CURL' "${llama}/CMakeLists.txt"; then cmake_args+=(-DLLAMA_CURL=OFF); fi

# --- configure and build the one target ---------------------------------------------------------
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
log "configuring in $build: ${isa[*]}"
started=$(date +%s)
cmake -S "$llama" -B "$build" "${generator[@]}" "${cmake_args[@]}" >&2
log "building llama-server with $JOBS jobs"
cmake --build "$build" --target llama-server -j "$JOBS" >&2
"$bin" --version >&2
printf '%s\nbuilt in %ss on %s\n' "$key" "$(($(date +%s) - started))" "$(date -u +%FT%TZ)" \
    > "${build}/built.txt"
log "built in $(($(date +%s) - started))s"
echo "$bin"
