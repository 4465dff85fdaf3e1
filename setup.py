"""Maps the design's top-level folders into the single `sparrow` import namespace.

`kernels` is also the name of Hugging Face's kernel-hub package (transformers probes for it), so
the folders are installed as `sparrow.kernels`, `sparrow.trainer`, ... instead of top-level names.
"""

from setuptools import find_packages, setup

FOLDERS = {
    "sparrow": "sparrow",
    "sparrow.kernels": "kernels",
    "sparrow.rollout_workers": "rollout_workers",
    "sparrow.trainer": "trainer",
    "sparrow.coordinator": "coordinator",
    "sparrow.protos": "protos",
    "sparrow.bench": "benchmarks",
}

packages, package_dir = [], {}
for name, folder in FOLDERS.items():
    package_dir[name] = folder
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
