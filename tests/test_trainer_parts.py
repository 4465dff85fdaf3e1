"""Single-process pieces of the trainer: batch format, micro-batching, chunked log-probs, α binning,
weight buckets, config validation, sparse attention inside an HF model."""

import copy

import pytest
import torch

from sparrow.acceptance import AlphaHistogram, acceptance_bounds_topk
from sparrow.schedule import load_schedule
from sparrow.trainer.alpha import AlphaReport, add_trajectory_alpha
from sparrow.trainer.batch import Trajectory, TrajectoryBatch
from sparrow.trainer.config import OptimizerConfig, TrainerConfig
from sparrow.trainer.engine import initialize_adam_states, lr_lambda
from sparrow.trainer.logprobs import token_stats
from sparrow.trainer.microbatch import collate, plan_micro_batches
from sparrow.weight_sync import Manifest, pack, plan_buckets, unpack


def _traj(p, r, seed=0, k=4, **kw):
    g = torch.Generator().manual_seed(seed)
    return Trajectory(
        prompt_ids=torch.randint(0, 100, (p,), generator=g),
        response_ids=torch.randint(0, 100, (r,), generator=g),
        rollout_logprobs=-torch.rand(r, generator=g),
        top_ids=torch.randint(0, 100, (r, k), generator=g) if k else None,
        top_logprobs=-torch.rand(r, k, generator=g).sort(-1).values if k else None,
        **kw,
    )


def test_trajectory_validation_names_the_problem():
    TrajectoryBatch([_traj(3, 5)]).validate(vocab_size=100)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TrajectoryBatch([_traj(3, 5)]).validate(vocab_size=50)
    bad = _traj(3, 5)
    bad.rollout_logprobs = torch.zeros(4)
    with pytest.raises(ValueError, match=r"rollout_logprobs has shape \(4,\); expected \(5,\)"):
        TrajectoryBatch([bad]).validate()
    with pytest.raises(ValueError, match="advantage is None"):
        TrajectoryBatch([_traj(3, 5)]).validate(need_advantages=True)
    with pytest.raises(ValueError, match="empty"):
        TrajectoryBatch([]).validate()
    half = _traj(3, 5)
    half.top_logprobs = None
    with pytest.raises(ValueError, match="both top_ids and top_logprobs"):
        TrajectoryBatch([half]).validate()


def test_shard_balances_tokens_and_keeps_every_trajectory():
    batch = TrajectoryBatch([_traj(4, r, seed=r) for r in (50, 40, 30, 20, 10, 5, 5)])
    shards = batch.shard(2)
    assert sorted(i for idx, _ in shards for i in idx) == list(range(7))
    loads = [s.num_tokens for _, s in shards]
    assert abs(loads[0] - loads[1]) <= 10
    assert [len(s) for _, s in TrajectoryBatch([_traj(2, 3)]).shard(3)] == [1, 0, 0]


def test_micro_batches_respect_the_token_budget():
    lengths = [100, 7, 30, 64, 64, 5, 300]
    plans = plan_micro_batches(lengths, 128)
    assert sorted(i for p in plans for i in p) == list(range(len(lengths)))
    for p in plans:
        assert len(p) == 1 or len(p) * max(lengths[i] for i in p) <= 128
    assert plans[0] == [6]  # longer than the budget: alone


def test_collate_positions_predict_the_response():
    trajs = [_traj(3, 4, seed=1), _traj(5, 2, seed=2)]
    mb = collate(trajs, [1, 0], pad_id=0)
    assert mb.input_ids.shape == (2, 7) and mb.attention_mask.sum(1).tolist() == [7, 7]
    rows, cols = mb.predicting_positions()
    assert cols.tolist() == [4, 5, 2, 3, 4, 5]
    assert torch.equal(mb.targets(), torch.cat([trajs[1].response_ids, trajs[0].response_ids]))


def test_chunked_token_stats_equal_the_full_log_softmax():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(37, 16, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    stats = token_stats(hidden, targets, head, temperature=0.7, topk=5, chunk_tokens=8)
    full = torch.log_softmax(head(hidden).float() / 0.7, -1)
    assert torch.allclose(stats.logprobs, full.gather(-1, targets[:, None])[:, 0], atol=1e-6)
    assert torch.allclose(stats.top_logprobs, full.topk(5).values, atol=1e-6)
    assert torch.allclose(stats.entropy, -(full.exp() * full).sum(-1), atol=1e-5)
    stats.logprobs.sum().backward()
    g_chunked = hidden.grad.clone()
    hidden.grad = None
    full.gather(-1, targets[:, None]).sum().backward()
    assert torch.allclose(g_chunked, hidden.grad, atol=1e-6)


def test_alpha_report_equals_direct_binning():
    schedule = load_schedule("qwen3-1.7b-0.86")
    report = AlphaReport(schedule.num_bins)
    trajs = [_traj(1990, 30, seed=3, schedule_version=2), _traj(10, 20, seed=4, schedule_version=5)]
    trajs[0].loss_mask = torch.arange(30) % 3 != 0
    direct = {2: AlphaHistogram.empty(schedule.num_bins), 5: AlphaHistogram.empty(schedule.num_bins)}
    for t in trajs:
        g = torch.Generator().manual_seed(t.prompt_len)
        ids = torch.randint(0, 100, (t.response_len, 4), generator=g)
        lp = -torch.rand(t.response_len, 4, generator=g).sort(-1).values
        add_trajectory_alpha(report, t, ids, lp, schedule)
        lo, _ = acceptance_bounds_topk(ids, lp, t.top_ids, t.top_logprobs)
        for j in range(t.response_len):
            if t.response_mask()[j]:
                direct[t.schedule_version].add(lo[j : j + 1], torch.tensor([schedule.bin_of(t.prompt_len + j)]))
    for v in (2, 5):
        assert torch.equal(report.lower[v].counts, direct[v].counts)
        assert torch.allclose(report.lower[v].sums, direct[v].sums)
    assert report.lower[2].count()[:2].tolist() == [0, 20]  # L = 1990 + t ≥ 1985: bin 1 (t=0 included)
    merged = report.merge(report)
    assert merged.tokens() == 2 * report.tokens()
    assert schedule.bins_for_lengths(torch.tensor([1, 1984, 1985, 3984, 3985, 50000])).tolist() == [0, 0, 1, 1, 2, 19]


def test_buckets_round_trip_and_split_by_size_and_dtype():
    sd = {"a": torch.randn(10, 10), "b": torch.randn(300), "c": torch.randn(5).bfloat16(), "d": torch.randn(2, 3)}
    buckets = plan_buckets([(k, tuple(v.shape), v.dtype) for k, v in sd.items()], bucket_bytes=1000)
    assert [b.dtype for b in buckets] == ["float32", "float32", "bfloat16", "float32"]
    assert [[e.name for e in b.entries] for b in buckets] == [["a"], ["b"], ["c"], ["d"]]
    manifest = Manifest.from_json(Manifest(7, buckets).to_json())
    assert manifest.version == 7 and manifest.names == list(sd)
    out = {}
    for b in manifest.buckets:
        out.update(unpack(b, pack(b, sd)))
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    with pytest.raises(ValueError, match="listed twice"):
        plan_buckets([("x", (1,), torch.float32)] * 2, 100)
    with pytest.raises(ValueError, match="manifest says"):
        unpack(manifest.buckets[0], torch.zeros(3))


def test_config_validation_names_field_and_fix(tiny_qwen3):
    with pytest.raises(ValueError, match="zero_stage"):
        TrainerConfig(model=str(tiny_qwen3), zero_stage=4)
    with pytest.raises(ValueError, match="use zero_stage 1 or 2"):
        TrainerConfig(model=str(tiny_qwen3), zero_stage=3, distill_sparse={"enabled": True})
    with pytest.raises(ValueError, match="needs total_steps"):
        TrainerConfig(model=str(tiny_qwen3), optimizer={"decay": "cosine"})
    with pytest.raises(ValueError, match="mask_band"):
        TrainerConfig(model=str(tiny_qwen3), loss={"mask_band": [2.0, 1.0]})
    with pytest.raises(ValueError, match="extra"):
        TrainerConfig(model=str(tiny_qwen3), lr=1.0)


def test_lr_schedule_warmup_and_decay():
    f = lr_lambda(OptimizerConfig(warmup_steps=4, decay="cosine", total_steps=14, min_lr_ratio=0.1))
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0) and f(9) == pytest.approx(0.55) and f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    lin = lr_lambda(OptimizerConfig(decay="linear", total_steps=10))
    assert lin(5) == pytest.approx(0.5)


@pytest.mark.parametrize("options", [{}, {"amsgrad": True}, {"foreach": False}, {"fused": True}])
def test_adam_states_made_up_front_train_bitwise_as_lazily_made_ones(options):
    """A colocated rank makes Adam's moments before its start-up offload (their pinned buffers are then allocated
    outside the first step): the same updates, the same states, as the moments torch makes at the first step."""
    torch.manual_seed(0)
    lazy_model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    eager_model = copy.deepcopy(lazy_model)
    make = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, **options)  # noqa: E731
    lazy, eager = make(lazy_model), make(eager_model)
    assert initialize_adam_states(eager) == 4 and initialize_adam_states(eager) == 0
    for _ in range(3):
        x = torch.randn(5, 8)
        for model, optimizer in ((lazy_model, lazy), (eager_model, eager)):
            optimizer.zero_grad()
            model(x).square().sum().backward()
            optimizer.step()
    for a, b in zip(lazy_model.parameters(), eager_model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(lazy.state.values(), eager.state.values(), strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) and (a[k].dtype, a[k].device) == (b[k].dtype, b[k].device) for k in a)


def test_sparse_forward_matches_native_engine_teacher_forcing(tiny_qwen3):
    """The trainer's HF sparse forward (no adapter) reproduces the native engine's teacher-forced
    sparse log-probs: same selection rule, same budgets at L = i + 1, dense prompt positions."""
    from transformers import AutoModelForCausalLM

    from sparrow.rollout_workers.native import NativeEngine
    from sparrow.schedule import SparsitySchedule
    from sparrow.trainer import sparse_attention
    from sparrow.kernels import SparseAttentionConfig
    from sparrow.trainer.forward import PolicyModule, PolicyRunner

    schedule = SparsitySchedule(name="tiny", topk_blocks=(1,) * 20)  # 4 blocks = 64 tokens per row
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32, attn_implementation=sparse_attention.register())
    module = PolicyModule(model, temperature=1.0, topk=5, chunk_tokens=64)
    fwd = PolicyRunner(module, module, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    trajs = [_traj(20, 180, seed=5, k=0), _traj(40, 100, seed=6, k=0)]
    for t in trajs:
        t.prompt_ids = torch.randint(3, 2000, (t.prompt_len,), generator=g)
        t.response_ids = torch.randint(3, 2000, (t.response_len,), generator=g)
    mb = collate(trajs, [0, 1], pad_id=0)
    cfg = SparseAttentionConfig(dense_layers=(0, 1))
    with torch.no_grad():
        budgets = sparse_attention.query_budgets(mb.prompt_lens, 200, schedule)
        sparse = fwd.stats(mb, sparse_attention.SparseForward.of(cfg, budgets, [200, 140]))  # the second row right-padded
        dense = fwd.stats(mb)
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=64)
    offset = 0
    for t in trajs:
        ids = torch.cat([t.prompt_ids, t.response_ids])
        ref = engine.teacher_forced_logprobs(ids, t.prompt_len, schedule=schedule)
        ours = sparse.logprobs[offset : offset + t.response_len]
        assert torch.allclose(ours, ref.logprobs, atol=2e-5), (ours - ref.logprobs).abs().max()
        offset += t.response_len
    assert (sparse.logprobs - dense.logprobs).abs().max() > 1e-3  # the schedule really is sparse here


def test_fp8_sparse_forward_reproduces_what_an_fp8_engine_sampled(tiny_qwen3):
    """With FP8 KV pages the rollout policy reads rounded K/V: the trainer's sparse forward with the engines'
    kv_cache_dtype reproduces the FP8 engine's sampled log-probs, the same forward without it does not (it would
    measure exact α against a q the engine never sampled from); the rounding passes gradients straight through."""
    from transformers import AutoModelForCausalLM

    from sparrow.kernels import SparseAttentionConfig
    from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
    from sparrow.rollout_workers.native import NativeEngine
    from sparrow.schedule import SparsitySchedule
    from sparrow.trainer import sparse_attention
    from sparrow.trainer.forward import PolicyModule, PolicyRunner

    schedule = SparsitySchedule(name="s", topk_blocks=(4,), edges=())
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=128, kv_cache_dtype="fp8_e4m3", prefill_chunk_size=64)
    engine.set_schedule(schedule)
    prompt = tuple(range(5, 105))
    samples = engine.generate([RolloutRequest("r", prompt, SamplingParams(max_tokens=40, ignore_eos=True, n=2, seed=1))])
    trajs = [_traj(len(prompt), 40, k=0) for _ in samples]
    for t, s in zip(trajs, samples):
        t.prompt_ids, t.response_ids = torch.tensor(prompt), s.token_ids.clone()
    mb = collate(trajs, [0, 1], pad_id=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32, attn_implementation=sparse_attention.register())
    module = PolicyModule(model, temperature=1.0, topk=5, chunk_tokens=64)
    fwd = PolicyRunner(module, module, torch.device("cpu"))
    budgets = sparse_attention.query_budgets(mb.prompt_lens, 140, schedule)
    cfg = SparseAttentionConfig(dense_layers=(0, 1))
    with torch.no_grad():
        gaps = {}
        for pages in ("fp8_e4m3", "auto"):
            logq = fwd.stats(mb, sparse_attention.SparseForward.of(cfg, budgets, [140, 140], kv_cache_dtype=pages)).logprobs
            gaps[pages] = (logq - torch.cat([s.logprobs.float() for s in samples])).abs()
    assert gaps["fp8_e4m3"].max() < 1e-4
    assert gaps["auto"].max() > 1e-3
    x = torch.randn(3, 2, 5, 16, requires_grad=True)
    sparse_attention.as_stored(x).pow(2).sum().backward()
    assert torch.equal(x.grad, 2 * sparse_attention.as_stored(x).detach())

def test_group_refuses_a_batch_with_only_some_advantages(tiny_qwen3):
    from sparrow.trainer.group import TrainerGroup

    group = object.__new__(TrainerGroup)  # prepare() is pure: no Ray actors needed
    group.config = TrainerConfig(model=str(tiny_qwen3))
    none_set = TrajectoryBatch([_traj(3, 4, seed=s, reward=float(s), group_id="g") for s in range(2)])
    assert [t.advantage for t in group.prepare(none_set)] == pytest.approx([-0.7071, 0.7071], abs=1e-3)
    mixed = TrajectoryBatch([_traj(3, 4, advantage=0.5, group_id="g"), _traj(3, 4, seed=1, group_id="g")])
    with pytest.raises(ValueError, match="1 of 2 trajectories have an advantage"):
        group.prepare(mixed)


def test_sparse_forward_refuses_row_lengths_that_do_not_fit_the_batch():
    from types import SimpleNamespace

    from sparrow.kernels import SparseAttentionConfig
    from sparrow.trainer import sparse_attention

    q, kv = torch.zeros(2, 4, 32, 8), torch.zeros(2, 2, 32, 8)
    config = SparseAttentionConfig(dense_layers=())
    with pytest.raises(ValueError, match=r"lengths \[32, 40\] do not fit a batch of 2 rows of 32 positions"):
        sparse_attention.SparseForward.of(config, torch.full((2, 32), 5), [32, 40])
    sparse = sparse_attention.SparseForward.of(config, torch.full((2, 16), 5), [16, 10])
    with pytest.raises(ValueError, match=r"sparse budgets have shape \(2, 16\); expected \[batch, seq\] = \(2, 32\)"):
        sparse_attention.sparrow_attention(SimpleNamespace(layer_idx=3), q, kv, kv, None, sparrow_sparse=sparse)
