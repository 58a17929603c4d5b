"""Generated protobuf and gRPC modules of ``proto/shardserve.proto`` (``shardserve_pb2``,
``shardserve_pb2_grpc``). They are made by the build, never committed: ``pip install ./python``
runs protoc + grpc_python_plugin into the installed package, and Bazel's
``//proto:shardserve_py_gen`` genrule makes them for the tests."""
