"""The gRPC transport's test wing: valid example messages (`examples`), a trajectory or control server in a
child process and many-stream load (`harness`), a relay counting the bytes a server takes (`relay`), requests
generated with hypothesis (`cases`, hand-made wire bytes in `protowire`), the oracle written from the documented
rules (`oracle`) and the fuzzer that sends the requests and judges every answer (`fuzzer`). Used by the transport
tests and benchmarks/fuzz_grpc.py and grpc_many_clients.py; the product never imports it."""
