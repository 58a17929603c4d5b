"""Finds the CUDA toolkit. Where /usr/local/cuda exists (every build machine of this project) the
@cuda repository wraps it; elsewhere the CUDA targets are tagged manual, so `bazel test //...`
still builds and tests everything else on a plain Debian machine."""

def _cuda_configure_impl(ctx):
    root = ctx.path("/usr/local/cuda")
    available = root.exists and ctx.path("/usr/local/cuda/bin/nvcc").exists
    if available:
        ctx.symlink("/usr/local/cuda/include", "include")
        ctx.file("BUILD", ctx.read(ctx.attr.build_file))
    else:
        ctx.file("BUILD", """package(default_visibility = ["//visibility:public"])
[cc_library(name = n) for n in ["headers", "cudart", "cublas", "nccl"]]
""")
    ctx.file("defs.bzl", """CUDA_AVAILABLE = {available}

def cuda_tags():
    \"\"\"Tags for targets that need the CUDA toolkit: manual where it is missing.\"\"\"
    return [] if CUDA_AVAILABLE else ["manual"]
""".format(available = available))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    attrs = {"build_file": attr.label(allow_single_file = True)},
    local = True,
)
