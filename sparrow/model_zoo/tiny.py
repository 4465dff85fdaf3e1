"""Tiny random-weight Hugging Face checkpoints (Qwen3 / Llama / Qwen2) with a real tokenizer.

The tokenizer is a byte-level BPE trained here on the Python standard library's sources, so it is
built offline and identical on every machine with the same Python; it carries a ChatML template.
head_dim defaults to 32, the smallest vLLM's CPU attention backend accepts.
"""

import sysconfig
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _training_corpus(max_files: int = 200) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))[:max_files]
    return [p.read_text(errors="ignore") for p in files]


def build_tokenizer(out_dir: str | Path, vocab_size: int = 2048):
    """Train and save a byte-level BPE tokenizer with a chat template; returns the HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(str(out_dir))
    return hf_tok


def tiny_config(family: str, vocab_size: int, **overrides):
    """A small config of the given decoder family; `overrides` replace any field."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    base = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "qwen3":
        return Qwen3Config(**{**base, "head_dim": 32, "rope_theta": 1_000_000.0, **overrides})
    if family == "llama":
        return LlamaConfig(**{**base, "head_dim": 32, "rope_theta": 10_000.0, **overrides})
    if family == "qwen2":
        cfg = {**base, "hidden_size": 128, "rope_theta": 1_000_000.0, **overrides}
        return Qwen2Config(**cfg)
    raise ValueError(f"family={family!r}: choose qwen3, llama or qwen2")


def build_tiny_checkpoint(out_dir: str | Path, family: str = "qwen3", seed: int = 0, vocab_size: int = 2048,
                          dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """Save a random-weight `family` model plus tokenizer as a normal HF directory (safetensors), its weights in
    `dtype` (bfloat16 halves a benchmark shape's file)."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir, vocab_size)
    config = tiny_config(family, len(tokenizer), **overrides)
    config.bos_token_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default weights so random models have peaked, varied outputs
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08 if "embed" in name else 0.12)
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    return out_dir
