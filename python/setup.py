"""Installs the shardserve Python client: ``pip install --no-build-isolation ./python``.

Pure Python over grpcio + protobuf (Debian: python3-grpcio, python3-protobuf, python3-numpy;
python3-torch for shardserve.torch). The build step makes the generated modules
(``shardserve/_proto/shardserve_pb2*.py``) from ``../proto/shardserve.proto`` with ``protoc`` and
``grpc_python_plugin`` (Debian: protobuf-compiler, protobuf-compiler-grpc) into the build
directory, so they are installed with the package and never committed. ``$PROTOC`` and
``$GRPC_PYTHON_PLUGIN`` override where those tools are.
"""

import os
import shutil
import subprocess
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PROTO = os.path.join("proto", "shardserve.proto")


def _tool(env: str, name: str, fallback: str) -> str:
    path = os.environ.get(env) or shutil.which(name) or fallback
    if not os.access(path, os.X_OK):
        raise SystemExit(f"setup.py: {name} not found (Debian: apt-get install protobuf-compiler "
                         f"protobuf-compiler-grpc), or set ${env}")
    return path


def generate(out_dir: str) -> None:
    """Writes shardserve_pb2.py and shardserve_pb2_grpc.py into ``out_dir``.

    protoc runs with the repository root as its proto path, so the file keeps its name
    "proto/shardserve.proto" (as the C++ side registers it); the gRPC module's
    ``from proto import shardserve_pb2`` then becomes a package-relative import."""
    if not os.path.exists(os.path.join(REPO, PROTO)):
        raise SystemExit(f"setup.py: {os.path.join(REPO, PROTO)} not found: build from the "
                         "shardserve repository (python/ beside proto/)")
    protoc = _tool("PROTOC", "protoc", "/usr/bin/protoc")
    plugin = _tool("GRPC_PYTHON_PLUGIN", "grpc_python_plugin", "/usr/bin/grpc_python_plugin")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([protoc, f"--proto_path={REPO}", f"--python_out={tmp}",
                        f"--grpc_python_out={tmp}", f"--plugin=protoc-gen-grpc_python={plugin}",
                        PROTO], check=True)
        os.makedirs(out_dir, exist_ok=True)
        shutil.copy(os.path.join(tmp, "proto", "shardserve_pb2.py"), out_dir)
        with open(os.path.join(tmp, "proto", "shardserve_pb2_grpc.py")) as f:
            grpc_module = f.read()
        fixed = grpc_module.replace("from proto import shardserve_pb2 as",
                                    "from . import shardserve_pb2 as")
        if fixed == grpc_module:
            raise SystemExit("setup.py: the generated gRPC module has no import to fix")
        with open(os.path.join(out_dir, "shardserve_pb2_grpc.py"), "w") as f:
            f.write(fixed)


class BuildWithStubs(build_py):
    """build_py that also generates the protobuf / gRPC modules into the build directory."""

    def run(self) -> None:
        super().run()
        generate(os.path.join(self.build_lib, "shardserve", "_proto"))


setup(
    name="shardserve",
    version="0.1.0",
    description="Python client and drop-in torch modules for shardserve",
    packages=["shardserve", "shardserve._proto"],
    python_requires=">=3.8",
    install_requires=["grpcio", "protobuf", "numpy"],
    extras_require={"torch": ["torch"]},
    cmdclass={"build_py": BuildWithStubs},
)
