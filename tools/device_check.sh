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
# the GPU benchmark.
set -uo pipefail
cd "$(dirname "$0")"
# CUDA libraries: the toolkit's, else the ones PyTorch's wheels ship.
cuda_libs=/usr/local/cuda/lib64
for d in $(python3 -c 'import glob, site; print(" ".join(glob.glob(site.getsitepackages()[0] + "/nvidia/*/lib")))' 2>/dev/null); do
  cuda_libs="$cuda_libs:$d"
done
export LD_LIBRARY_PATH="$PWD/lib:$cuda_libs:${LD_LIBRARY_PATH:-}"
export NCCL_DEBUG=WARN
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
rc=0
gpu_test() {  # runs a GPU test; one that skips saw no GPU, which fails the device check
  local log
  log=$(mktemp)
  "$@" >"$log" 2>&1 || rc=1
  cat "$log"
  if grep -q "^\[  SKIPPED \]" "$log"; then echo "device check: $1 skipped (no GPU seen)"; rc=1; fi
}
gpu_test ./bin/cuda_kernels_test
gpu_test ./bin/nccl_communicator_test
# A worker serving tables on cuda:0 end to end: coordinator + 1 GPU worker, the demo's calls
# through the public API checked against the unsharded result.
timeout 180 ./bin/shardserve up --workers=1 --port=0 --device=cuda:0 --exit_after_demo \
  --server_dir="$PWD/server" || rc=1
# GPU benchmark, shardserve then PyTorch on the same GPU (targets: >= 1.5x PyTorch's bags/s,
# >= 60 % of copy bandwidth; linear within 10 % of F.linear).
./bin/gpu_bench || rc=1
python3 gpu_torch_baseline.py || true
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
