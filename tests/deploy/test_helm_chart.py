"""The Helm chart, checked without a cluster: Helm's own engine (helm-python-sdk) lints and
renders it; the RayService validates against KubeRay's CRD schema, every core object against
Kubernetes' own schemas (kubernetes-validate), the embedded serveConfigV2 against Ray's
ServeDeploySchema and the app's own argument checks; values outside values.schema.json and values
no cluster could run are refused with the reason."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from svip_serve.settings import ServeSettings

pytestmark = pytest.mark.system  # the second tier (pyproject.toml markers)

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "svip"
EXAMPLE = REPO / "deploy" / "helm" / "examples" / "qwen2.5-7b-with-0.5b-draft.yaml"
EAGLE_EXAMPLE = REPO / "deploy" / "helm" / "examples" / "llama3.1-8b-with-eagle3-head.yaml"
TP_EXAMPLE = REPO / "deploy" / "helm" / "examples" / "llama3.1-70b-tp4-with-8b-draft.yaml"
SCHEMA_IN_SHARED = Path("shared") / "kuberay" / "rayservice-v1.schema.json"  # ../shared beside the checkout
KUBE_VERSION = "1.30"

VARIANTS = {
    "defaults": {},
    "example": yaml.safe_load(EXAMPLE.read_text()),
    "ingress-tls-token": {
        "ingress": {"enabled": True, "className": "nginx", "tls": [{"secretName": "t", "hosts": ["a.b"]}]},
        "hfToken": {"secretName": "hf-token"},
        "imagePullSecrets": [{"name": "regcred"}],
        "apiKey": {"secretName": "svip-keys"},
    },
    "every-option": {
        "apiKey": {"secretName": "svip-keys", "secretKey": "keys"},
        "serve": {
            "workerStartTimeoutS": 1800,
            "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2, "targetOngoingRequests": 4},
            "maxWaitS": 10,
            "maxRequestsPerKey": 4,
            "defaultMaxTokens": 1024,
            "allowIgnoreEos": True,
        },
        "grpcTls": {"secretName": "svip-grpc-tls"},
        "rayAuth": {"enabled": True, "secretName": "ray-token"},
        "workers": {"minReplicas": 1, "maxReplicas": 2, "shmSize": "16Gi"},
        "modelCache": {"enabled": True, "size": "200Gi", "storageClassName": "fast-rwx"},
        "upgradeStrategy": {"type": "NewCluster"},
        "head": {
            "faultTolerance": {
                "enabled": True,
                "redisAddress": "redis.redis:6379",
                "redisPasswordSecret": {"name": "redis", "key": "password"},
            }
        },
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 100},
        "containerSecurityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False},
        "env": [{"name": "RAY_LOG_LEVEL", "value": "info"}],
        "envFrom": [{"secretRef": {"name": "extra-env"}}],
        "extraVolumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
        "extraVolumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
        "podAnnotations": {"example.com/team": "llm"},
        "runtimeClassName": "nvidia",
        "priorityClassName": "serving",
        "networkPolicy": {
            "apiFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}],
            "operatorNamespace": "ray-system",
            "monitoringNamespace": "monitoring",
        },
        "podDisruptionBudget": {"enabled": True, "minAvailable": 0},
        "metrics": {
            "podMonitor": {"enabled": True, "labels": {"release": "prom"}},
            "serviceMonitor": {"enabled": True},
        },
        "grafana": {"dashboard": {"enabled": True}},
        "tests": {"image": "registry.example.com/python:3.12-slim"},
    },
    "eagle-head": yaml.safe_load(EAGLE_EXAMPLE.read_text()),
    "70b-tensor-parallel": yaml.safe_load(TP_EXAMPLE.read_text()),
    "target-alone-autoscaling": {
        "model": {"draft": "none"},
        "workers": {"minReplicas": 1, "maxReplicas": 3, "gpusPerWorker": 1},
        "serve": {"replicas": 3},
        "networkPolicy": {"enabled": False},
        "rayAuth": {"enabled": False},
        "podDisruptionBudget": {"enabled": False},
        "service": {"type": "LoadBalancer"},
        "apiKey": {"allowOpen": True},
    },
}


# what every install must say (the chart refuses to guess where the KubeRay operator runs)
REQUIRED = {"networkPolicy": {"operatorNamespace": "kuberay-system"}}


def merged(base: dict, values: dict | None) -> dict:
    out = dict(base)
    for key, value in (values or {}).items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def render(values: dict | None = None, required: dict = REQUIRED) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values=merged(required, values), name="svip", namespace="llm", is_install=True)
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
        pytest.fail(
            f"KubeRay's RayService schema not found (looked for ../{SCHEMA_IN_SHARED} above {REPO}); "
            "set SVIP_KUBERAY_SCHEMA to its path"
        )
    return json.loads(found.read_text())


@pytest.mark.parametrize(
    "values", [None, VARIANTS["example"], VARIANTS["eagle-head"], VARIANTS["every-option"],
               VARIANTS["70b-tensor-parallel"]],
    ids=["defaults", "example", "eagle-example", "every-option", "70b-tensor-parallel"],
)
def test_lint_is_clean(values):
    report = helm.lint(CHART, merged(REQUIRED, values), strict=True)
    assert not report["errors"], report
    assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]


@pytest.mark.parametrize("name", VARIANTS)
def test_rendered_objects_validate(name, rayservice_schema):
    docs = render(VARIANTS[name])
    services = by_kind(docs, "RayService")
    assert len(services) == 1
    jsonschema.validate(services[0], rayservice_schema)
    assert_keys_in_schema(services[0], rayservice_schema)
    for doc in docs:
        if doc["kind"] in ("PodMonitor", "ServiceMonitor"):  # the Prometheus Operator's CRDs
            assert_monitor_shape(doc)
        elif doc["kind"] != "RayService":
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def assert_keys_in_schema(doc, schema: dict, path: str = "") -> None:
    """Every key of doc is a property the schema names, all the way down. KubeRay's CRD sets no
    additionalProperties: false, so a typo (enableInTreeAutoscalling) validates and is ignored;
    this check catches it. Maps the schema leaves open are not looked into."""
    if isinstance(doc, dict):
        props = schema.get("properties")
        if props is None:
            return
        for key, value in doc.items():
            assert key in props, f"{path}.{key} is not a field of the CRD (a typo?)"
            assert_keys_in_schema(value, props[key], f"{path}.{key}")
    elif isinstance(doc, list) and "items" in schema:
        for i, item in enumerate(doc):
            assert_keys_in_schema(item, schema["items"], f"{path}[{i}]")


def assert_monitor_shape(doc: dict) -> None:
    """The Prometheus Operator's monitors, by the fields this chart sets (their CRDs are not here)."""
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    spec = doc["spec"]
    endpoints = spec["podMetricsEndpoints"] if doc["kind"] == "PodMonitor" else spec["endpoints"]
    assert spec["selector"]["matchLabels"] and endpoints and all(e["port"] == "metrics" for e in endpoints)


def test_the_structural_check_catches_a_typo(rayservice_schema):
    service = by_kind(render(), "RayService")[0]
    cluster = service["spec"]["rayClusterConfig"]
    cluster["enableInTreeAutoscalling"] = cluster.pop("enableInTreeAutoscaling")
    jsonschema.validate(service, rayservice_schema)  # the CRD's own schema lets it through
    with pytest.raises(AssertionError, match="enableInTreeAutoscalling is not a field"):
        assert_keys_in_schema(service, rayservice_schema)


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
    args = yaml.safe_load(by_kind(render(VARIANTS["example"]), "RayService")[0]["spec"]["serveConfigV2"])[
        "applications"
    ][0]["args"]
    assert args["target"] == "Qwen/Qwen2.5-7B-Instruct" and args["draft"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert args["num_replicas"] == 2 and args["model_name"] == "qwen2.5-7b-svip"


def test_a_feature_head_by_hub_id_reaches_the_app_as_draft_kind_eagle():
    """draftKind eagle: the app resolves the head (a hub id) into the model cache every Ray pod
    mounts, on the draft's GPU; the default stays a draft model."""
    def app_args(values):
        service = by_kind(render(values), "RayService")[0]
        return yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]

    args = app_args(VARIANTS["eagle-head"])
    assert args["draft"] == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B" and args["draft_kind"] == "eagle"
    settings = ServeSettings.from_args(args)
    assert [b.get("GPU") for b in settings.bundles()[1:]] == [1.0, 1.0]  # target, head
    assert app_args(None)["draft_kind"] == "model"


def test_a_70b_target_as_four_tensor_parallel_ranks_reaches_the_app():
    """model.tensorParallel 4: the app's target_tp, a pipeline's bundle holding the four ranks'
    GPUs (and CPUs) beside the draft's, packed in one worker pod; a pod too small, or GPUs a rank
    given twice over (targetGpus too), are refused at render, naming the values."""
    service = by_kind(render(VARIANTS["70b-tensor-parallel"]), "RayService")[0]
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    settings = ServeSettings.from_args(args)
    assert args["target_tp"] == 4 and settings.pair_config().target_tp == 4
    target, draft = settings.bundles()[1:]
    assert (target["GPU"], draft["GPU"], target["CPU"]) == (4.0, 1.0, 4 * args["worker_cpus"])
    small = merged(VARIANTS["70b-tensor-parallel"], {"workers": {"gpusPerWorker": 4}})
    with pytest.raises(Exception, match="cannot hold one pipeline: the target's 4 GPUs"):
        render(small)
    with pytest.raises(Exception, match="takes one GPU a rank"):
        render(merged(VARIANTS["70b-tensor-parallel"], {"model": {"targetGpus": 2}}))
    with pytest.raises(Exception, match="model.draftTensorParallel takes one GPU a rank"):
        render(merged(VARIANTS["70b-tensor-parallel"], {"model": {"draftTensorParallel": 2, "draftGpus": 2}}))
    with pytest.raises(Exception, match="model.draftTensorParallel needs a draft model"):
        render(merged(VARIANTS["70b-tensor-parallel"], {"model": {"draftTensorParallel": 2, "draft": "none"}}))
    with pytest.raises(Exception, match=r"the draft's \(model.draftGpus, or a GPU each of model.draftTensorParallel"):
        render(merged(VARIANTS["70b-tensor-parallel"], {"model": {"draftTensorParallel": 8}}))


def test_service_is_cluster_ip_by_default_and_ingress_is_optional():
    docs = render()
    serve_service = by_kind(docs, "RayService")[0]["spec"]["serveService"]
    assert serve_service["spec"]["type"] == "ClusterIP"
    assert not by_kind(docs, "Ingress")
    ingress = by_kind(render(VARIANTS["ingress-tls-token"]), "Ingress")[0]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == serve_service["metadata"]["name"]


def test_secrets_reach_the_gpu_workers_only():
    """The head runs Ray's Jobs API and loads no model: neither the hub token nor the API keys."""
    service = by_kind(render(VARIANTS["ingress-tls-token"]), "RayService")[0]
    cluster = service["spec"]["rayClusterConfig"]
    for group in cluster["workerGroupSpecs"]:
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
        assert env["SVIP_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "svip-keys", "key": "key"}
    assert "env" not in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert (
        "env"
        not in by_kind(render(), "RayService")[0]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"][
            "containers"
        ][0]
    )


def test_an_ingress_without_an_api_key_is_refused_unless_open_on_purpose():
    with pytest.raises(helm.HelmError, match="would publish an open API"):
        render({"ingress": {"enabled": True}})
    assert by_kind(render({"ingress": {"enabled": True}, "apiKey": {"allowOpen": True}}), "Ingress")
    assert by_kind(render({"ingress": {"enabled": True}, "apiKey": {"secretName": "keys"}}), "Ingress")
    example = VARIANTS["example"]
    assert example["ingress"]["enabled"] and example["apiKey"]["secretName"] and example["ingress"]["tls"]


def test_ray_token_authentication_is_on_by_default():
    cluster = by_kind(render(), "RayService")[0]["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}
    named = by_kind(render(VARIANTS["every-option"]), "RayService")[0]["spec"]["rayClusterConfig"]
    assert named["authOptions"] == {"mode": "token", "secretName": "ray-token"}
    assert (
        "authOptions"
        not in by_kind(render({"rayAuth": {"enabled": False}}), "RayService")[0]["spec"]["rayClusterConfig"]
    )


def test_worker_grpc_tls_and_serving_limits_reach_the_app():
    service = by_kind(render(VARIANTS["every-option"]), "RayService")[0]
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["grpc_tls_dir"] == "/etc/svip/grpc-tls"
    assert (args["max_wait_s"], args["max_requests_per_key"], args["default_max_tokens"], args["allow_ignore_eos"]) == (
        10,
        4,
        1024,
        True,
    )
    worker = pod_templates(service)[1]["spec"]
    assert {"name": "grpc-tls", "secret": {"secretName": "svip-grpc-tls", "defaultMode": 0o440}} in worker["volumes"]
    mounts = {m["name"]: m for m in worker["containers"][0]["volumeMounts"]}
    assert mounts["grpc-tls"] == {"name": "grpc-tls", "mountPath": "/etc/svip/grpc-tls", "readOnly": True}
    defaults = yaml.safe_load(by_kind(render(), "RayService")[0]["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert (
        "grpc_tls_dir" not in defaults
        and defaults["allow_ignore_eos"] is False
        and defaults["default_max_tokens"] == 2048
    )


def test_the_auto_policy_and_its_settings_reach_the_app():
    args = yaml.safe_load(
        by_kind(
            render({"decoding": {"policy": "auto", "auto": {"learn": False, "cost": 0.25, "window": 1024}}}),
            "RayService",
        )[0]["spec"]["serveConfigV2"]
    )["applications"][0]["args"]
    settings = ServeSettings.from_args(args)
    assert (settings.policy, settings.auto_learn, settings.auto_cost, settings.auto_window) == (
        "auto",
        False,
        0.25,
        1024,
    )
    defaults = yaml.safe_load(by_kind(render(), "RayService")[0]["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert "auto_cost" not in defaults and defaults["auto_learn"] is True and defaults["auto_window"] == 4096


def test_the_decoding_tree_reaches_the_app():
    """decoding.tree: off by default (a chain), as the operator sets it otherwise."""
    for values, expected in (({}, "off"), ({"decoding": {"tree": "cape"}}, "cape")):
        service = by_kind(render(values), "RayService")[0]
        args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
        assert ServeSettings.from_args(args).policy_defaults().tree == expected


def test_the_tool_call_parser_reaches_the_app():
    """decoding.toolCallParser: hermes by default (tool_choice auto reads calls), none refuses auto."""
    for values, expected in (({}, "hermes"), ({"decoding": {"toolCallParser": "none"}}, "none")):
        service = by_kind(render(values), "RayService")[0]
        args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
        assert ServeSettings.from_args(args).tool_call_parser == expected


def test_the_targets_idle_prefill_reaches_the_app():
    """decoding.idlePrefill: auto by default, as the operator sets it otherwise."""
    for values, expected in (({}, "auto"), ({"decoding": {"idlePrefill": "off"}}, "off")):
        service = by_kind(render(values), "RayService")[0]
        args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
        assert ServeSettings.from_args(args).idle_prefill == expected


def test_a_model_path_is_never_the_served_model_id():
    args = yaml.safe_load(
        by_kind(
            render({"model": {"target": "/models/qwen-7b", "draft": "none"}, "workers": {"gpusPerWorker": 1}}),
            "RayService",
        )[0]["spec"]["serveConfigV2"]
    )["applications"][0]["args"]
    assert args["model_name"] == "qwen-7b"


def policy_rules(values=None) -> dict:
    """The NetworkPolicy's ingress rules by the ports they open ("ray": every port, own pods)."""
    policy = by_kind(render(values), "NetworkPolicy")[0]["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    rules = {}
    for rule in policy["ingress"]:
        key = "ray" if "ports" not in rule else tuple(sorted(p["port"] for p in rule["ports"]))
        rules[key] = rule["from"]
    rules["own"] = [{"podSelector": {"matchLabels": policy["podSelector"]["matchLabels"]}}]
    return rules


RAY_PODS = {
    "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In", "values": ["ray-head", "ray-worker"]}]
}
OPERATOR = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
}


def test_network_policy_keeps_ray_and_worker_ports_inside_the_release():
    rules = policy_rules()
    own = rules["own"][0]["podSelector"]
    assert rules["ray"] == [{"podSelector": {**own, **RAY_PODS}}]  # the Ray pods only: not the helm test pod
    assert rules[(8000,)] == [{"namespaceSelector": {}}]  # ClusterIP: pods of the cluster, no ipBlock
    assert rules[(8080,)] == [{"namespaceSelector": {}}]


def test_only_the_operators_pods_reach_the_dashboard_and_its_agent():
    """One peer with both selectors: a pod must be in the operator's namespace AND carry its labels
    (two peers would admit either). No namespace named: the chart refuses to render."""
    rules = policy_rules()
    assert rules[(8265, 52365)] == [OPERATOR]
    peer = rules[(8265, 52365)][0]

    def admitted(namespace: str, labels: dict) -> bool:
        return peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": namespace} and all(
            labels.get(k) == v for k, v in peer["podSelector"]["matchLabels"].items()
        )

    assert admitted("kuberay-system", {"app.kubernetes.io/name": "kuberay-operator", "pod-template-hash": "x"})
    assert not admitted("default", {"app.kubernetes.io/name": "kuberay-operator"})  # another namespace
    assert not admitted("kuberay-system", {"app": "something-else"})  # not the operator
    with pytest.raises(helm.HelmError, match="networkPolicy.operatorNamespace is required"):
        render(required={})
    custom = policy_rules({"networkPolicy": {"operatorPodLabels": {"app.kubernetes.io/name": None, "app": "operator"}}})
    assert custom[(8265, 52365)][0]["podSelector"] == {"matchLabels": {"app": "operator"}}


@pytest.mark.parametrize("service_type", ["LoadBalancer", "NodePort"])
def test_network_policy_admits_external_traffic_for_an_external_service(service_type):
    """LoadBalancer and NodePort traffic reaches the pods from node addresses, not from pods: a
    pods-only rule drops it. The API's port gets an ipBlock; Ray's and the dashboard's do not."""
    rules = policy_rules({"service": {"type": service_type}, "apiKey": {"secretName": "svip-keys"}})
    assert {"ipBlock": {"cidr": "0.0.0.0/0"}} in rules[(8000,)]
    assert all("ipBlock" not in peer for key, peers in rules.items() if key != (8000,) for peer in peers)


def test_network_policy_api_sources_and_operator_namespace_are_settings():
    peers = [{"ipBlock": {"cidr": "10.0.0.0/8"}}, {"namespaceSelector": {"matchLabels": {"team": "apps"}}}]
    rules = policy_rules(
        {
            "networkPolicy": {"apiFrom": peers, "operatorNamespace": "ray-system", "monitoringNamespace": "monitoring"},
            "service": {"type": "LoadBalancer"},
            "apiKey": {"secretName": "svip-keys"},
        }
    )
    assert rules[(8000,)] == peers
    assert rules[(8265, 52365)][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "ray-system"}
    assert rules[(8265, 52365)][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kuberay-operator"}
    assert rules[(8080,)][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}


def test_no_pdb_by_default_and_an_integer_min_available_when_asked():
    """RayCluster, the worker pods' owner, has no scale subresource: a maxUnavailable budget
    reports 0 disruptions allowed and every drain hangs. Opt-in, integer minAvailable only."""
    assert not by_kind(render(), "PodDisruptionBudget")
    values = {
        "podDisruptionBudget": {"enabled": True, "minAvailable": 1},
        "workers": {"replicas": 2, "minReplicas": 2, "maxReplicas": 2},
    }
    (pdb,) = by_kind(render(values), "PodDisruptionBudget")
    spec = pdb["spec"]
    assert spec == {"minAvailable": 1, "selector": spec["selector"]} and isinstance(spec["minAvailable"], int)
    assert spec["selector"]["matchLabels"]["app.kubernetes.io/component"] == "ray-worker"
    worker_labels = by_kind(render(values), "RayService")[0]["spec"]["rayClusterConfig"]["workerGroupSpecs"][0][
        "template"
    ]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= worker_labels.items()
    with pytest.raises(helm.HelmError, match="would block every node drain"):
        render({"podDisruptionBudget": {"enabled": True, "minAvailable": 1}})  # one worker: no drain could proceed
    with pytest.raises(helm.HelmError, match="minAvailable"):
        render({"podDisruptionBudget": {"enabled": True, "minAvailable": "50%"}})


def serve_args(service: dict) -> dict:
    """The app's arguments in a rendered RayService's serveConfigV2."""
    return yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]


def pod_templates(service: dict) -> list[dict]:
    cluster = service["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def test_a_chart_release_changes_nothing_in_the_pod_templates():
    """KubeRay rebuilds the whole GPU cluster when the pod templates change: version labels there
    would make every chart bump an upgrade that needs twice the GPUs."""
    service = by_kind(render(), "RayService")[0]
    for template in pod_templates(service):
        labels = template["metadata"]["labels"]
        assert not {"app.kubernetes.io/version", "helm.sh/chart"} & set(labels), labels
        assert "version" not in json.dumps(template["metadata"])
    assert "helm.sh/chart" in service["metadata"]["labels"]  # the RayService itself keeps them


def test_upgrade_strategy_never_doubles_the_gpus_by_default():
    spec = by_kind(render(), "RayService")[0]["spec"]
    assert spec["upgradeStrategy"] == {"type": "None"}
    assert (
        by_kind(render({"upgradeStrategy": {"type": "NewCluster"}}), "RayService")[0]["spec"]["upgradeStrategy"]["type"]
        == "NewCluster"
    )
    options = {"gatewayClassName": "istio", "stepSizePercent": 25, "intervalSeconds": 60}
    incremental = by_kind(
        render({"upgradeStrategy": {"type": "NewClusterWithIncrementalUpgrade", "clusterUpgradeOptions": options}}),
        "RayService",
    )[0]["spec"]["upgradeStrategy"]
    assert incremental["clusterUpgradeOptions"] == options
    with pytest.raises(helm.HelmError, match="needs clusterUpgradeOptions"):
        render({"upgradeStrategy": {"type": "NewClusterWithIncrementalUpgrade"}})


def test_workers_declare_the_serve_port_kuberay_probes():
    """KubeRay's worker readiness probe looks for a container port named serve."""
    service = by_kind(render({"service": {"port": 9000}}), "RayService")[0]
    for template in pod_templates(service):
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports["serve"] == 9000


def test_shm_is_left_to_kuberay_unless_set():
    worker = pod_templates(by_kind(render(), "RayService")[0])[1]["spec"]
    assert "volumes" not in worker and "volumeMounts" not in worker["containers"][0]
    worker = pod_templates(by_kind(render({"workers": {"shmSize": "16Gi"}}), "RayService")[0])[1]["spec"]
    assert worker["volumes"] == [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}]
    assert {"name": "shm", "mountPath": "/dev/shm"} in worker["containers"][0]["volumeMounts"]


def test_helm_test_pod_is_small_and_pulls_with_the_release_secrets():
    docs = render({"imagePullSecrets": [{"name": "regcred"}], "apiKey": {"secretName": "svip-keys"}})
    (pod,) = [d for d in by_kind(docs, "Pod") if d["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    (script,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    container = pod["spec"]["containers"][0]
    assert container["image"] == "python:3.12-slim" and "cuda" not in container["image"]
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert container["command"] == ["python", "/smoke/smoke.py"]
    env = {e["name"]: e for e in container["env"]}
    assert (
        env["SVIP_URL"]["value"] == "http://svip-serve:8000"
        and env["SVIP_MODEL"]["value"] == "Qwen/Qwen2.5-7B-Instruct"
    )
    assert env["SVIP_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "svip-keys"
    assert script["data"]["smoke.py"].strip() == (REPO / "deploy" / "svip_serve" / "smoke.py").read_text().strip()


def test_the_charts_smoke_script_is_the_packages():
    """files/smoke.py (what the test pod runs) is a copy of svip_serve/smoke.py (what CI runs)."""
    assert (CHART / "files" / "smoke.py").read_bytes() == (REPO / "deploy" / "svip_serve" / "smoke.py").read_bytes()


@pytest.mark.parametrize(
    "values, words",
    [
        ({"serve": {"replicas": 0}}, "replicas"),
        ({"model": {"dtype": "int8"}}, "dtype"),
        ({"decoding": {"policy": "fastest"}}, "policy"),
        ({"decoding": {"threshold": -1}}, "threshold"),
        ({"decoding": {"auto": {"cost": 0}}}, "cost"),
        ({"decoding": {"auto": {"cost": 1e9}}}, "cost"),
        ({"decoding": {"auto": {"window": 1}}}, "window"),
        ({"decoding": {"auto": {"learn": "yes"}}}, "learn"),
        ({"service": {"type": "ExternalName"}}, "type"),
        ({"modle": {"target": "x"}}, "modle"),
        ({"model": {"draftKind": "medusa"}}, "draftKind"),
        ({"decoding": {"idlePrefill": "sometimes"}}, "idlePrefill"),
        ({"decoding": {"draftParallel": 0}}, "draftParallel"),
        ({"decoding": {"draftParallel": 17}}, "draftParallel"),
        ({"decoding": {"tree": "deepest"}}, "tree"),
        ({"decoding": {"toolCallParser": "mistral"}}, "toolCallParser"),
        ({"decoding": {"tree": False}}, "tree"),
    ],
)
def test_values_schema_refuses_bad_values(values, words):
    with pytest.raises(helm.HelmError, match=words):
        render(values)


@pytest.mark.parametrize(
    "values, words",
    [
        ({"workers": {"gpusPerWorker": 1}}, "cannot hold one pipeline"),
        ({"serve": {"replicas": 3}}, "need more GPU workers"),
        ({"workers": {"minReplicas": 2, "maxReplicas": 1}}, "minReplicas"),
        ({"model": {"draftKind": "eagle", "draft": "none"}}, "draftKind eagle needs model.draft"),
    ],
)
def test_values_no_cluster_could_run_fail_with_the_reason(values, words):
    with pytest.raises(helm.HelmError, match=words):
        render(values)


def test_operator_settings_reach_every_ray_pod():
    """Every pod: env, envFrom, extra volumes, runtime and priority classes, annotations. The GPU
    workers alone: the keys, the model cache (and HF_HOME), workers.env and workers.envFrom (the
    head runs Ray's Jobs API and loads no model: review N7)."""
    values = merged(VARIANTS["every-option"], {"workers": {"env": [{"name": "WORKER_ONLY", "value": "1"}],
                                                             "envFrom": [{"secretRef": {"name": "worker-env"}}]}})
    service = by_kind(render(values), "RayService")[0]
    for template in pod_templates(service):
        spec, container = template["spec"], template["spec"]["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        worker = template["metadata"]["labels"]["app.kubernetes.io/component"] == "ray-worker"
        assert ("SVIP_API_KEY" in env) == worker == ("HF_HOME" in env) == ("WORKER_ONLY" in env)
        if worker:
            assert env["SVIP_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "svip-keys", "key": "keys"}
            assert env["HF_HOME"]["value"] == "/home/ray/.cache/huggingface"
        assert env["RAY_LOG_LEVEL"]["value"] == "info"
        assert container["envFrom"] == [{"secretRef": {"name": "extra-env"}}] + (
            [{"secretRef": {"name": "worker-env"}}] if worker else [])
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["models"] == "/models" and ("model-cache" in mounts) == worker
        volumes = {v["name"]: v for v in spec["volumes"]}
        if worker:
            assert mounts["model-cache"] == "/home/ray/.cache/huggingface"
            assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == "svip-model-cache"
        assert spec["runtimeClassName"] == "nvidia" and spec["priorityClassName"] == "serving"
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert template["metadata"]["annotations"]["example.com/team"] == "llm"
    (claim,) = by_kind(render(VARIANTS["every-option"]), "PersistentVolumeClaim")
    assert (
        claim["spec"]["accessModes"] == ["ReadWriteMany"]
        and claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    )
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    existing = render({"modelCache": {"enabled": True, "existingClaim": "weights"}})
    assert not by_kind(existing, "PersistentVolumeClaim")
    worker = pod_templates(by_kind(existing, "RayService")[0])[1]["spec"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "weights"}} in worker["volumes"]


@pytest.mark.parametrize("service_type", ["LoadBalancer", "NodePort"])
def test_a_service_facing_outside_the_cluster_needs_a_key_unless_open_on_purpose(service_type):
    """Review N3: only the Ingress was checked; a LoadBalancer or NodePort Service published an
    open plain-HTTP API. The NOTES say that plain HTTP needs TLS in front."""
    with pytest.raises(helm.HelmError, match=f"service.type {service_type} without apiKey.secretName"):
        render({"service": {"type": service_type}})
    assert by_kind(render({"service": {"type": service_type}, "apiKey": {"allowOpen": True}}), "RayService")
    with helm.Chart.load(CHART) as chart:
        notes = chart.render(values=merged(REQUIRED, {"service": {"type": service_type},
                                                      "apiKey": {"secretName": "k"}}),
                             name="svip", namespace="llm", is_install=True)
    assert "plain HTTP" in next(text for path, text in notes.items() if path.endswith("NOTES.txt"))


def test_pods_are_restricted_and_workers_hold_no_service_account_token():
    """Review N7: the `restricted` Pod Security level asks for a seccomp profile; the model workers
    never call the Kubernetes API, so they get no token; a stopped worker's requests get the drain
    time (serve.drainTimeoutS reaches the app, and the pods' grace is longer)."""
    service = by_kind(render(), "RayService")[0]
    head, worker = pod_templates(service)
    for template in (head, worker):
        assert template["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert worker["spec"]["automountServiceAccountToken"] is False
    assert worker["spec"]["terminationGracePeriodSeconds"] == 90
    assert serve_args(service)["drain_timeout_s"] == 60


@pytest.mark.parametrize("name", ["SVIP_TEST_GATE_DIR", "SVIP_TEST_FORWARD_DELAY_S"])
def test_the_test_hooks_are_refused_in_values(name):
    """Review N5: a test hook copied from a CI setup would hold or slow the target while the health
    check stays green: the schema refuses their names, on every pod and on the workers."""
    for values in ({"env": [{"name": name, "value": "1"}]}, {"workers": {"env": [{"name": name, "value": "1"}]}}):
        with pytest.raises(helm.HelmError, match="env"):
            render(values)


def test_hub_revisions_pin_what_every_pod_loads():
    """Review N6: model.revision and model.draftRevision reach the app as owner/name@revision,
    which every hub fetch takes; the served model id stays the bare target."""
    args = serve_args(by_kind(render({"model": {"revision": "a" * 40, "draftRevision": "v1.0"}}), "RayService")[0])
    assert args["target"] == "Qwen/Qwen2.5-7B-Instruct@" + "a" * 40
    assert args["draft"] == "Qwen/Qwen2.5-0.5B-Instruct@v1.0" and args["model_name"] == "Qwen/Qwen2.5-7B-Instruct"
    alone = serve_args(by_kind(render({"model": {"draft": "none", "draftRevision": "v1"}}), "RayService")[0])
    assert alone["draft"] == "none"
    assert ServeSettings.from_args(args).served_name == "Qwen/Qwen2.5-7B-Instruct"


def test_per_key_limits_and_the_max_tokens_cap_are_on_by_default():
    """Review H1: a per-key limit on by default, with a KV budget of half the pool and a cap on
    max_tokens."""
    args = serve_args(by_kind(render(), "RayService")[0])
    assert (args["max_requests_per_key"], args["max_kv_tokens_per_key"], args["max_tokens_cap"]) == (8, 16384, 4096)
    assert ServeSettings.from_args(args).max_kv_tokens_per_key == 16384


def test_pods_run_as_non_root_by_default():
    for template in pod_templates(by_kind(render(), "RayService")[0]):
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True
        assert template["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False


def test_cold_start_timeout_and_autoscaling_reach_the_app():
    service = by_kind(render(VARIANTS["every-option"]), "RayService")[0]
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["worker_start_timeout_s"] == 1800
    assert args["autoscaling"] == {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 4}
    assert service["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    settings = ServeSettings.from_args(args)
    assert settings.autoscaling == {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 4}
    with pytest.raises(helm.HelmError, match="need more GPU workers"):
        render({"serve": {"autoscaling": {"enabled": True, "maxReplicas": 3}}})


def test_head_fault_tolerance_uses_an_external_redis(rayservice_schema):
    spec = by_kind(render(VARIANTS["every-option"]), "RayService")[0]["spec"]["rayClusterConfig"][
        "gcsFaultToleranceOptions"
    ]
    assert spec["redisAddress"] == "redis.redis:6379"
    assert spec["redisPassword"]["valueFrom"]["secretKeyRef"] == {"name": "redis", "key": "password"}
    with pytest.raises(helm.HelmError, match="redisAddress"):
        render({"head": {"faultTolerance": {"enabled": True}}})


def test_monitoring_objects_and_the_dashboard():
    docs = render(VARIANTS["every-option"])
    (pod_monitor,) = by_kind(docs, "PodMonitor")
    assert pod_monitor["metadata"]["labels"]["release"] == "prom"
    (service_monitor,) = by_kind(docs, "ServiceMonitor")
    (metrics_service,) = [d for d in by_kind(docs, "Service") if d["metadata"]["name"] == "svip-metrics"]
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= metrics_service["metadata"]["labels"].items()
    (dashboard,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == "svip-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(dashboard["data"]["svip.json"])
    titles = " ".join(p["title"] for p in board["panels"]).lower()
    for words in ("tokens", "acceptance rate", "acceptance length", "draft length", "first token", "kv cache", "429"):
        assert words in titles, words
    exported = (REPO / "deploy" / "svip_serve" / "metrics.py").read_text()
    names = {
        name
        for panel in board["panels"]
        for target in panel["targets"]
        for name in re.findall(r"ray_svip_(\w+?)(?:_total|_bucket)?\{", target["expr"])
    }
    assert len(names) >= 8
    for name in names:  # every series a panel reads is one the app exports
        assert any(
            f'{form}"{prefix}{name}"' in exported
            for form in ("counter(", "histogram(", "Gauge(")
            for prefix in ("", "svip_")
        ), name


def test_dockerfile_installs_dependencies_before_the_source_and_runs_as_ray():
    text = (REPO / "deploy" / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    deps = next(i for i, line in enumerate(lines) if "pip install" in line and "--no-deps" not in line)
    first_source = next(i for i, line in enumerate(lines) if line.startswith("COPY") and "svip_common" in line)
    assert deps < first_source  # a code change does not reinstall torch
    assert any(line.startswith("USER ray") for line in lines)
    assert "[test]" not in text and "pytest" not in text


def test_the_crd_schema_check_can_fail(rayservice_schema):
    """Control: the same check refuses a RayService KubeRay would refuse."""
    service = by_kind(render(), "RayService")[0]
    service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 2  # must be a string
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(service, rayservice_schema)
    del service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(service, rayservice_schema)


# Each field of the pair's one configuration (svip_common/pair_config.py) that the chart sets: the
# values that set it, a value other than its default, and the field's path in the PairConfig.
CHART_TO_PAIR = [
    ({"model": {"target": "org/target"}}, "target", "org/target"),
    ({"model": {"draft": "org/draft"}}, "draft", "org/draft"),
    ({"model": {"draft": "none"}}, "draft", None),
    ({"model": {"dtype": "float16"}}, "dtype", "float16"),
    ({"model": {"targetGpus": 4}, "workers": {"gpusPerWorker": 8}}, "target_gpus", 4),
    ({"model": {"draftGpus": 2}, "workers": {"gpusPerWorker": 8}}, "draft_gpus", 2),
    ({"model": {"tensorParallel": 2}, "workers": {"gpusPerWorker": 8}}, "target_tp", 2),
    ({"model": {"draftTensorParallel": 2}, "workers": {"gpusPerWorker": 8}}, "draft_tp", 2),
    ({"serve": {"workerCpus": 3}}, "worker_cpus", 3),
    ({"grpcTls": {"secretName": "tls"}}, "grpc_tls_dir", "/etc/svip/grpc-tls"),
    ({"serve": {"kvCacheTokens": 8192}}, "kv_cache_tokens", 8192),
    ({"serve": {"maxBatchedTokens": 256}}, "max_batched_tokens", 256),
    ({"decoding": {"loadAware": "off"}}, "load_aware", "off"),
    ({"decoding": {"idlePrefill": "always"}}, "idle_prefill", "always"),
    ({"decoding": {"draftParallel": 1}}, "draft_parallel", 1),
    ({"decoding": {"auto": {"learn": False}}}, "auto_learn", False),
    ({"decoding": {"auto": {"cost": 0.5}}}, "auto_cost", 0.5),
    ({"decoding": {"auto": {"window": 1024}}}, "auto_window", 1024),
    ({"serve": {"workerRestarts": 2}}, "worker_restarts", 2),
    ({"serve": {"draftStallS": 7}}, "draft_stall_s", 7.0),
    ({"serve": {"sampledHoldS": 9}}, "sampled_hold_s", 9.0),
    ({"serve": {"workerStartTimeoutS": 1200}}, "worker_start_timeout_s", 1200),
    ({"decoding": {"draftLengthCap": 16}}, "draft_length_cap", 16),
]
# ... and the fields it does not, each with the reason (a field added to PairConfig must be in one
# list or the other: the test below fails until it is)
NOT_FROM_CHART = {
    "device": "always cuda in the chart (the workers are GPU pods)",
    "layout": "a replica's placement group packs its pair on one node (ServeSettings.bundles)",
    "packed": "always: the pair shares its replica's node and talks over loopback",
    "insecure_workers": "never needed: packed workers talk over loopback; grpcTls covers the rest",
    "placement_timeout_s": "PairConfig's default: Serve places the replica's bundles before the workers start",
    "emulate": "device timing stands in for GPUs on a machine without them; a cluster's workers have real ones",
}


def _pair_field(config, path: str):
    value = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _pair_config_of(values: dict):
    args = yaml.safe_load(by_kind(render(values), "RayService")[0]["spec"]["serveConfigV2"])["applications"][0]["args"]
    return ServeSettings.from_args(args).pair_config()


def _leaves(config, prefix: str = "") -> set[str]:
    """The dotted names of a configuration's plain fields (a nested dataclass's own, below its name)."""
    import dataclasses

    out = set()
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        out |= _leaves(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else {prefix + f.name}
    return out


def test_every_field_of_the_pair_configuration_is_set_by_the_chart_or_says_why_not():
    """A field added to PairConfig fails this until the chart sets it (a row of CHART_TO_PAIR, which
    checks that the value arrives) or NOT_FROM_CHART says why it does not."""
    mapped = {path for _, path, _ in CHART_TO_PAIR}
    defaults = _pair_config_of({})
    assert _leaves(defaults) == mapped | set(NOT_FROM_CHART)
    assert not mapped & set(NOT_FROM_CHART)
    for values, path, expected in CHART_TO_PAIR:
        config = _pair_config_of(values)
        assert _pair_field(config, path) == expected != _pair_field(defaults, path), (values, path)
    assert (defaults.device, defaults.packed, defaults.layout, defaults.insecure_workers) == ("cuda", True, None, False)
