"""The gRPC transport's test wing: valid example messages, a trajectory or control server in a child process
and many-stream load (`harness`), fuzz cases generated with hypothesis (`cases`) and the fuzzer that sends
them and judges every answer (`fuzzer`). Used by the transport tests and benchmarks/fuzz_grpc.py and
grpc_many_clients.py; the product never imports it."""
