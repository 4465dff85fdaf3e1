"""deploy/kuberay/: the manifests against the core Kubernetes schemas (kubernetes-validate) and, where
given, KubeRay's own CRD schemas; and the wiring between them: each worker group declares the Ray
resource its pool's node_label names with as many GPUs as it requests, the job config validates and
reads its TLS files from the Secret's mount, the RayJob's --config is the ConfigMap's mount."""

import json
import os
from pathlib import Path

import jsonschema
import pytest
import yaml

from sparrow.coordinator.config import load_config

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (bash deploy/setup.sh --test installs it)")

ROOT = Path(__file__).resolve().parents[1]
KUBERAY = ROOT / "deploy" / "kuberay"
CRDS_ENV = "SPARROW_KUBERAY_CRDS"
NO_CRDS = (f"KubeRay's CRD schemas are not installed: no package registry these machines reach ships them "
           f"(PyPI codeflare-sdk 0.40.1 and the ray 2.60.0 wheel have none). Set {CRDS_ENV} to a directory "
           "holding ray.io_rayclusters.yaml and ray.io_rayjobs.yaml (ray-operator/config/crd/bases of a "
           "KubeRay release) to validate against them")


def manifests() -> dict[str, dict]:
    docs = [d for f in sorted(KUBERAY.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    return {d["kind"]: d for d in docs}


@pytest.fixture(scope="module")
def objs():
    found = manifests()
    assert set(found) == {"RayCluster", "RayJob", "ConfigMap"}
    return found


def groups(cluster: dict) -> dict[str, dict]:
    """head, rollout, trainer -> their group spec."""
    return {"head": cluster["spec"]["headGroupSpec"], **{g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}}


def container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]


def job_config(objs) -> dict:
    return yaml.safe_load(objs["ConfigMap"]["data"]["job.yaml"])


def test_configmap_and_every_pod_template_match_the_core_schemas(objs):
    version = kubernetes_validate.utils.latest_version()
    kubernetes_validate.validate(objs["ConfigMap"], version, strict=True)
    for name, group in groups(objs["RayCluster"]).items():
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": group["template"]}
        kubernetes_validate.validate(pod_template, version, strict=True)


def strict(schema):
    """A CRD's structural schema with unknown fields rejected (as `kubectl --validate=strict` does)."""
    if isinstance(schema, dict):
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
        for value in schema.values():
            strict(value)
    elif isinstance(schema, list):
        for value in schema:
            strict(value)
    return schema


@pytest.mark.parametrize("kind, crd_file", [("RayCluster", "ray.io_rayclusters.yaml"), ("RayJob", "ray.io_rayjobs.yaml")])
def test_ray_resources_match_the_kuberay_crd_schemas(objs, kind, crd_file):
    crds = os.environ.get(CRDS_ENV)
    if not crds:
        pytest.skip(NO_CRDS)
    crd = yaml.safe_load((Path(crds) / crd_file).read_text())
    assert crd["spec"]["names"]["kind"] == kind
    version = objs[kind]["apiVersion"].split("/")[1]
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]
    jsonschema.Draft7Validator(strict(schema)).validate(objs[kind])


def test_worker_groups_declare_their_pools_labels_and_gpus(objs):
    config = job_config(objs)
    g = groups(objs["RayCluster"])
    assert g["head"]["rayStartParams"]["num-gpus"] == "0"
    for pool in ("rollout", "trainer"):
        group, spec = g[pool], config[pool]["pool"]
        resources = json.loads(json.loads(group["rayStartParams"]["resources"]))  # a quoted JSON string, as KubeRay wants
        assert resources == {spec["node_label"]: 1}
        gpus = int(group["rayStartParams"]["num-gpus"])
        assert container(group)["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"]
        assert spec["size"] * spec["gpus"] == group["replicas"] * gpus, f"{pool}: the pool must fill its pods' GPUs"
        assert group["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}


def test_one_image_and_the_pinned_ray_version_everywhere(objs):
    cluster = objs["RayCluster"]
    images = {container(group)["image"] for group in groups(cluster).values()}
    assert len(images) == 1
    pins = dict(line.split("==") for line in (ROOT / "deploy" / "constraints-common.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert cluster["spec"]["rayVersion"] == pins["ray"]


def test_job_config_validates_and_joins_the_cluster(objs, tmp_path):
    config = job_config(objs)
    assert config["run"]["ray"]["address"] == "auto" and config["transport"]["host"] == "0.0.0.0"
    path = tmp_path / "job.yaml"
    path.write_text(objs["ConfigMap"]["data"]["job.yaml"])  # the whole YAML as the head pod reads it
    loaded = load_config(path)
    assert loaded.rollout.pool.node_label == "rollout_node" and loaded.trainer.pool.node_label == "trainer_node"
    security = loaded.transport.security
    assert (loaded.transport.tls_mode, security.client_auth, security.cert_file) == ("files", True, "/etc/sparrow/tls/tls.crt")


def test_clients_verify_the_name_that_the_deploy_guides_certificate_carries(objs):
    """Pods are dialled at IPs assigned at start; the tls=files certificate made by docs/deploy.md's
    openssl commands names server_name instead, and the job config verifies that same name."""
    server_name = job_config(objs)["transport"]["security"]["server_name"]
    doc = (ROOT / "docs" / "deploy.md").read_text()
    assert f"subjectAltName=DNS:{server_name}\\n" in doc


def test_tls_files_come_from_the_secret_mounted_in_every_pod(objs):
    security = job_config(objs)["transport"]["security"]
    assert security["tls"] == "files" and security["client_auth"] is True
    files = {security[k] for k in ("cert_file", "key_file", "ca_file", "token_file")}
    assert {str(Path(f).parent) for f in files} == {"/etc/sparrow/tls"}
    for name, group in groups(objs["RayCluster"]).items():
        spec = group["template"]["spec"]
        volume = {v["name"]: v for v in spec["volumes"]}
        mount = next(m for m in container(group)["volumeMounts"] if m["mountPath"] == "/etc/sparrow/tls")
        assert mount["readOnly"] is True, name
        assert volume[mount["name"]]["secret"]["secretName"] == "sparrow-tls", name
        assert spec["securityContext"]["runAsNonRoot"] is True, name


def test_rayjob_runs_the_configmap_job_on_the_cluster(objs):
    job, cluster = objs["RayJob"], objs["RayCluster"]
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    words = job["spec"]["entrypoint"].split()
    assert words[:2] == ["sparrow", "train"]
    config_path = Path(words[words.index("--config") + 1])
    head = groups(cluster)["head"]
    mount = next(m for m in container(head)["volumeMounts"] if m["mountPath"] == str(config_path.parent))
    volume = next(v for v in head["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == objs["ConfigMap"]["metadata"]["name"]
    assert config_path.name in objs["ConfigMap"]["data"]


def test_every_pod_is_scraped_on_its_metrics_ports(objs):
    """The ports each process binds (MetricsConfig.for_role: the coordinator metrics.port, workers and
    ranks from metrics.port + 1), one per GPU, are declared: pod discovery only sees declared ports."""
    from sparrow.coordinator.metrics import MetricsConfig

    metrics_config = MetricsConfig.model_validate(job_config(objs)["metrics"])
    for name, group in groups(objs["RayCluster"]).items():
        template = group["template"]
        assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true", name
        metrics = {p["containerPort"] for p in container(group)["ports"] if p["name"].startswith("metrics-")}
        role = {"head": "coordinator"}.get(name, name)
        first = metrics_config.for_role(role).port
        expected = 1 if name == "head" else int(group["rayStartParams"]["num-gpus"])
        assert metrics == set(range(first, first + expected)), name
