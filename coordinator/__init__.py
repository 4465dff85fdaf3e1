"""Coordinator side of Sparrow: the gRPC transport, the closed-loop sparsity controller and metrics."""
