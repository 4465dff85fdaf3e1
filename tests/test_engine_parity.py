"""The native engine against transformers: greedy tokens and fp32 logprobs, dense and with a schedule
whose budget covers the context; RoPE variants and Qwen2 biases through teacher-forced logits."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from sparrow.model_zoo.tiny import tiny_config
from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine, load_model, teacher_forced_logprobs
from sparrow.schedule import SparsitySchedule

WIDE = SparsitySchedule(name="wide", topk_blocks=(61, 61), edges=(2000,))  # 64 blocks: more than any context here


def hf_greedy(model_dir, prompt: list[int], new_tokens: int):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                      output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):]
    logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
    return tokens, logprobs


def check_greedy_parity(model_dir, prompts, new_tokens):
    """Transformers once per prompt; the engine dense and under a schedule wider than the context."""
    engine = NativeEngine.from_pretrained(model_dir, num_kv_blocks=256, max_num_seqs=4)
    requests = [RolloutRequest(f"r{i}", tuple(p), SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
                for i, p in enumerate(prompts)]
    runs = {}
    for schedule in (None, WIDE):
        engine.set_schedule(schedule)
        runs[schedule] = engine.generate(requests)
    for i, prompt in enumerate(prompts):
        tokens, logprobs = hf_greedy(model_dir, prompt, new_tokens)
        chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
        hf_top = logprobs.topk(20)
        for schedule, samples in runs.items():
            sample = samples[i]
            assert torch.equal(sample.token_ids, tokens)
            assert (sample.logprobs - chosen).abs().max().item() < 1e-4
            assert torch.equal(sample.top_ids, hf_top.indices)
            assert (sample.top_logprobs - hf_top.values).abs().max().item() < 1e-4
            if schedule is not None:  # a budget above the block count means dense attention: every block
                n = len(prompt) + torch.arange(new_tokens)
                assert torch.equal(sample.blocks_attended.long(), (n + 15) // 16)


TINY_PROMPTS = [list(range(3, 40)), [5, 17, 99, 1000, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.mark.parametrize("family", ["tiny_qwen3", "tiny_llama"])
def test_tiny_greedy_matches_transformers(family, request):
    check_greedy_parity(request.getfixturevalue(family), TINY_PROMPTS, 40)


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}],
                                     add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    check_greedy_parity(smollm2, [prompt], 24)


def save_variant(tmp_path, family: str, **overrides):
    """A random HF checkpoint of a config variant, with weights large enough for peaked outputs."""
    config = tiny_config(family, 512, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(tmp_path)
    return tmp_path, model


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("qwen2", {}),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
        ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
        ("qwen3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 128}}),
        ("llama", {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True}),
    ],
    ids=["qwen2-qkv-bias", "llama3-rope", "linear-rope", "yarn-rope", "untied-biases"],
)
def test_config_variants_match_transformers_logits(tmp_path, family, overrides):
    model_dir, hf = save_variant(tmp_path, family, **overrides)
    tokens = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(1))
    ours = teacher_forced_logprobs(load_model(model_dir), tokens, 1, full=True).full_logprobs
    with torch.no_grad():
        ref = torch.log_softmax(hf(tokens[None]).logits[0, :-1].float(), dim=-1)
    assert (ours - ref).abs().max().item() < 1e-4
