"""Rollout backends behind one contract (`api`): the native engine (`native`) and vLLM (`vllm_backend`)."""
