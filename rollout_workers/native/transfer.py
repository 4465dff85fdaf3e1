"""Host-to-device copies that do not wait for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory, and such a copy waits until the stream
has finished everything queued before it: with a decode step in flight (`overlap_decode`) the host would
stall until that step is done. From pinned memory the copy is queued like a kernel and the host goes on.
"""

import torch


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (a list) as a tensor on `device`, copied without blocking the host on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
