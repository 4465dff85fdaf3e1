"""Sparrow's gRPC API (package `sparrow.v1`): the .proto source and its committed Python stubs.

`from sparrow.protos import sparrow_v1_pb2 as pb, sparrow_v1_pb2_grpc as pb_grpc`.
Regenerate after editing the .proto with `python -m sparrow.protos.generate` (grpcio-tools 1.85.1);
tests/test_grpc_stubs.py fails when the committed stubs differ from a fresh generation.
"""
