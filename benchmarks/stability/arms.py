"""The study's arms as `--set` overrides of one job config: pure, so the test and docs show exactly what each arm runs."""

import json
import math

from sparrow.schedule import SparsitySchedule

ARMS = {
    "a": "dense rollout (no sparsity, controller off)",
    "b": "sparse, controller at tau from the config's schedule",
    "c": "over-aggressive fixed schedule (controller off)",
    "d1": "controller started from a too-small schedule (the ladder's smallest budget in every bin)",
    "d2": "controller started from a too-large schedule (every bin's whole KV)",
}


def _schedule_set(schedule: SparsitySchedule, topk: list[int], tag: str) -> str:
    data = {"name": f"{schedule.name}-{tag}", "edges": list(schedule.edges), "topk_blocks": topk,
            "sink": schedule.sink, "recent": schedule.recent, "block_size": schedule.block_size}
    return "rollout.schedule=" + json.dumps(data)


def covering_topk(schedule: SparsitySchedule, max_model_len: int, ladder: list[int]) -> list[int]:
    """Per bin, the smallest ladder budget that selects every block of the bin's longest context (dense in effect)."""
    ends = list(schedule.edges) + [max_model_len]
    out = []
    for end in ends:
        need = math.ceil(end / schedule.block_size) - schedule.sink - schedule.recent
        out.append(next((v for v in ladder if v >= need), ladder[-1]))
    return out


def arm_overrides(arm: str, schedule: SparsitySchedule | None, target: float, ladder: list[int], max_model_len: int,
                  fixed_topk: int) -> list[str]:
    """`--set` assignments that turn the config into `arm` (its schedule's bins are kept in every arm)."""
    if arm not in ARMS:
        raise ValueError(f"--arm {arm!r}: unknown arm; pick one of {', '.join(ARMS)}")
    if schedule is None or all(k is None for k in schedule.topk_blocks):
        raise ValueError("the config's rollout.schedule is dense; the study needs a sparse schedule to start arm b from "
                         "(set rollout.schedule to a mapping with edges and topk_blocks)")
    bins = len(schedule.edges) + 1
    tau = f"controller.target={target}"
    if arm == "a":
        return ["rollout.schedule=dense", "rollout.dense_bin_edges=" + json.dumps(list(schedule.edges)),
                "controller.enabled=false", tau]
    if arm == "b":
        return [_schedule_set(schedule, list(schedule.topk_blocks), "start"), "controller.enabled=true", tau]
    if arm == "c":
        return [_schedule_set(schedule, [fixed_topk] * bins, f"fixed{fixed_topk}"), "controller.enabled=false", tau]
    if arm == "d1":
        return [_schedule_set(schedule, [ladder[0]] * bins, "too-small"), "controller.enabled=true", tau]
    return [_schedule_set(schedule, covering_topk(schedule, max_model_len, ladder), "too-large"),
            "controller.enabled=true", tau]
