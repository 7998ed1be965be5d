"""The Helm chart (helm/tandem) rendered by Helm's own engine (helm-python-sdk
bundles Helm's Go SDK), linted in strict mode, and every object checked
against its schema: RayCluster against KubeRay's CRD, core kinds with
kubernetes-validate. The rendered serve command passes
``tandem serve --check-config`` and the GPUs the pods get equal what the
engines ask for. No Kubernetes cluster is involved."""

from __future__ import annotations

import copy
import functools
import gzip
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

pytestmark = pytest.mark.long  # tens of seconds: started early (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "tandem"
CRD_GZ = Path(__file__).parent / "kuberay" / "ray.io_rayclusters.yaml.gz"
SHARED_CRD = REPO.parent / "shared" / "kuberay-crds" / "ray.io_rayclusters.yaml"
KUBE_VERSION = "1.37.0"
CORE_KINDS = {"ConfigMap", "Service", "Secret", "Ingress", "PodDisruptionBudget"}
ROLES = ("prefill", "decode", "colocated")

GPU_DISAGG = {  # 2 prefill pods x TP 2, 4 decode pods x TP 1, model on a PVC, RDMA
    "gpu": {"enabled": True},
    "model": {"source": "pvc", "name": "llama-3.1-8b", "pvc": {"claimName": "models"}},
    "pools": {
        "prefill": {
            "replicas": 2,
            "tensorParallelSize": 2,
            "resources": {"cpu": "16", "memory": "128Gi"},
            "extraResources": {"rdma/hca_shared_devices_a": 1},
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "engine": {"max_num_batched_tokens": 8192, "enable_prefix_caching": True},
        },
        "decode": {
            "replicas": 4,
            "tensorParallelSize": 1,
            "resources": {"cpu": "8", "memory": "64Gi"},
            "extraResources": {"rdma/hca_shared_devices_a": 1},
            "engine": {"max_num_seqs": 256},
        },
    },
    "serve": {"disaggMinTokens": 64, "kvLeaseS": 30, "loadFailurePolicy": "fail"},
}
COLOCATED_ONLY = {
    "model": {"source": "hostPath", "name": "", "hostPath": {"path": "/data/models/tiny"}},
    "pools": {
        "prefill": {"enabled": False},
        "decode": {"enabled": False},
        "colocated": {"enabled": True, "replicas": 2, "enginesPerPod": 2},
    },
    "serve": {"engine": {"block_size": 32}},
}
EXPOSED = {  # API key from a chart-made Secret, Ingress, ServiceMonitor, hub model, JSON logs, OTLP
    "apiKey": {"value": "k8s-test-key"},
    "serve": {
        "logFormat": "json",
        "otlpTracesEndpoint": "http://otel-collector.monitoring:4318",
        "apiServerCount": 3,  # three gateway processes in the head pod, one port
    },
    "ingress": {"enabled": True, "className": "nginx", "host": "llm.example.com"},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "model": {"source": "hub", "name": "org/some-model", "hubTokenSecret": {"name": "hf"}},
}
AUTOSCALING = {  # KubeRay's autoscaler, pools that resize within min/max, the load planner
    "autoscaling": {"enabled": True, "upscalingMode": "Conservative", "idleTimeoutSeconds": 120},
    "pools": {
        "prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 2},
        "decode": {"replicas": 2, "minReplicas": 0, "maxReplicas": 4, "enginesPerPod": 2},
    },
    "serve": {"planner": {"mode": "load", "intervalS": 5, "watchIntervalS": 2}},
}
SCENARIOS = {
    "defaults": {},
    "examples/gpu-values.yaml": yaml.safe_load(
        (CHART / "examples" / "gpu-values.yaml").read_text()
    ),
    "gpu-2pxtp2-4dxtp1": GPU_DISAGG,
    "colocated-only": COLOCATED_ONLY,
    "apikey-ingress-servicemonitor": EXPOSED,
    "autoscaling-planner": AUTOSCALING,
}


def render(values: dict) -> list[dict]:
    """Every object the chart renders for ``values`` (NOTES.txt left out)."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name="tandem", namespace="serving")
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


@functools.cache
def raycluster_schema() -> dict:
    crd = yaml.safe_load(gzip.decompress(CRD_GZ.read_bytes()))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def shared_crd() -> Path | None:
    """shared/kuberay-crds beside the checkout (CI), or beside the main
    checkout of this worktree."""
    candidates = [SHARED_CRD]
    common = subprocess.run(
        ["git", "rev-parse", "--path-format=absolute", "--git-common-dir"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if common.returncode == 0:
        candidates.append(
            Path(common.stdout.strip()).parent.parent / SHARED_CRD.relative_to(REPO.parent)
        )
    return next((c for c in candidates if c.exists()), None)


def test_vendored_crd_is_kuberays():
    """The copy under tests/ is the shared one, byte for byte."""
    shared = shared_crd()
    if shared is None:
        pytest.skip("no shared/kuberay-crds beside this checkout to compare the vendored copy with")
    assert gzip.decompress(CRD_GZ.read_bytes()) == shared.read_bytes()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_lint_is_clean_in_strict_mode(scenario):
    report = helm.lint(str(CHART), SCENARIOS[scenario], strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


def test_lint_reports_bad_values():
    """The lint oracle is not vacuous: values the schema rejects are errors."""
    report = helm.lint(str(CHART), {"pools": {"decode": {"replicas": -1}}}, strict=True)
    problems = [m["error"] for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert any("replicas" in p for p in problems), report


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_object_validates(scenario):
    objects = render(SCENARIOS[scenario])
    kinds = {o["kind"] for o in objects}
    assert {"RayCluster", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    for obj in objects:
        if obj["apiVersion"] == "ray.io/v1":
            jsonschema.Draft7Validator(raycluster_schema()).validate(obj)
            for pod in pod_templates(obj).values():
                kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)
        elif obj["kind"] in CORE_KINDS:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        else:
            assert obj["kind"] == "ServiceMonitor", obj["kind"]
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            assert obj["spec"]["endpoints"] == [
                {"port": "http", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}
            ]


def test_crd_schema_catches_a_bad_raycluster():
    """The oracle is not vacuous: a wrong field type fails validation."""
    (cluster,) = by_kind(render({}), "RayCluster")
    bad = copy.deepcopy(cluster)
    bad["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError, match="replicas|'two'"):
        jsonschema.Draft7Validator(raycluster_schema()).validate(bad)


def pod_templates(cluster: dict) -> dict[str, dict]:
    """Each group's pod template as a v1 Pod: {"head": pod, "prefill": pod, ...}."""
    spec = cluster["spec"]
    groups = {"head": spec["headGroupSpec"]}
    groups.update({g["groupName"]: g for g in spec.get("workerGroupSpecs", [])})
    return {
        name: {"apiVersion": "v1", "kind": "Pod", **copy.deepcopy(group["template"])}
        for name, group in groups.items()
    }


def serve_argv(cluster: dict, config_path: Path, api_key: str | None) -> list[str]:
    """The head's `tandem serve ...` as argv, with the ConfigMap's file at
    ``config_path`` and the Secret's key in $TANDEM_API_KEY."""
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert head["command"] == ["/bin/bash", "-c", "--"]
    script = head["args"][0]
    assert 'eval "${KUBERAY_GEN_RAY_START_CMD/--block/}" && exec tandem serve' in script
    argv = shlex.split(script.split("&& exec ", 1)[1])
    argv = [os.path.expandvars(a) if a == "$TANDEM_API_KEY" else a for a in argv]
    assert argv[:4] == ["tandem", "serve", "--config", "/etc/tandem/serve.yaml"]
    if api_key is not None:
        assert argv[argv.index("--api-key") + 1] == "$TANDEM_API_KEY"
        argv[argv.index("--api-key") + 1] = api_key
    argv[3] = str(config_path)
    return argv[2:]  # after "tandem serve"


def check_config(objects: list[dict], tmp_path: Path, api_key: str | None = None) -> dict:
    (cluster,) = by_kind(objects, "RayCluster")
    (serve_cm,) = [
        c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"].endswith("-serve")
    ]
    config_path = tmp_path / "serve.yaml"
    config_path.write_text(serve_cm["data"]["serve.yaml"])
    argv = serve_argv(cluster, config_path, api_key)
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cluster", "serve", *argv, "--check-config"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_serve_command_passes_check_config_and_gpus_match(scenario, tmp_path):
    values = SCENARIOS[scenario]
    objects = render(values)
    api_key = values.get("apiKey", {}).get("value")
    if values.get("apiKey", {}).get("existingSecret"):
        api_key = "from-an-existing-secret"
    resolved = check_config(objects, tmp_path, api_key)
    (cluster,) = by_kind(objects, "RayCluster")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    pools = {p["role"]: p for p in resolved["pools"]}
    assert set(pools) == set(groups)
    gpu_name = "nvidia.com/gpu"
    for role, pool in pools.items():
        group = groups[role]
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        # the group advertises N units of its resource; each engine takes one
        advertised = json.loads(group["rayStartParams"]["resources"].strip("'"))
        assert pool["ray_resources"] == {f"tandem_{role}": 1.0}
        engines_per_pod = advertised[f"tandem_{role}"]
        assert pool["num_engines"] == group["replicas"] * engines_per_pod
        # the pool resizes (tandem scale, the planner) within its group's pods
        assert pool["max_engines"] == group["maxReplicas"] * engines_per_pod
        assert pool["min_engines"] == max(1, group["minReplicas"] * engines_per_pod)
        if scenario != "autoscaling-planner":
            assert group["minReplicas"] == group["maxReplicas"] == group["replicas"]
        gpus_per_pod = int(limits.get(gpu_name, 0))
        assert gpus_per_pod == engines_per_pod * pool["num_gpus_per_engine"]
        assert int(container["resources"]["requests"].get(gpu_name, 0)) == gpus_per_pod
    if scenario == "gpu-2pxtp2-4dxtp1":
        assert (pools["prefill"]["num_engines"], pools["prefill"]["num_gpus_per_engine"]) == (2, 2)
        assert (pools["decode"]["num_engines"], pools["decode"]["num_gpus_per_engine"]) == (4, 1)
        assert pools["prefill"]["engine"]["max_num_batched_tokens"] == 8192
        assert pools["decode"]["engine"]["max_num_seqs"] == 256
        assert resolved["serve"]["model"] == "/models/llama-3.1-8b"
        assert resolved["serve"]["disagg_min_tokens"] == 64
        assert resolved["serve"]["load_failure_policy"] == "fail"
        assert pools["decode"]["engine"]["kv_lease_s"] == 30
        (prefill,) = groups["prefill"]["template"]["spec"]["containers"]
        assert prefill["resources"]["limits"]["rdma/hca_shared_devices_a"] == 1
    autoscaling = scenario == "autoscaling-planner"
    assert cluster["spec"]["enableInTreeAutoscaling"] is autoscaling
    assert ("autoscalerOptions" in cluster["spec"]) is autoscaling
    assert resolved["serve"]["planner"] == ("load" if autoscaling else "off")
    if autoscaling:
        options = cluster["spec"]["autoscalerOptions"]
        assert (options["upscalingMode"], options["idleTimeoutSeconds"]) == ("Conservative", 120)
        assert (groups["decode"]["minReplicas"], groups["decode"]["maxReplicas"]) == (0, 4)
        assert (pools["decode"]["min_engines"], pools["decode"]["max_engines"]) == (1, 8)
        assert (pools["prefill"]["min_engines"], pools["prefill"]["max_engines"]) == (1, 2)
        assert resolved["serve"]["planner_interval_s"] == 5
        assert resolved["serve"]["planner_watch_interval_s"] == 2
    if scenario == "colocated-only":
        assert (
            pools["colocated"]["num_engines"] == 4
            and pools["colocated"]["num_gpus_per_engine"] == 0
        )
        assert pools["colocated"]["engine"]["block_size"] == 32
        assert resolved["serve"]["model"] == "/models"
    if scenario == "apikey-ingress-servicemonitor":
        assert resolved["serve"]["api_server_count"] == 3
        assert resolved["serve"]["api_key"] == "<set>"
        assert resolved["serve"]["model"] == "org/some-model"
        assert resolved["serve"]["log_format"] == "json"
        assert resolved["serve"]["otlp_traces_endpoint"] == "http://otel-collector.monitoring:4318"
        assert {p["engine"]["log_format"] for p in pools.values()} == {"json"}
    else:
        assert resolved["serve"]["api_server_count"] == 1
        assert resolved["serve"]["log_format"] == "text"
        assert resolved["serve"]["otlp_traces_endpoint"] is None


def test_head_runs_the_gateway_with_probes_shm_and_non_root():
    objects = render(EXPOSED)
    (cluster,) = by_kind(objects, "RayCluster")
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    pods = pod_templates(cluster)
    (head,) = pods["head"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert head[probe]["httpGet"] == {"path": "/health", "port": "http"}
    env = {e["name"]: e for e in head["env"]}
    assert env["TANDEM_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "tandem-api-key",
        "key": "api-key",
    }
    assert "k8s-test-key" not in json.dumps(cluster)  # only in the Secret
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf"
    for name, pod in pods.items():
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        (container,) = spec["containers"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        shm = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        if name != "head":
            assert 'eval "exec $KUBERAY_GEN_RAY_START_CMD"' in container["args"][0]
    (secret,) = by_kind(objects, "Secret")
    assert secret["metadata"]["name"] == "tandem-api-key"
    (ingress,) = by_kind(objects, "Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    (service,) = by_kind(objects, "Service")
    assert backend == {"name": service["metadata"]["name"], "port": {"name": "http"}}
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "gateway"
    assert pods["head"]["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"


def test_pdb_per_worker_group_and_dashboards_for_grafana():
    objects = render(GPU_DISAGG)
    pdbs = {p["metadata"]["name"]: p for p in by_kind(objects, "PodDisruptionBudget")}
    assert set(pdbs) == {"tandem-prefill", "tandem-decode"}
    (cluster,) = by_kind(objects, "RayCluster")
    for group in cluster["spec"]["workerGroupSpecs"]:
        selector = pdbs[f"tandem-{group['groupName']}"]["spec"]["selector"]["matchLabels"]
        labels = group["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
    dashboards = [c for c in by_kind(objects, "ConfigMap") if "dashboard" in c["metadata"]["name"]]
    files = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    assert len(dashboards) == len(files) >= 2
    for cm in dashboards:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((name, text),) = cm["data"].items()
        assert json.loads(text) == json.loads((CHART / "dashboards" / name).read_text())


@pytest.mark.parametrize(
    "values, field",
    [
        ({"pools": {"decode": {"replicas": -1}}}, "/pools/decode/replicas"),
        ({"pools": {"prefill": {"tensorParallelSize": 0}}}, "/pools/prefill/tensorParallelSize"),
        ({"pools": {"encode": {"enabled": True}}}, "encode"),
        ({"pools": {"decode": {"enginesPerPod": 0}}}, "/pools/decode/enginesPerPod"),
        ({"model": {"source": "s3"}}, "/model/source"),
        ({"serve": {"loadFailurePolicy": "retry"}}, "/serve/loadFailurePolicy"),
        ({"serve": {"apiServerCount": 0}}, "/serve/apiServerCount"),
        ({"pools": {"decode": {"engine": {"max_num_seq": 4}}}}, "max_num_seq"),
        ({"pools": {"decode": {"maxReplicas": 0}}}, "/pools/decode/maxReplicas"),
        ({"autoscaling": {"upscalingMode": "Fast"}}, "/autoscaling/upscalingMode"),
        ({"serve": {"planner": {"mode": False}}}, "/serve/planner/mode"),  # YAML's bare off
    ],
)
def test_schema_rejects_bad_values_naming_the_field(values, field):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError) as info:
            chart.validate_schema(chart.merge_values(values))
    assert field in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"pools": {"colocated": {"enabled": True}}},
            "pools.colocated.enabled: a colocated pool replaces prefill and decode",
        ),
        ({"pools": {"decode": {"enabled": False}}}, "pools.decode.enabled"),
        ({"pools": {"prefill": {"tensorParallelSize": 2}}}, "pools.prefill.tensorParallelSize"),
        ({"model": {"source": "pvc"}}, "model.pvc.claimName"),
        ({"ingress": {"enabled": True}}, "ingress.host"),
        ({"pools": {"decode": {"replicas": 3, "maxReplicas": 2}}}, "pools.decode.minReplicas"),
        ({"serve": {"planner": {"mode": "sla"}}}, "serve.planner.profile"),
    ],
)
def test_inconsistent_values_fail_rendering_with_a_clear_message(values, message):
    with pytest.raises(helm.HelmError, match=message.replace(".", r"\.")):
        render(values)
