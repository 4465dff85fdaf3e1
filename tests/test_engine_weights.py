"""In-place weight updates (atomic, validated, HF names) and clear failures for bad model directories."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import ModelLoadError, NativeEngine, WeightsError

REQUESTS = [RolloutRequest("a", tuple(range(5, 40)), SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)),
            RolloutRequest("b", tuple(range(9, 30)), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))]


def outputs(engine):
    return [(s.token_ids.tolist(), s.logprobs) for s in engine.generate(REQUESTS)]


def assert_same(a, b):
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb and (la - lb).abs().max().item() < 1e-5


@pytest.fixture
def perturbed_dir(tiny_qwen3, tmp_path):
    """A copy of tiny_qwen3 with different weights: the 'next policy version'."""
    out = tmp_path / "v2"
    shutil.copytree(tiny_qwen3, out)
    tensors = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in tensors.items()}, out / "model.safetensors")
    return out


def test_in_place_update_equals_a_fresh_load(tiny_qwen3, perturbed_dir):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=64)
    before = outputs(engine)
    engine.load_weights(load_file(perturbed_dir / "model.safetensors"), version=7)
    fresh = NativeEngine.from_pretrained(perturbed_dir, num_kv_blocks=64)
    after = outputs(engine)
    assert_same(after, outputs(fresh))
    assert before[0][0] != after[0][0]
    assert engine.policy_version == 7 and engine.generate(REQUESTS)[0].policy_version == 7
    engine.load_weights(tiny_qwen3, version=8)  # from an HF directory
    assert_same(outputs(engine), before)


def test_trainer_state_dict_with_tied_lm_head_is_accepted(tiny_qwen3):
    from transformers import AutoModelForCausalLM

    hf_state = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).state_dict()
    assert "lm_head.weight" in hf_state
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=64)
    before = outputs(engine)
    engine.load_weights({k: v.to(torch.bfloat16).float() for k, v in hf_state.items()}, version=1)
    engine.load_weights(hf_state, version=2)
    assert_same(outputs(engine), before)


def bad_state_dicts(state):
    key = "model.layers.1.self_attn.q_proj.weight"
    yield "missing keys: " + key, {k: v for k, v in state.items() if k != key}
    yield "unexpected keys: model.layers.9.mlp.up_proj.weight", {**state, "model.layers.9.mlp.up_proj.weight": state[key]}
    yield key + ": shape (4, 4)", {**state, key: torch.zeros(4, 4)}
    yield key + ": dtype torch.int64", {**state, key: state[key].long()}
    nan = state[key].clone()
    nan[0, 0] = float("nan")
    yield key + ": contains NaN", {**state, key: nan}
    yield "lm_head.weight: differs", {**state, "lm_head.weight": state["model.embed_tokens.weight"] + 1}


def test_bad_updates_raise_naming_the_key_and_keep_the_old_weights(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=64)
    engine.load_weights(tiny_qwen3, version=3)
    before = outputs(engine)
    state = load_file(tiny_qwen3 / "model.safetensors")
    for message, bad in bad_state_dicts(state):
        # Half of the update is valid and differs: nothing of it may land.
        bad = {k: (v + 1 if k.endswith("mlp.down_proj.weight") else v) for k, v in bad.items()}
        with pytest.raises(WeightsError, match=message.replace("(", r"\(").replace(")", r"\)")):
            engine.load_weights(bad, version=4)
        assert engine.policy_version == 3
    assert_same(outputs(engine), before)


def test_load_weights_refuses_while_sequences_are_in_flight(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=64)
    engine.add_request(REQUESTS[0])
    with pytest.raises(RuntimeError, match="in flight"):
        engine.load_weights(tiny_qwen3, version=1)


def edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda d: edit_config(d, architectures=["GPT2LMHeadModel"]), "architectures=.*GPT2LMHeadModel.*not supported"),
        (lambda d: edit_config(d, hidden_size=None), "field 'hidden_size'"),
        (lambda d: edit_config(d, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}),
         "rope_type='dynamic' is not supported"),
        (lambda d: edit_config(d, rope_parameters={"rope_type": "llama3", "rope_theta": 1e6}), "needs rope field 'factor'"),
        (lambda d: (d / "config.json").unlink(), "missing config.json"),
        (lambda d: (d / "config.json").write_text("{not json"), "config.json: not valid JSON"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage"),
         "model.safetensors: corrupt or unreadable safetensors"),
        (lambda d: (d / "model.safetensors").unlink(), "no \\*.safetensors file"),
        (lambda d: (d / "model.safetensors.index.json").write_text('{"metadata": {}}'),
         "not a valid safetensors index"),
        (lambda d: save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, d / "model.safetensors"), "missing keys"),
    ],
    ids=["architecture", "missing-field", "rope-type", "rope-field", "no-config", "bad-json", "corrupt-safetensors",
         "no-safetensors", "bad-index", "wrong-tensors"],
)
def test_bad_model_directories_fail_clearly(tiny_qwen3, tmp_path, damage, message):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_qwen3, model_dir)
    damage(model_dir)
    with pytest.raises(ValueError, match=message):
        NativeEngine.from_pretrained(model_dir, num_kv_blocks=16)
    assert issubclass(ModelLoadError, ValueError) and issubclass(WeightsError, ValueError)


def test_old_style_rope_scaling_is_read(tiny_qwen3, tmp_path):
    from sparrow.rollout_workers.native.model_spec import load_spec

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_qwen3, model_dir)
    edit_config(model_dir, rope_parameters=None, rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert load_spec(model_dir).rope == {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}


def test_a_bfloat16_model_allocates_no_float32_weights():
    """The weights are cast before they are allocated: a float32 copy would double the model's memory at load (32.8
    GB for the Qwen3-8B shape, which does not fit beside a full KV cache). Only the float32 RoPE tables are built."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sparrow.rollout_workers.native.model import DecoderModel
    from sparrow.rollout_workers.native.shapes import spec_for_shape

    class LargestFloat32(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type != "meta":
                    self.largest = max(self.largest, t.numel())
            return out

    spec = spec_for_shape("qwen3-1.7b")
    with LargestFloat32() as seen:
        model = DecoderModel(spec, 64, device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert seen.largest <= 64 * spec.head_dim, f"a float32 tensor of {seen.largest} elements was allocated"
