"""Micro-batches by token budget: length bucketing with right padding.

Trajectories are sorted by total length and cut greedily so that rows × longest row ≤ the budget;
a sequence longer than the budget runs alone (with gradient checkpointing and chunked log-softmax,
memory then grows with its length only linearly apart from attention). Right padding keeps every
real token at its own position, so causal attention never looks at padding.
"""

from dataclasses import dataclass

import torch

from .batch import Trajectory


def plan_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Index lists, longest sequences first; every index appears exactly once."""
    if token_budget < 1:
        raise ValueError(f"token_budget={token_budget}: must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plans: list[list[int]] = []
    for i in order:
        if plans and (len(plans[-1]) + 1) * lengths[plans[-1][0]] <= token_budget:
            plans[-1].append(i)
        else:
            plans.append([i])
    return plans


@dataclass
class MicroBatch:
    indices: list[int]
    """Positions of these rows in the caller's trajectory list."""
    input_ids: torch.Tensor
    """`[B, T]` right-padded prompt + response."""
    attention_mask: torch.Tensor
    prompt_lens: list[int]
    response_lens: list[int]

    @property
    def num_rows(self) -> int:
        return len(self.indices)

    def predicting_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, position) of the hidden state that predicts each response token, rows in order.

        Response token t of a row with prompt length P sits at position P + t and is predicted
        by position P + t − 1.
        """
        rows, cols = [], []
        for b, (p, r) in enumerate(zip(self.prompt_lens, self.response_lens)):
            rows.append(torch.full((r,), b, dtype=torch.long))
            cols.append(torch.arange(p - 1, p + r - 1))
        return torch.cat(rows), torch.cat(cols)

    def targets(self) -> torch.Tensor:
        rows, cols = self.predicting_positions()
        return self.input_ids[rows, cols + 1]

    def per_row(self, values: torch.Tensor) -> list[torch.Tensor]:
        """A per-response-token tensor of this micro-batch cut into its rows."""
        return list(values.split(self.response_lens))

    def per_token(self, trajectories: list[Trajectory], attr: str, device: torch.device) -> torch.Tensor:
        """One value per response token of the rows, on `device`: a trajectory field (`rollout_logprobs`), its
        `advantage` repeated, or its loss `mask`."""
        rows = [trajectories[i] for i in self.indices]
        if attr == "advantage":
            values = [torch.full((t.response_len,), float(t.advantage)) for t in rows]
        elif attr == "mask":
            values = [t.response_mask() for t in rows]
        else:
            values = [getattr(t, attr) for t in rows]
        return torch.cat(values).to(device)


def collate(trajectories: list[Trajectory], indices: list[int], pad_id: int) -> MicroBatch:
    rows = [trajectories[i] for i in indices]
    longest = max(t.total_len for t in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for b, t in enumerate(rows):
        input_ids[b, : t.total_len] = torch.cat([t.prompt_ids.long(), t.response_ids.long()])
        attention_mask[b, : t.total_len] = 1
    return MicroBatch(
        indices=list(indices),
        input_ids=input_ids,
        attention_mask=attention_mask,
        prompt_lens=[t.prompt_len for t in rows],
        response_lens=[t.response_len for t in rows],
    )
