"""What a calibration run profiles: its length bins, its ladder of budgets, and the fixed-budget
schedule rolled out at each budget. Pure functions."""

import math

import torch

from sparrow.acceptance import token_context_lengths
from sparrow.layout import BLOCK_SIZE, DEFAULT_LAYOUT
from sparrow.schedule import SPARROW_EDGES, SparsitySchedule

PAPER_BUDGETS = (32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024)
"""Sparrow's 18 profiled configurations, total blocks of 16 tokens (Fig. 3's "16 32" … "16 1024")."""

SHORT_BUDGETS = (4, 8, 16, 24)
"""Below the paper's ladder, for contexts of a few hundred tokens (CPU runs, small models)."""


def context_blocks(length: int, block_size: int = BLOCK_SIZE) -> int:
    return math.ceil(length / block_size)


def default_budgets(longest_context: int, reserved: int, block_size: int = BLOCK_SIZE) -> list[int]:
    """The ladder's budgets that are sparse somewhere: above the reserved sink + recent blocks and
    below the longest context's block count (a budget covering every context is the dense baseline)."""
    blocks = context_blocks(longest_context, block_size)
    return [b for b in SHORT_BUDGETS + PAPER_BUDGETS if reserved < b < blocks]


def bin_edges(bin_width: int, longest_context: int) -> list[int]:
    """Edges every `bin_width` tokens below the longest context (the last bin is open-ended)."""
    if bin_width < 1:
        raise ValueError(f"bin_width={bin_width}: must be >= 1 token")
    return list(range(bin_width, longest_context, bin_width))


def calibration_template(
    edges: list[int] | tuple[int, ...] | None, sink: int = DEFAULT_LAYOUT.sink, recent: int = DEFAULT_LAYOUT.recent,
    block_size: int = BLOCK_SIZE,
) -> SparsitySchedule:
    """A dense schedule carrying the run's bins, block size, sink and recent."""
    edges = tuple(SPARROW_EDGES if edges is None else edges)
    return SparsitySchedule(
        name="calibration", topk_blocks=(None,) * (len(edges) + 1), edges=edges, sink=sink, recent=recent,
        block_size=block_size,
    )


def fixed_budget_schedule(template: SparsitySchedule, budget: int) -> SparsitySchedule:
    """Every bin attends `budget` blocks in total (sink and recent included)."""
    topk = budget - template.sink - template.recent
    if topk < 0:
        raise ValueError(
            f"budget {budget}: below the sink ({template.sink}) + recent ({template.recent}) blocks every row attends"
        )
    return template.with_topk([topk] * template.num_bins, version=0, name=f"fixed-{budget}")


def token_length_bins(template: SparsitySchedule, prompt_len: int, num_tokens: int) -> torch.Tensor:
    """Length bin of each generated token: token t was produced by the pass whose context held
    L = prompt_len + t tokens, so it goes to `template.bin_of(prompt_len + t)`, binned by the
    trainer's own functions so calibration and training agree on every token's bin."""
    return template.bins_for_lengths(token_context_lengths(prompt_len, num_tokens))


def sparse_token_mask(blocks_attended: torch.Tensor, prompt_len: int, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Which generated tokens came from a pass that attended fewer blocks than its context held."""
    lengths = token_context_lengths(prompt_len, blocks_attended.shape[0])
    return blocks_attended.long().cpu() < (lengths + block_size - 1) // block_size
