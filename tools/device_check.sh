#!/usr/bin/env bash
# Prepares the GPU device check: builds here (no GPU needed), then collects the test binaries and
# every shared library they load except the C runtime and the CUDA driver into .device/ (ignored
# by git; carry it to the GPU machine). On the GPU machine run: .device/run.sh
#   tools/device_check.sh             # prepare
#   .device/run.sh                    # on the machine with the GPU (< 8 minutes)
# It checks the CUDA kernels against a CPU reference on fresh random inputs, the NCCL communicator
# with world size 1, a cuda:0 worker end to end (GPU-only worker build, no LibTorch), then runs the
# GPU benchmark against PyTorch on the same GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
bazel build -c opt //core:cuda_kernels_test //core:nccl_communicator_test //bench:gpu_bench \
  //server:worker_gpu_main //server:coordinator_main //client:shardserve
rm -rf .device
mkdir -p .device/bin .device/lib .device/server
cp -L .bazel/bin/core/cuda_kernels_test .bazel/bin/core/nccl_communicator_test \
  .bazel/bin/bench/gpu_bench .bazel/bin/client/shardserve .device/bin/
# The end-to-end check runs a GPU-only worker (no LibTorch) under the name `up` looks for.
cp -L .bazel/bin/server/worker_gpu_main .device/server/worker_main
cp -L .bazel/bin/server/coordinator_main .device/server/
cp bench/gpu_torch_baseline.py .device/
# Libraries are looked up from the binaries where Bazel built them: tests link Bazel's own
# shared libraries through an RPATH relative to their build location. Anything still missing
# fails the bundle here, not on the GPU machine.
for bin in .bazel/bin/core/cuda_kernels_test .bazel/bin/core/nccl_communicator_test \
    .bazel/bin/bench/gpu_bench .bazel/bin/client/shardserve .bazel/bin/server/worker_gpu_main \
    .bazel/bin/server/coordinator_main; do
  ldd "$bin" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      # The C runtime, the driver and the CUDA libraries come from the GPU machine.
      libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libcuda.so*) ;;
      libcudart.so*|libcublas*.so*|libnccl.so*) ;;
      *) cp -Ln "$lib" .device/lib/ ;;
    esac
  done
done
cat > .device/run.sh <<'RUN'
#!/usr/bin/env bash
# Runs on the GPU machine: kernel conformance, NCCL with world size 1, a cuda:0 worker end to end,
# the GPU benchmark. Every step has its own time limit, so one hang cannot eat the others' time.
set -uo pipefail
cd "$(dirname "$0")"
# CUDA libraries: wherever the machine has them (the toolkit's lib64, else PyTorch's wheels).
sites=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)
cuda_libs=""
for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
  # shellcheck disable=SC2086
  found=$(find -H /usr/local/cuda/lib64 /usr/local/cuda/targets $sites /usr/lib/x86_64-linux-gnu \
            -name "$lib" 2>/dev/null | head -1)
  if [ -z "$found" ]; then echo "device check: $lib not found"; continue; fi
  cuda_libs="$cuda_libs:$(dirname "$found")"
done
export LD_LIBRARY_PATH="$PWD/lib$cuda_libs:${LD_LIBRARY_PATH:-}"
export NCCL_DEBUG=WARN
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader || true
rc=0
gpu_test() {  # limit, then a GPU test; one that skips saw no GPU, which fails the device check
  local limit=$1 log
  shift
  log=$(mktemp)
  timeout "$limit" "$@" >"$log" 2>&1 || { echo "device check: $1 failed"; rc=1; }
  cat "$log"
  if grep -q "^\[  SKIPPED \]" "$log"; then echo "device check: $1 skipped (no GPU seen)"; rc=1; fi
}
gpu_test 150 ./bin/cuda_kernels_test
gpu_test 60 ./bin/nccl_communicator_test
# A worker serving tables on cuda:0 end to end: coordinator + 1 GPU worker, the demo's calls
# through the public API checked against the unsharded result.
timeout 120 ./bin/shardserve up --workers=1 --port=0 --device=cuda:0 --exit_after_demo \
  --server_dir="$PWD/server" || { echo "device check: end to end failed"; rc=1; }
# GPU benchmark, shardserve and PyTorch alternately on the same GPU (targets: >= 1.5x PyTorch's
# bags/s, >= 60 % of copy bandwidth; linear within 10 % of F.linear).
for round in 1 2; do
  echo "benchmark round $round"
  timeout 90 ./bin/gpu_bench --iters=50 || { echo "device check: gpu_bench failed"; rc=1; }
  timeout 90 python3 gpu_torch_baseline.py --iters=50 || echo "device check: PyTorch baseline failed"
done
echo "device check: rc=$rc"
exit $rc
RUN
chmod +x .device/run.sh
for bin in .device/bin/* .device/server/*; do
  missing=$(LD_LIBRARY_PATH="$PWD/.device/lib:/usr/local/cuda/lib64" ldd "$bin" | grep "not found" |
            grep -v -E "libcuda\.so|libcudart|libcublas|libnccl" || true)
  if [ -n "$missing" ]; then
    echo "device_check: $bin would not load:" >&2
    echo "$missing" >&2
    exit 1
  fi
done
du -sh .device
