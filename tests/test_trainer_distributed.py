"""Two DeepSpeed ranks as real Ray actors (gloo, fp32) against a single-process plain-torch reference:
loss, gradients, the optimizer step and α under ZeRO-2 and ZeRO-3; checkpoints (also resumed on
another number of ranks) and HF export; weight publishing into the native rollout engine, including
refused updates."""

import os

import pytest
import torch

ray = pytest.importorskip("ray")

from sparrow.acceptance import AlphaHistogram, acceptance_bounds_topk  # noqa: E402
from sparrow.schedule import load_schedule  # noqa: E402
from sparrow.trainer import LossConfig, Trajectory, TrajectoryBatch, policy_loss  # noqa: E402
from sparrow.weight_sync import HandleSource, WeightReceiver, WeightsRefused, receive_state_dict  # noqa: E402

pytestmark = pytest.mark.slow
SCHEDULE = "qwen3-1.7b-0.86"
LR = 1e-3


@pytest.fixture(scope="module")
def ray_session():
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _config(model, stage, **kw):
    return {
        "model": str(model), "zero_stage": stage, "micro_batch_tokens": 64, "schedule": SCHEDULE,
        "optimizer": {"lr": LR, "weight_decay": 0.01, "grad_clip": 1.0}, "recompute_topk": 8, **kw,
    }


def _group(model, stage, num_ranks=2, **kw):
    from sparrow.trainer.group import TrainerGroup

    return TrainerGroup(_config(model, stage, **kw), num_ranks, actor_options={"num_cpus": 0})


def _weights(group, version=1) -> dict[str, torch.Tensor]:
    """The group's current full weights, fetched through the object-store publishing path."""
    report = group.publish_weights(version, channel="object_store")
    state, got = receive_state_dict(HandleSource(report.handle))
    assert got == version
    return state


def _batch(seed=0) -> TrajectoryBatch:
    """Uneven lengths so the two ranks get different micro-batch counts (one runs dummy passes)."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i, (p, r) in enumerate([(5, 40), (7, 9), (12, 30), (3, 5), (9, 22), (30, 17), (4, 6)]):
        trajs.append(Trajectory(
            prompt_ids=torch.randint(3, 2000, (p,), generator=g),
            response_ids=torch.randint(3, 2000, (r,), generator=g),
            rollout_logprobs=-torch.rand(r, generator=g) * 9,
            reward=float(torch.rand((), generator=g)),
            group_id=str(i % 3),
            loss_mask=torch.rand(r, generator=g) > 0.15,
            schedule_version=i % 2,
        ))
    return TrajectoryBatch(trajs).with_grpo_advantages()


def _with_rollout_topk(batch: TrajectoryBatch, recompute) -> TrajectoryBatch:
    """Rollout top-k near the dense one: same ids with a perturbed order/values, some replaced."""
    g = torch.Generator().manual_seed(1)
    out = []
    for t, ids, lp in zip(batch, recompute.top_ids, recompute.top_logprobs):
        noisy = lp + torch.randn(lp.shape, generator=g) * 0.3
        order = noisy.argsort(-1, descending=True)
        ids = ids.gather(-1, order).clone()
        ids[:, -2:] = torch.randint(3, 2000, (ids.shape[0], 2), generator=g)
        t = Trajectory(**{**t.__dict__, "top_ids": ids, "top_logprobs": noisy.gather(-1, order).clamp(max=0)})
        out.append(t)
    return TrajectoryBatch(out)


def _load(model_dir, state):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    return model


def _token_logprobs(model, t: Trajectory) -> torch.Tensor:
    ids = torch.cat([t.prompt_ids, t.response_ids])[None]
    return torch.log_softmax(model(ids).logits[0, t.prompt_len - 1 : -1].float(), -1)


class Reference:
    """Plain torch, one process: the same mini-batches (each rank's shard split the same way), loss,
    gradients, AdamW steps with the same clip, and α against π_old."""

    def __init__(self, model_dir, state, ref_state=None):
        self.model = _load(model_dir, state).train()
        self.ref = _load(model_dir, ref_state).eval() if ref_state is not None else None
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.01)

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: p.detach().clone() for k, p in self.model.named_parameters()}

    def train_step(self, batch: TrajectoryBatch, loss_cfg: LossConfig, schedule=None, topk=8):
        from sparrow.trainer.update import mini_batch_indices

        model, params = self.model, dict(self.model.named_parameters())
        with torch.no_grad():
            old = {id(t): _token_logprobs(model, t) for t in batch}
        alpha = {}
        for t in batch:
            if t.top_ids is None or schedule is None:
                continue
            top_lp, top_ids = old[id(t)].topk(topk, -1)
            lo, _ = acceptance_bounds_topk(top_ids, top_lp, t.top_ids, t.top_logprobs)
            bins = torch.tensor([schedule.bin_of(t.prompt_len + j) for j in range(t.response_len)])
            mask = t.response_mask()
            alpha.setdefault(t.schedule_version, AlphaHistogram.empty(schedule.num_bins)).add(lo[mask], bins[mask])
        shards = [shard for _, shard in batch.shard(2)]
        parts = [mini_batch_indices(len(shard), loss_cfg.mini_batches) for shard in shards]
        pg, tokens = 0.0, 0
        for _ in range(loss_cfg.epochs):
            for k in range(loss_cfg.mini_batches):
                members = [shard[i] for shard, p in zip(shards, parts) for i in p[k]]
                n = sum(int(t.response_mask().sum()) for t in members)
                self.opt.zero_grad()
                for t in members:
                    pick = lambda lp: lp.gather(-1, t.response_ids[:, None])[:, 0]  # noqa: B023, E731
                    logp = pick(_token_logprobs(model, t))
                    old_lp = logp.detach() if loss_cfg.on_policy else pick(old[id(t)])
                    ref_lp = None
                    if self.ref is not None:
                        with torch.no_grad():
                            ref_lp = pick(_token_logprobs(self.ref, t))
                    adv = torch.full_like(logp, t.advantage)
                    out = policy_loss(logp, old_lp, t.rollout_logprobs, adv, t.response_mask(), loss_cfg, n, ref_lp)
                    out.loss.backward()
                    pg += float(out.sums["pg_loss"])
                tokens += n
                grads = {k: p.grad.clone() for k, p in params.items()}
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                self.opt.step()
        return pg / tokens, grads, alpha


CASES = {
    "zero2-on-policy": (2, {}, False),
    "zero3-ref-kl-band": (3, {"kl_coef": 0.5, "mask_band": [0.2, 5.0]}, True),
    "zero1-off-policy": (1, {"mini_batches": 2, "epochs": 2}, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_single_process_reference(ray_session, tiny_qwen3, case):
    """`warm`: one step first, so the reference-KL term is away from zero on the step compared."""
    stage, loss, warm = CASES[case]
    loss_cfg = LossConfig(**loss)
    group = _group(tiny_qwen3, stage, loss=loss)
    try:
        initial = _weights(group, version=1)
        if warm:
            group.train_step(_batch(7))
        batch = _with_rollout_topk(_batch(), group.recompute(_batch()))
        result = group.train_step(batch, return_gradients=True)
        after = _weights(group, version=2)
    finally:
        group.shutdown()
    reference = Reference(tiny_qwen3, initial, ref_state=initial if loss_cfg.kl_coef else None)
    if warm:
        reference.train_step(_batch(7), loss_cfg)
    loss, grads, alpha = reference.train_step(batch, loss_cfg, load_schedule(SCHEDULE))
    stepped = reference.weights()
    steps = loss_cfg.mini_batches * loss_cfg.epochs
    m = result.metrics
    assert m["train/loss_tokens"] == batch.num_response_tokens * loss_cfg.epochs
    assert m["train/pg_loss"] == pytest.approx(loss, rel=1e-4, abs=1e-7)
    assert set(result.gradients) <= set(grads) and "model.embed_tokens.weight" in result.gradients
    for name, g in result.gradients.items():
        assert torch.allclose(g, grads[name], rtol=1e-3 if steps > 1 else 1e-4, atol=1e-7), (name, (g - grads[name]).abs().max())
    for name, w in after.items():  # Adam's first step is ≈ lr·sign(g): tiny gradients amplify float noise
        assert torch.allclose(w, stepped[name], rtol=0, atol=0.02 * LR * steps), (name, (w - stepped[name]).abs().max())
    assert 0 < m["train/tis_capped_fraction"] < 1
    if loss_cfg.on_policy:
        assert m["train/clip_fraction"] == 0.0 and m["train/ppo_kl"] == 0.0  # ratio ≡ 1
    else:
        assert m["train/clip_fraction"] > 0 and m["train/ppo_kl"] != 0.0
    if loss_cfg.kl_coef:
        assert m["train/ref_kl"] > 0 and 0 < m["train/band_masked_fraction"] < 1
    assert set(result.alpha.lower) == set(alpha)
    for v, hist in alpha.items():
        assert torch.equal(result.alpha.lower[v].counts, hist.counts)
        assert torch.allclose(result.alpha.lower[v].sums, hist.sums, rtol=1e-6)
    assert result.alpha.tokens() == batch.num_response_tokens


RESIZE_CASES = {  # DistillSparse needs ZeRO ≤ 2; with it the adapter and its own optimizer must come back too
    "zero2-distill": (2, {"distill_sparse": {"enabled": True, "kl_coef": 1.0, "rank": 4, "alpha": 8}, "micro_batch_tokens": 256}),
    "zero3": (3, {}),
}


@pytest.mark.parametrize("case", list(RESIZE_CASES))
def test_resume_on_another_number_of_ranks(ray_session, tiny_qwen3, tmp_path, case):
    """2 ranks → 1 → 2, each hop through DeepSpeed's universal checkpoint: the weights arrive exact, and
    the next step (Adam moments, LR schedule, step count) matches the one the saving pool took."""
    import shutil

    from sparrow.schedule import SparsitySchedule

    stage, kw = RESIZE_CASES[case]
    distill = "distill_sparse" in kw
    batch = _long_batch if distill else _batch
    kw = {**kw, "optimizer": {"lr": LR, "weight_decay": 0.01, "grad_clip": 1.0, "warmup_steps": 8}}  # LR moves each step
    two, one = _group(tiny_qwen3, stage, **kw), _group(tiny_qwen3, stage, num_ranks=1, **kw)
    try:
        if distill:  # sparse for most tokens, so the adapter trains
            for group in (two, one):
                group.set_schedule(SparsitySchedule(name="top1", topk_blocks=(1,) * 20).to_dict())
        two.train_step(batch(0))
        tag = two.save_checkpoint(str(tmp_path / "two"))
        saved = _weights(two, 1)
        on_two = two.train_step(batch(1)).metrics
        w_two = _weights(two, 2)

        assert one.load_checkpoint(str(tmp_path / "two")) == {"tag": tag, "step_count": 1}
        loaded = _weights(one, 1)
        on_one = one.train_step(batch(1)).metrics
        w_one = _weights(one, 2)
        tag2 = one.save_checkpoint(str(tmp_path / "one"))
        next_on_one = one.train_step(batch(2)).metrics
        w_next_one = _weights(one, 3)

        assert two.load_checkpoint(str(tmp_path / "one")) == {"tag": tag2, "step_count": 2}
        reloaded = _weights(two, 3)
        next_on_two = two.train_step(batch(2)).metrics
        w_next_two = _weights(two, 4)

        bad = tmp_path / "bad"
        shutil.copytree(tmp_path / "two" / tag, bad / tag, ignore=shutil.ignore_patterns("universal*"))
        next(iter((bad / tag).glob("*rank_1_*optim_states.pt"))).unlink()
        with pytest.raises(ray.exceptions.RayTaskError) as exc:
            one.load_checkpoint(str(bad), tag)
    finally:
        two.shutdown()
        one.shutdown()
    assert (tmp_path / "two" / tag / "universal" / "zero").is_dir() and not (tmp_path / "two" / "latest_universal").exists()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)  # with DistillSparse: W + (α/r)·B·A
    assert all(torch.equal(w_one[k], reloaded[k]) for k in w_one)
    keys = ["train/lr", "train/pg_loss"] + (["distill/lr", "distill/kl"] if distill else [])
    for (a, w_a), (b, w_b) in (((on_two, w_two), (on_one, w_one)), ((next_on_one, w_next_one), (next_on_two, w_next_two))):
        assert [a[k] for k in keys] == pytest.approx([b[k] for k in keys], rel=1e-5, abs=1e-8)
        for k in w_a:
            assert torch.allclose(w_a[k], w_b[k], rtol=0, atol=1e-6), (k, (w_a[k] - w_b[k]).abs().max())
    assert on_two["train/lr"] < next_on_two["train/lr"] and (not distill or next_on_two["distill/kl"] > 0)
    message = str(exc.value.cause)
    assert f"checkpoint {bad / tag} was saved by 2 trainer ranks" in message and "on 1" in message
    assert "1 optimizer partition files" in message and "trainer.pool.size=2" in message


@ray.remote(num_cpus=0)
class RolloutWorker:
    """A native engine behind a WeightReceiver, as a rollout actor would hold it."""

    def __init__(self, model_dir):
        from sparrow.rollout_workers.native import NativeEngine

        self.engine = NativeEngine.from_pretrained(model_dir, num_kv_blocks=64)
        self.receiver = WeightReceiver(self.engine)

    def join(self, host, port, world_size, rank):
        from sparrow.weight_sync import CollectiveGroup

        self.group = CollectiveGroup(host, port, rank, world_size)

    def receive_collective(self):
        from sparrow.weight_sync import CollectiveSource

        return self.receiver.receive(CollectiveSource(self.group)).version

    def receive_handle(self, handle):
        return self.receiver.receive(HandleSource(handle)).version

    def weights(self):
        return {k: v.clone() for k, v in self.engine.runner.model.named_parameters()}, self.engine.policy_version

    def greedy(self, prompt):
        from sparrow.rollout_workers.api import RolloutRequest, SamplingParams

        req = RolloutRequest("r", tuple(prompt), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        return self.engine.generate([req])[0].token_ids.tolist()


def test_checkpoint_resume_hf_export_and_publish_into_native_engine_refusing_bad_updates(ray_session, tiny_qwen3,
                                                                                          tmp_path):
    """One ZeRO-2 pool of 2 ranks (it was one per part): a checkpoint resumed exactly and exported to HF, then its
    weights published into two native engines over a collective group and bad updates refused."""
    from transformers import AutoModelForCausalLM

    from sparrow.weight_sync.send import publish_state_dict
    from sparrow.weight_sync import ObjectStoreSender

    group = _group(tiny_qwen3, 2, publish={"bucket_mb": 0.05})
    workers = [RolloutWorker.remote(str(tiny_qwen3)) for _ in range(2)]
    try:
        group.train_step(_batch(0))
        tag = group.save_checkpoint(str(tmp_path / "ckpt"))
        second = group.train_step(_batch(1)).metrics
        w_second = _weights(group, 1)
        assert group.load_checkpoint(str(tmp_path / "ckpt")) == {"tag": tag, "step_count": 1}
        again = group.train_step(_batch(1)).metrics
        w_again = _weights(group, 2)
        exported = group.export_hf(str(tmp_path / "hf"))

        host, port = ray.get(group.actors[0].address.remote())
        joins = [w.join.remote(host, port, 3, r + 1) for r, w in enumerate(workers)]
        ray.get(group.submit("init_weight_group", host, port, 3) + joins)
        reports = group.submit("publish_weights", 1, "collective")
        versions = ray.get([w.receive_collective.remote() for w in workers])
        report = ray.get(reports)[0]
        trained = _weights(group, 2)
        served, version = ray.get(workers[0].weights.remote())
        greedy_v1 = ray.get(workers[1].greedy.remote([5, 6, 7]))

        bad = {k: v.clone() for k, v in trained.items()}
        bad["model.norm.weight"][0] = float("nan")
        missing = {k: v for k, v in trained.items() if k != "model.layers.1.mlp.up_proj.weight"}
        shape = {**trained, "model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)}
        errors = []
        for v, sd in ((3, bad), (4, missing), (5, shape)):
            handle = publish_state_dict(sd, v, ObjectStoreSender(), 2**20).handle
            with pytest.raises(ray.exceptions.RayTaskError) as exc:
                ray.get(workers[1].receive_handle.remote(handle))
            assert isinstance(exc.value.cause, WeightsRefused)
            errors.append(str(exc.value.cause))
        stale = publish_state_dict(trained, 1, ObjectStoreSender(), 2**20).handle
        with pytest.raises(ray.exceptions.RayTaskError, match="not newer"):
            ray.get(workers[1].receive_handle.remote(stale))
        after, version_after = ray.get(workers[1].weights.remote())
        greedy_after = ray.get(workers[1].greedy.remote([5, 6, 7]))
    finally:
        group.shutdown()
        for w in workers:
            ray.kill(w)
    assert again["train/pg_loss"] == second["train/pg_loss"] and again["train/lr"] == second["train/lr"]
    assert all(torch.equal(w_second[k], w_again[k]) for k in w_second)
    model = AutoModelForCausalLM.from_pretrained(exported["policy"], dtype=torch.float32)
    state = model.state_dict()
    assert all(torch.equal(state[k], w_again[k]) for k in w_again)
    assert "tokenizer.json" in exported["files"]

    assert versions == [1, 1] and version == 1 and report.version == 1 and report.num_buckets > 5
    assert report.seconds > 0 and report.metrics()["publish/bytes"] == sum(t.numel() * 4 for t in trained.values())
    assert all(torch.equal(trained[k], w_again[k]) for k in w_again), "the pool's weights did not move after the export"
    for name, w in served.items():
        assert torch.equal(w, trained.get(name, trained["model.embed_tokens.weight"] if name == "lm_head.weight" else None))
    assert "model.norm.weight: contains NaN" in errors[0] and "still serving version 1" in errors[0]
    assert "missing keys: model.layers.1.mlp.up_proj.weight" in errors[1]
    assert "model.layers.0.self_attn.q_proj.weight: shape (3, 3)" in errors[2]
    assert version_after == 1 and all(torch.equal(after[k], served[k]) for k in served)
    assert greedy_after == greedy_v1


def _long_batch(seed) -> TrajectoryBatch:
    """Sequences past 4 blocks, so a top-1 schedule is sparse for most response tokens."""
    g = torch.Generator().manual_seed(seed)
    trajs = [
        Trajectory(torch.randint(3, 2000, (p,), generator=g), torch.randint(3, 2000, (r,), generator=g),
                   -torch.rand(r, generator=g) * 9, reward=float(i % 2), group_id=str(i // 2))
        for i, (p, r) in enumerate([(20, 100), (40, 60), (10, 90), (30, 70)])
    ]
    return TrajectoryBatch(trajs).with_grpo_advantages()


def test_distill_sparse_on_two_ranks(ray_session, tiny_qwen3, tmp_path):
    """The dense update ignores a trained adapter (gradients = adapter-free reference); workers get
    W + (α/r)·B·A (= peft's merge of the exported adapter) while the exported policy stays W."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from sparrow.schedule import SparsitySchedule

    distill = {"enabled": True, "kl_coef": 1.0, "rank": 4, "alpha": 8}
    group = _group(tiny_qwen3, 2, distill_sparse=distill, micro_batch_tokens=256)
    try:
        group.set_schedule(SparsitySchedule(name="top1", topk_blocks=(1,) * 20).to_dict())
        first = group.train_step(_long_batch(0)).metrics
        clean = group.export_hf(str(tmp_path / "w1"))
        batch = _long_batch(1)
        second = group.train_step(batch, return_gradients=True)
        merged = _weights(group, 1)
        exported = group.export_hf(str(tmp_path / "w2"))
    finally:
        group.shutdown()
    assert first["distill/kl"] > 0 and first["distill/grad_norm"] > 0 and second.metrics["distill/lr"] == 5 * LR
    w1 = AutoModelForCausalLM.from_pretrained(clean["policy"], dtype=torch.float32).state_dict()
    _, grads, _ = Reference(tiny_qwen3, w1).train_step(batch, LossConfig())
    for name, g in second.gradients.items():
        assert torch.allclose(g, grads[name], rtol=1e-4, atol=1e-7), name
    base = AutoModelForCausalLM.from_pretrained(exported["policy"], dtype=torch.float32)
    w2 = {k: v.clone() for k, v in base.state_dict().items()}
    reference_merge = PeftModel.from_pretrained(base, exported["sparse_lora"]).merge_and_unload().state_dict()
    lora_targets = [k for k in merged if k.endswith("proj.weight")]
    assert lora_targets and all(not torch.allclose(merged[k], w2[k]) for k in lora_targets)
    assert all(torch.equal(merged[k], w2[k]) for k in merged if k not in lora_targets)
    assert all(torch.allclose(merged[k], reference_merge[k], atol=1e-6) for k in merged)



def test_exact_alpha_replays_each_trajectory_under_its_rollout_schedule(ray_session, tiny_qwen3):
    """trainer.exact_alpha: every step, before the update, exact α of each trajectory under the schedule version it
    was decoded with. A version whose budgets cover every context measures 1; a sparse one measures what
    `measure_sparse_alpha` does with that schedule in force; a version the trainer no longer knows is counted."""
    import dataclasses

    from sparrow.schedule import SparsitySchedule

    sparse = SparsitySchedule(name="top1", topk_blocks=(1,) * 20, version=1)
    covering = SparsitySchedule(name="top1000", topk_blocks=(1000,) * 20, version=2)
    batch = list(_long_batch(0))
    versions = [1, 1, 2, 7]
    group = _group(tiny_qwen3, 2, exact_alpha=True, micro_batch_tokens=256)
    try:
        group.set_schedule(sparse.to_dict())
        direct = group.measure_sparse_alpha(TrajectoryBatch(batch[:2]))
        group.set_schedule(covering.to_dict())
        result = group.train_step(TrajectoryBatch([dataclasses.replace(t, schedule_version=v) for t, v in zip(batch, versions)]))
    finally:
        group.shutdown()
    exact = result.alpha_exact
    assert sorted(exact.lower) == [1, 2]
    assert exact.unmeasured == batch[3].response_len == result.metrics["train/alpha_exact_unmeasured_tokens"]
    assert int(exact.lower[2].count().sum()) == batch[2].response_len
    assert float(exact.lower[2].sums.sum()) == pytest.approx(batch[2].response_len, abs=1e-4)
    measured, expected = exact.lower[1], direct.lower[sparse.version]
    assert torch.equal(measured.counts, expected.counts) and int(measured.count().sum()) == 160
    assert torch.allclose(measured.sums, expected.sums, rtol=0, atol=1e-9)
    assert float(measured.sums.sum()) < 160 - 1.0, "top-1 budgets on 60-100-token responses change α"
