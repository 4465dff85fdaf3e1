"""deploy/kuberay/: the manifests against the core Kubernetes schemas (kubernetes-validate) and the
vendored CRD schemas of KubeRay and the Prometheus Operator (tests/crds/); every pod against Pod Security
"restricted" (tests/pod_security.py); and the wiring between them: each worker group declares the Ray
resource its pool's node_label names with as many GPUs as it requests, the job config validates and
reads its TLS files from the Secret's mount, the RayJob's --config is the ConfigMap's mount, the
PodMonitor scrapes what the scrape job does."""

import copy
import gzip
import json
import os
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from pod_security import restricted_violations

from sparrow.coordinator.config import load_config

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (bash deploy/setup.sh --test installs it)")

ROOT = Path(__file__).resolve().parents[1]
KUBERAY = ROOT / "deploy" / "kuberay"
VENDORED_CRDS = Path(__file__).resolve().parent / "crds"
CRDS_ENV = "SPARROW_KUBERAY_CRDS"  # a directory of other releases' CRD files, used instead where present


def manifests() -> dict[str, dict]:
    docs = [d for f in sorted(KUBERAY.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    return {d["kind"]: d for d in docs}


@pytest.fixture(scope="module")
def objs():
    found = manifests()
    assert set(found) == {"RayCluster", "RayJob", "ConfigMap", "PodMonitor"}
    return found


def groups(cluster: dict) -> dict[str, dict]:
    """head, rollout, trainer -> their group spec."""
    return {"head": cluster["spec"]["headGroupSpec"], **{g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}}


def pod_templates(objs) -> dict[str, dict]:
    """Every pod the manifests make: the cluster's groups and the RayJob's submitter."""
    return {**{name: g["template"] for name, g in groups(objs["RayCluster"]).items()},
            "submitter": objs["RayJob"]["spec"]["submitterPodTemplate"]}


def container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]


def job_config(objs) -> dict:
    return yaml.safe_load(objs["ConfigMap"]["data"]["job.yaml"])


def test_configmap_and_every_pod_template_match_the_core_schemas(objs):
    version = kubernetes_validate.utils.latest_version()
    kubernetes_validate.validate(objs["ConfigMap"], version, strict=True)
    for name, template in pod_templates(objs).items():
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}
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


def load_crd(name: str) -> dict:
    """The CRD NAME.yaml from $SPARROW_KUBERAY_CRDS where it has one (plain or gzipped), else the vendored one."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: ten times faster on these 1 MB files
    for folder in ([Path(os.environ[CRDS_ENV])] if os.environ.get(CRDS_ENV) else []) + [VENDORED_CRDS]:
        if (folder / name).exists():
            return yaml.load((folder / name).read_bytes(), Loader=loader)
        if (folder / f"{name}.gz").exists():
            return yaml.load(gzip.decompress((folder / f"{name}.gz").read_bytes()), Loader=loader)
    raise FileNotFoundError(f"{name}: not in {VENDORED_CRDS} (see its README.md)")


@pytest.mark.parametrize("kind, crd_file", [("RayCluster", "ray.io_rayclusters.yaml"), ("RayJob", "ray.io_rayjobs.yaml"),
                                            ("PodMonitor", "monitoring.coreos.com_podmonitors.yaml")])
def test_custom_resources_match_their_crd_schemas(objs, kind, crd_file):
    crd = load_crd(crd_file)
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
    images = {c["image"] for template in pod_templates(objs).values() for c in template["spec"]["containers"]}
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


def kuberay_injected(template: dict) -> dict:
    """The pod spec as KubeRay runs it: its wait-gcs-ready init container (and wait-for-tls-ip-san under
    Ray TLS) copy the Ray container's image and securityContext (ray-operator/controllers/ray/common/pod.go
    of v1.7.0)."""
    spec = copy.deepcopy(template["spec"])
    ray = spec["containers"][0]
    spec.setdefault("initContainers", []).append(
        {"name": "wait-gcs-ready", "image": ray["image"], "securityContext": copy.deepcopy(ray.get("securityContext"))})
    return spec


def test_every_pod_meets_pod_security_restricted(objs):
    for name, template in pod_templates(objs).items():
        annotations = template.get("metadata", {}).get("annotations")
        assert restricted_violations(kuberay_injected(template), annotations) == [], name


def test_pods_run_as_the_user_the_image_creates(objs):
    """runAsNonRoot is only satisfiable if the image's user is not root: Dockerfile.gpu creates uid 1001
    and switches to it; every pod names that uid and gid."""
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile.gpu").read_text()
    uid = re.search(r"useradd .*--uid (\d+)", dockerfile)[1]
    assert re.findall(r"^USER (.+)$", dockerfile, re.M)[-1] == f"{uid}:{uid}"
    for name, template in pod_templates(objs).items():
        pod = template["spec"]["securityContext"]
        assert (pod["runAsUser"], pod["runAsGroup"], pod["runAsNonRoot"]) == (int(uid), int(uid), True), name


GOOD_POD = {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                             "capabilities": {"drop": ["ALL"]}}}],
            "volumes": [{"name": "v", "emptyDir": {}}]}


@pytest.mark.parametrize("path, value, violation", [
    ("hostNetwork", True, "spec.hostNetwork: must be unset or false"),
    ("volumes.0", {"name": "h", "hostPath": {"path": "/"}}, "spec.volumes[h]: type ['hostPath'] is not allowed"),
    ("volumes.0", {"name": "n", "nfs": {"server": "s", "path": "/"}}, "spec.volumes[n]: type ['nfs'] is not allowed"),
    ("securityContext.runAsNonRoot", False, "spec.containers[c].securityContext.runAsNonRoot: must be true"),
    ("containers.0.securityContext.runAsNonRoot", False, "spec.containers[c].securityContext.runAsNonRoot: must be true"),
    ("securityContext.runAsUser", 0, "spec.securityContext.runAsUser: must not be 0"),
    ("securityContext.seccompProfile", {"type": "Unconfined"}, "spec.securityContext.seccompProfile.type: 'Unconfined'"),
    ("securityContext.seccompProfile", None, "spec.containers[c].securityContext.seccompProfile.type: must be"),
    ("containers.0.securityContext.allowPrivilegeEscalation", None,
     "spec.containers[c].securityContext.allowPrivilegeEscalation: must be false"),
    ("containers.0.securityContext.capabilities", {"drop": ["NET_RAW"]}, "capabilities.drop: must include ALL"),
    ("containers.0.securityContext.capabilities", {"drop": ["ALL"], "add": ["SYS_ADMIN"]}, "['SYS_ADMIN'] not allowed"),
    ("containers.0.securityContext.privileged", True, "securityContext.privileged: must be unset or false"),
    ("containers.0.ports", [{"name": "p", "containerPort": 80, "hostPort": 80}], "ports[p].hostPort: must be unset or 0"),
    ("securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}], "kernel.msgmax is not a safe sysctl"),
    ("initContainers", [{"name": "i"}], "spec.initContainers[i].securityContext.allowPrivilegeEscalation: must be false"),
    ("securityContext.appArmorProfile", {"type": "Unconfined"}, "appArmorProfile.type: 'Unconfined' must be"),
    ("securityContext.seLinuxOptions", {"type": "spc_t"}, "seLinuxOptions.type: 'spc_t' is not allowed"),
    ("containers.0.securityContext.procMount", "Unmasked", "securityContext.procMount: must be unset or Default"),
    ("securityContext.windowsOptions", {"hostProcess": True}, "windowsOptions.hostProcess: must be unset or false"),
])
def test_the_restricted_checker_finds_each_violation(path, value, violation):
    spec = copy.deepcopy(GOOD_POD)
    assert restricted_violations(spec) == []
    *parents, last = path.split(".")
    node = spec
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    if value is None:
        del node[last]
    else:
        node[int(last) if last.isdigit() else last] = value
    found = restricted_violations(spec)
    assert any(violation in v for v in found), found


def test_the_restricted_checker_reads_apparmor_annotations():
    annotation = "container.apparmor.security.beta.kubernetes.io/c"
    assert restricted_violations(GOOD_POD, {annotation: "runtime/default"}) == []
    assert restricted_violations(GOOD_POD, {annotation: "unconfined"}) == [
        f"annotation {annotation}: 'unconfined' is not runtime/default or localhost/*"]


def relabel(labels: dict, configs: list[dict]) -> dict | None:
    """Prometheus' relabelling (replace, keep) of one target: its labels after, or None when dropped."""
    labels = dict(labels)
    for c in configs:
        value = c.get("separator", ";").join(labels.get(l, "") for l in c.get("source_labels", []))
        match = re.fullmatch(c.get("regex", "(.*)"), value)
        if c.get("action", "replace") == "keep":
            if not match:
                return None
        elif match:
            labels[c["target_label"]] = match.expand(re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", c.get("replacement", "$1")))
    return labels


def sanitized(name: str) -> str:
    """A Kubernetes label or annotation name as part of a Prometheus meta label name."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def pod_targets(cluster: dict) -> list[dict]:
    """What Kubernetes pod discovery offers Prometheus for one pod per group: a target per declared port."""
    targets = []
    for name, group in groups(cluster).items():
        meta = group["template"]["metadata"]
        pod_labels = {**meta["labels"], "ray.io/cluster": cluster["metadata"]["name"]}  # KubeRay adds it
        base = {"__meta_kubernetes_namespace": "ml", "__meta_kubernetes_pod_name": f"sparrow-{name}-0",
                **{f"__meta_kubernetes_pod_label_{sanitized(k)}": v for k, v in pod_labels.items()},
                **{f"__meta_kubernetes_pod_labelpresent_{sanitized(k)}": "true" for k in pod_labels},
                **{f"__meta_kubernetes_pod_annotation_{sanitized(k)}": v for k, v in meta["annotations"].items()}}
        for port in container(group)["ports"]:
            targets.append({**base, "__address__": f"{name}:{port['containerPort']}", "__metrics_path__": "/metrics",
                            "__meta_kubernetes_pod_container_port_name": port["name"]})
    return targets


def scraped(targets: list[dict], configs: list[dict]) -> set[tuple]:
    kept = (relabel(t, configs) for t in targets)
    keys = ("__address__", "__metrics_path__", "role", "run", "ray_cluster", "namespace", "pod")
    return {tuple(t.get(k) for k in keys) for t in kept if t is not None}


def test_podmonitor_scrapes_what_the_scrape_job_does(objs):
    """The Prometheus Operator turns the PodMonitor into a scrape job: its selector as keep rules, the
    endpoint's relabelings, then namespace and pod labels (pkg/prometheus/promcfg.go of v0.93.0)."""
    cluster = objs["RayCluster"]
    (job,) = yaml.safe_load((ROOT / "deploy" / "prometheus-kubernetes.yml").read_text())["scrape_configs"]
    monitor = objs["PodMonitor"]["spec"]
    (endpoint,) = monitor["podMetricsEndpoints"]
    snake = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    operator_job = (
        [{"action": "keep", "regex": f"({v});true",
          "source_labels": [f"__meta_kubernetes_pod_label_{sanitized(k)}", f"__meta_kubernetes_pod_labelpresent_{sanitized(k)}"]}
         for k, v in monitor["selector"]["matchLabels"].items()]
        + [{snake.get(k, k): v for k, v in r.items()} for r in endpoint["relabelings"]]
        + [{"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
           {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}])
    targets = pod_targets(cluster)
    by_job = scraped(targets, job["relabel_configs"])
    assert by_job == scraped(targets, operator_job) and endpoint["path"] == "/metrics"
    assert {(address, role) for address, _, role, *_ in by_job} == {
        ("head:9400", "coordinator"), *((f"{pool}:{port}", pool) for pool in ("rollout", "trainer") for port in range(9401, 9409))}
    assert {(run, cluster_label) for _, _, _, run, cluster_label, *_ in by_job} == {("sparrow", "sparrow")}
