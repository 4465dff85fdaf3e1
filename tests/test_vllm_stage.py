"""benchmarks/vllm_stage.py's filing of vLLM's requirements against the GPU machine: what is carried, what replaces
the image's own copy (a release pinning another torch), what is left out; and the closure check over carried wheels.
Requirement strings as vLLM 0.26.0's, vLLM 0.33.0's and torch 2.14.0's METADATA give them."""

import zipfile

import pytest
from packaging.requirements import Requirement

from sparrow.bench.vllm_stage import classify, closure_problems, machine_fits


def reqs(*lines: str) -> list[Requirement]:
    return [Requirement(line) for line in lines]


def test_a_release_pinning_the_machines_torch_carries_no_torch():
    carry, swap, there, left = classify(reqs("torch==2.11.0", "torchvision==0.26.0", "pydantic>=2.12.0"))
    assert [r.name for r in carry] == ["pydantic"]
    assert swap == []
    assert there == ["torch==2.11.0", "torchvision==0.26.0"]


def test_a_release_pinning_another_torch_swaps_it_and_its_kin():
    carry, swap, there, left = classify(reqs(
        "torch==2.14.0", "torchvision==0.29.0", "torchaudio==2.11.0", "transformers<5.21.0,>=5.16.1",
        "oss-harmony>=0.0.11", "orjson", "instanttensor>=0.2.2", "numba==0.65.0"))
    assert [str(r) for r in swap] == ["torch==2.14.0", "torchvision==0.29.0"]
    assert [r.name for r in carry] == ["oss-harmony"]
    assert there == ["torchaudio==2.11.0", "transformers<5.21.0,>=5.16.1", "numba==0.65.0"]
    assert "orjson" in left["the HTTP server"]
    assert any("instanttensor" in names for names in left.values())


def test_torchs_own_pins_are_checked_against_the_images_versions():
    assert not machine_fits(Requirement("nvidia-cudnn-cu13==9.24.0.43"))
    assert not machine_fits(Requirement("nvidia-nccl-cu13==2.30.7"))
    assert not machine_fits(Requirement("triton~=3.8.0"))
    assert machine_fits(Requirement("nvidia-nvshmem-cu13==3.4.5"))
    assert machine_fits(Requirement("cuda-bindings<14,>=13.0.3")), "no version on record: assumed"
    assert machine_fits(Requirement("cuda-toolkit[cublas,cudart]==13.0.3")), "a patch release of the same minor"
    assert not machine_fits(Requirement("cuda-toolkit==13.1.0"))
    assert not machine_fits(Requirement("oss-harmony")), "not on the machine at all"


def test_an_unfiled_requirement_stops_with_its_name():
    with pytest.raises(SystemExit, match="brand-new-kernels"):
        classify(reqs("brand-new-kernels==1.0"))


def wheel(folder, name: str, version: str, *requires: str):
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{meta}")
    return path


def test_closure_flags_a_carried_wheel_needing_a_torch_the_machine_lacks(tmp_path):
    vision = wheel(tmp_path, "torchvision", "0.29.0", "torch==2.14.0", "numpy")
    problems = closure_problems([vision])
    assert problems == ["torchvision needs torch==2.14.0: not carried, and the GPU machine has torch 2.11.0"]
    torch = wheel(tmp_path, "torch", "2.14.0", "nvidia-nvshmem-cu13==3.4.5", "cuda-toolkit==13.0.3", "filelock")
    assert closure_problems([vision, torch]) == []
    (tmp_path / "old").mkdir()
    stale = wheel(tmp_path / "old", "torch", "2.13.0")
    assert closure_problems([vision, stale]) == ["torchvision needs torch==2.14.0, carried torch 2.13.0"]
