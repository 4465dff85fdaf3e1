"""The pieces of the colocated placement, outside a job: an engine that gives its KV memory back and takes it
again, and weights handed over in place to another process (shared memory here; CUDA IPC on a GPU)."""

import gc
import json
import pickle
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine
from sparrow.rollout_workers.native.cuda_graphs import DecodeGraphs
from sparrow.schedule import SparsitySchedule
from sparrow.weight_sync import SharedMappings, SharedSender, SharedSource, WeightReceiver, WeightsRefused
from sparrow.weight_sync.send import publish_state_dict

GREEDY = SamplingParams(max_tokens=12, temperature=1e-5, n=2, seed=3, ignore_eos=True)


def _tokens(engine) -> list[list[int]]:
    return [s.token_ids.tolist() for s in engine.generate([RolloutRequest("r", tuple(range(5, 45)), GREEDY)])]


def test_an_engine_gives_its_kv_memory_back_and_generates_the_same_after_waking(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=24)
    engine.set_schedule(SparsitySchedule(name="s", topk_blocks=(1,), edges=()))
    before = _tokens(engine)
    pool = engine.runner.cache.nbytes
    asleep = engine.sleep()
    assert asleep.bytes == pool > 0 and engine.asleep and engine.runner.cache is None
    assert engine.sleep().bytes == 0  # asleep already: nothing more to give
    with pytest.raises(RuntimeError, match="asleep .* wake\\(\\) it first"):
        _tokens(engine)
    state = {n: p.detach().clone() for n, p in engine.runner.model.named_parameters()}
    engine.load_weights(state, 1)  # weights stay resident: a version loads while asleep
    awake = engine.wake()
    assert awake.bytes == pool and not engine.asleep and engine.policy_version == 1
    assert _tokens(engine) == before, "same weights, schedule and seeds: the same tokens after a sleep"
    engine.shutdown()


def test_a_sleep_frees_the_kv_pool_at_once_with_decode_graphs_in_use(tiny_qwen3):
    """The decode graphs' steps refer back to the graphs (a reference cycle); a sleep must still drop the KV pool
    right away, not when Python's cycle collector runs: on an H200 a pool left behind per step ran a colocated job
    out of memory at its fourth step."""
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=24, max_num_seqs=2)
    runner = engine.runner
    for _ in range(3):
        runner.graphs = DecodeGraphs(runner.model, runner.cache, runner.backend, runner.layout, 2,
                                     runner.layout.blocks_for(runner.max_model_len))
        _tokens(engine)
        assert runner.graphs.num_captured > 0
        pool, graphs = weakref.ref(runner.cache), weakref.ref(runner.graphs)
        gc.disable()
        try:
            engine.sleep()
            assert pool() is None and graphs() is None, "the released KV pool is still referenced"
        finally:
            gc.enable()
        engine.wake()
    engine.shutdown()


RECEIVER = textwrap.dedent("""
    import pickle, sys
    from sparrow.weight_sync import SharedMappings, SharedSource, receive_state_dict
    mappings = SharedMappings()
    for line in sys.stdin.buffer:
        handle = pickle.loads(bytes.fromhex(line.decode().strip()))
        state, version = receive_state_dict(SharedSource(handle, mappings), None)
        reply = {"version": version, "sums": {k: float(v.double().sum()) for k, v in state.items()},
                 "sets": len(mappings._sets), "ptr": next(iter(state.values())).data_ptr()}
        sys.stdout.write(pickle.dumps(reply).hex() + "\\n"); sys.stdout.flush()
""")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_versions_are_handed_over_in_place_to_another_process(device):
    """The receiver maps the sender's buffers once (shared memory files; CUDA IPC handles on a GPU) and reads each
    later version from the same memory; a new layout (other tensors) is mapped anew and replaces the old one."""
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    sender = SharedSender(device)

    def hand_over(state, version):
        report = publish_state_dict(state, version, sender, bucket_bytes=4096)
        receiver.stdin.write((pickle.dumps(report.handle).hex() + "\n").encode())
        receiver.stdin.flush()
        return pickle.loads(bytes.fromhex(receiver.stdout.readline().decode().strip()))

    try:
        state = {f"w{i}": torch.randn(300, dtype=torch.bfloat16, device=device) for i in range(8)}
        first = hand_over(state, 1)
        assert first["version"] == 1 and first["sets"] == 1
        assert first["sums"] == pytest.approx({k: float(v.double().sum()) for k, v in state.items()}, rel=1e-6)
        for k in state:
            state[k] += 1.0
        second = hand_over(state, 2)
        assert second["version"] == 2 and second["ptr"] == first["ptr"], "the same mapping, re-read"
        assert second["sums"] == pytest.approx({k: float(v.double().sum()) for k, v in state.items()}, rel=1e-6)
        other = hand_over({"x": torch.ones(5000, device=device)}, 3)
        assert other["version"] == 3 and other["sets"] == 1 and other["sums"] == {"x": 5000.0}
    finally:
        receiver.stdin.close()
        receiver.wait(timeout=30)
        sender.close()


def test_an_engine_takes_a_shared_version_and_refuses_a_non_finite_one(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=24)
    served = {n: p.detach().clone() for n, p in engine.runner.model.named_parameters()}
    sender, mappings = SharedSender("cpu"), SharedMappings()
    try:
        new = {n: t + 0.01 for n, t in served.items()}
        report = publish_state_dict(new, 1, sender, bucket_bytes=1 << 16)
        WeightReceiver(engine).receive(SharedSource(report.handle, mappings))
        assert engine.policy_version == 1
        assert torch.equal(engine.parameters(["model.norm.weight"])["model.norm.weight"], new["model.norm.weight"])
        bad = dict(new)
        bad["model.layers.1.mlp.down_proj.weight"] = new["model.layers.1.mlp.down_proj.weight"].clone()
        bad["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
        report = publish_state_dict(bad, 2, sender, bucket_bytes=1 << 16)
        with pytest.raises(WeightsRefused, match="version 2 refused, still serving version 1: "
                           "model.layers.1.mlp.down_proj.weight: contains NaN"):
            WeightReceiver(engine).receive(SharedSource(report.handle, mappings))
        assert engine.policy_version == 1
        assert torch.equal(engine.parameters(["model.norm.weight"])["model.norm.weight"], new["model.norm.weight"])
    finally:
        sender.close()
        engine.shutdown()


def test_a_closed_sender_is_named_by_a_receiver_mapping_it_for_the_first_time():
    sender = SharedSender("cpu")
    report = publish_state_dict({"w": torch.ones(10)}, 1, sender, bucket_bytes=1024)
    sender.close()
    with pytest.raises(FileNotFoundError, match="shared weight buffer .* is gone"):
        SharedSource(report.handle, SharedMappings()).bucket(0, None)


def test_buffers_of_a_sender_that_died_are_removed_by_the_next_one():
    from sparrow.weight_sync.shared import remove_orphans, shm_dir

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    orphan = shm_dir() / f"sparrow-weights-{dead.strip()}-0-0"
    orphan.write_bytes(b"\0" * 64)
    mine = SharedSender("cpu")
    publish_state_dict({"w": torch.ones(4)}, 1, mine, bucket_bytes=1024)
    try:
        assert not orphan.exists(), "a dead sender's buffer is removed when a sender allocates"
        assert remove_orphans() == [] and all(p.exists() for p in mine._paths), "a live sender's are kept"
    finally:
        mine.close()


def _run(**settings):
    from sparrow.coordinator.config import RunConfig

    return RunConfig(**settings)


def test_the_weights_channel_follows_where_ranks_and_workers_compute():
    from sparrow.coordinator.job.publication import choose_channel

    sync, gpu_a, gpu_b, gpu_c = _run(mode="sync"), "GPU-a", "GPU-b", "GPU-c"
    assert choose_channel(_run(placement="colocated"), [gpu_a], [gpu_a]) == "shared"
    assert choose_channel(_run(placement="colocated"), [None], [None]) == "shared", "shared memory on a CPU"
    assert choose_channel(sync, [gpu_a], [gpu_a]) == "shared", "0.5 + 0.5 of one GPU, disaggregated: in place"
    assert choose_channel(sync, [gpu_a, gpu_b], [gpu_b, gpu_a]) == "shared", "each worker on some rank's GPU"
    assert choose_channel(sync, [gpu_a], [gpu_b, gpu_c]) == "collective", "GPUs of their own: NCCL broadcast"
    assert choose_channel(sync, [gpu_a], [gpu_b, gpu_b]) == "object_store", "two workers on one GPU: no NCCL group"
    assert choose_channel(sync, [gpu_a], [gpu_a, gpu_b]) == "object_store", "one worker beside rank 0, one apart"
    assert choose_channel(_run(mode="async", max_staleness=1), [gpu_a], [gpu_a]) == "object_store"
    assert choose_channel(sync, [None], [None]) == "object_store", "CPU trainers: the object store"
    assert choose_channel(_run(mode="sync", weights_channel="object_store"), [gpu_a], [gpu_b]) == "object_store"


def test_an_explicit_collective_channel_over_a_shared_gpu_is_refused_naming_both():
    from sparrow.coordinator.job.publication import choose_channel

    run = _run(mode="sync", weights_channel="collective")
    assert choose_channel(run, ["GPU-a"], ["GPU-b"]) == "collective"
    with pytest.raises(ValueError, match="trainer rank 0 and rollout-0 share GPU GPU-a.*use 'auto'"):
        choose_channel(run, ["GPU-a"], ["GPU-a"])
    with pytest.raises(ValueError, match="rollout-0 and rollout-1 share GPU GPU-b"):
        choose_channel(run, ["GPU-a"], ["GPU-b", "GPU-b"])


RANK_SCRIPT = textwrap.dedent("""
    import json, socket, sys
    import torch
    from sparrow.trainer import Trajectory, TrajectoryBatch, TrainerRank

    model, offload = sys.argv[1], sys.argv[2] == "1"
    rank = TrainerRank({"model": model, "zero_stage": 2, "gradient_checkpointing": False,
                        "optimizer": {"lr": 1e-2, "weight_decay": 0.1}}, 0, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank.setup("127.0.0.1", port)
    inner = rank.engine.optimizer.optimizer
    if offload:
        rank.offload_states()
    made = sum(bool(inner.state[p]) for group in inner.param_groups for p in group["params"])
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(3, 2000, (6,), generator=g), torch.randint(3, 2000, (5,), generator=g)) for _ in range(4)]
    forced = rank.recompute(TrajectoryBatch([Trajectory(p, r, torch.zeros(5), advantage=1.0) for p, r in rows]))
    batch = TrajectoryBatch([Trajectory(p, r, lp, advantage=(-1.0) ** i, group_id=str(i // 2))
                             for i, ((p, r), lp) in enumerate(zip(rows, forced.logprobs))])
    for _ in range(2):
        if offload:
            rank.reload_states()
        rank.train_step(batch)
        if offload:
            rank.offload_states()
    weights = [p.detach().double() for p in rank.engine.module.parameters()]
    print(json.dumps({"made": made, "params": sum(len(g["params"]) for g in inner.param_groups),
                      "sums": [float(w.sum()) for w in weights], "squares": [float(w.square().sum()) for w in weights]}))
""")


@pytest.mark.slow
def test_a_ranks_first_offload_makes_adams_moments_and_training_is_unchanged(tiny_qwen3):
    """A colocated rank's start-up offload makes Adam's moments in DeepSpeed's optimizer (so their pinned host buffers
    are allocated before the first step, not inside it), and two updates then give the weights a rank that never
    offloaded gets, bit for bit (ZeRO-2, the CPU's gloo)."""
    runs = {flag: subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(tiny_qwen3), flag], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for flag in ("0", "1")}
    out = {}
    for flag, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        out[flag] = json.loads(stdout.strip().splitlines()[-1])
    assert out["0"]["made"] == 0 and out["1"]["made"] == out["1"]["params"] > 0
    assert out["1"]["sums"] == out["0"]["sums"] and out["1"]["squares"] == out["0"]["squares"]
