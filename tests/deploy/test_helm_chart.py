"""The Helm chart, checked without a cluster: Helm's own engine (helm-python-sdk) lints and
renders it; the RayService validates against KubeRay's CRD schema, every core object against
Kubernetes' own schemas (kubernetes-validate), the embedded serveConfigV2 against Ray's
ServeDeploySchema and the app's own argument checks; values outside values.schema.json and values
no cluster could run are refused with the reason."""

from __future__ import annotations

import json
import os
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from svip_serve.settings import ServeSettings

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "svip"
EXAMPLE = REPO / "deploy" / "helm" / "examples" / "qwen2.5-7b-with-0.5b-draft.yaml"
SCHEMA_IN_SHARED = Path("shared") / "kuberay" / "rayservice-v1.schema.json"  # ../shared beside the checkout
KUBE_VERSION = "1.30"

VARIANTS = {
    "defaults": {},
    "example": yaml.safe_load(EXAMPLE.read_text()),
    "ingress-tls-token": {"ingress": {"enabled": True, "className": "nginx", "tls": [{"secretName": "t", "hosts": ["a.b"]}]},
                          "hfToken": {"secretName": "hf-token"}, "imagePullSecrets": [{"name": "regcred"}]},
    "target-alone-autoscaling": {"model": {"draft": "none"}, "workers": {"minReplicas": 1, "maxReplicas": 3, "gpusPerWorker": 1},
                                 "serve": {"replicas": 3}, "networkPolicy": {"enabled": False},
                                 "podDisruptionBudget": {"enabled": False}, "service": {"type": "LoadBalancer"}},
}


def render(values: dict | None = None) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values=values, name="svip", namespace="llm", is_install=True)
    docs = []
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@pytest.fixture(scope="module")
def rayservice_schema() -> dict:
    """KubeRay's CRD schema: $SVIP_KUBERAY_SCHEMA, else shared/kuberay/ beside the checkout (or
    beside a folder above it). Missing is a failure, not a skip: this is the chart's CRD check."""
    env = os.environ.get("SVIP_KUBERAY_SCHEMA")
    candidates = [Path(env)] if env else [parent / SCHEMA_IN_SHARED for parent in REPO.parents]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        pytest.fail(f"KubeRay's RayService schema not found (looked for ../{SCHEMA_IN_SHARED} above {REPO}); "
                    "set SVIP_KUBERAY_SCHEMA to its path")
    return json.loads(found.read_text())


@pytest.mark.parametrize("values", [None, VARIANTS["example"]], ids=["defaults", "example"])
def test_lint_is_clean(values):
    report = helm.lint(CHART, values, strict=True)
    assert not report["errors"], report
    assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]


@pytest.mark.parametrize("name", VARIANTS)
def test_rendered_objects_validate(name, rayservice_schema):
    docs = render(VARIANTS[name])
    services = by_kind(docs, "RayService")
    assert len(services) == 1
    jsonschema.validate(services[0], rayservice_schema)
    for doc in docs:
        if doc["kind"] != "RayService":
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("name", VARIANTS)
def test_serve_config_is_a_valid_serve_deployment(name):
    values = VARIANTS[name]
    service = by_kind(render(values), "RayService")[0]
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "svip_serve.app:build_app"
    settings = ServeSettings.from_args(app["args"])  # the app's own checks, as a replica would run them
    assert settings.device == "cuda"
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    gpus = int(workers["rayStartParams"]["num-gpus"])
    container = workers["template"]["spec"]["containers"][0]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == gpus
    per_pipeline = sum(b.get("GPU", 0) for b in settings.bundles())
    assert per_pipeline <= gpus and settings.num_replicas <= workers["maxReplicas"] * (gpus // per_pipeline)
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # pipelines land on GPU workers only


def test_example_values_are_the_qwen_pair():
    args = yaml.safe_load(by_kind(render(VARIANTS["example"]), "RayService")[0]["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["target"] == "Qwen/Qwen2.5-7B-Instruct" and args["draft"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert args["num_replicas"] == 2 and args["model_name"] == "qwen2.5-7b-svip"


def test_service_is_cluster_ip_by_default_and_ingress_is_optional():
    docs = render()
    serve_service = by_kind(docs, "RayService")[0]["spec"]["serveService"]
    assert serve_service["spec"]["type"] == "ClusterIP"
    assert not by_kind(docs, "Ingress")
    ingress = by_kind(render(VARIANTS["ingress-tls-token"]), "Ingress")[0]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == serve_service["metadata"]["name"]


def test_hf_token_comes_from_the_secret_reference():
    service = by_kind(render(VARIANTS["ingress-tls-token"]), "RayService")[0]
    cluster = service["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert "env" not in by_kind(render(), "RayService")[0]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def test_network_policy_keeps_ray_and_worker_ports_inside_the_release():
    policy = by_kind(render(), "NetworkPolicy")[0]["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    own, cluster = policy["ingress"]
    assert "ports" not in own and own["from"] == [{"podSelector": {"matchLabels": policy["podSelector"]["matchLabels"]}}]
    assert cluster["from"] == [{"namespaceSelector": {}}]  # in-cluster only: no ipBlock, no world
    assert sorted(p["port"] for p in cluster["ports"]) == [8000, 8080, 8265, 52365]


def test_pdb_covers_the_gpu_workers():
    pdb = by_kind(render(), "PodDisruptionBudget")[0]["spec"]
    assert pdb["maxUnavailable"] == 1 and pdb["selector"]["matchLabels"]["app.kubernetes.io/component"] == "ray-worker"
    worker_labels = by_kind(render(), "RayService")[0]["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"]
    assert pdb["selector"]["matchLabels"].items() <= worker_labels.items()


def test_helm_test_hook_runs_the_smoke_check():
    (pod,) = [d for d in by_kind(render(), "Pod") if d["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "svip_serve.smoke"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["SVIP_URL"] == "http://svip-serve:8000" and env["SVIP_MODEL"] == "Qwen/Qwen2.5-7B-Instruct"


@pytest.mark.parametrize("values, words", [
    ({"serve": {"replicas": 0}}, "replicas"),
    ({"model": {"dtype": "int8"}}, "dtype"),
    ({"decoding": {"policy": "fastest"}}, "policy"),
    ({"decoding": {"threshold": -1}}, "threshold"),
    ({"service": {"type": "ExternalName"}}, "type"),
    ({"modle": {"target": "x"}}, "modle"),
])
def test_values_schema_refuses_bad_values(values, words):
    with pytest.raises(helm.HelmError, match=words):
        render(values)


@pytest.mark.parametrize("values, words", [
    ({"workers": {"gpusPerWorker": 1}}, "cannot hold one pipeline"),
    ({"serve": {"replicas": 3}}, "need more GPU workers"),
    ({"workers": {"minReplicas": 2, "maxReplicas": 1}}, "minReplicas"),
])
def test_values_no_cluster_could_run_fail_with_the_reason(values, words):
    with pytest.raises(helm.HelmError, match=words):
        render(values)


def test_the_crd_schema_check_can_fail(rayservice_schema):
    """Control: the same check refuses a RayService KubeRay would refuse."""
    service = by_kind(render(), "RayService")[0]
    service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 2  # must be a string
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(service, rayservice_schema)
    del service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(service, rayservice_schema)
