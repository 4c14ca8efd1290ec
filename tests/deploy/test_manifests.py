"""The Helm chart and its rendered manifests: current, valid Kubernetes objects, and consistent with each other.

Schemas: kubernetes-validate (PyPI) ships the Kubernetes OpenAPI schemas as JSON schemas; the objects are
checked in strict mode (unknown fields are errors) against the oldest and newest Kubernetes it knows. The
ServiceMonitor CRD is not in them: it is checked against the part of prometheus-operator's schema used here.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from load_tests.harness import load_file
from server.lifecycle import ENV_DRAIN_DELAY, ENV_DRAIN_TIMEOUT
from server.metrics import _COUNTERS

ROOT = Path(__file__).resolve().parents[2]
kv = pytest.importorskip("kubernetes_validate.utils", reason="pip install kubernetes-validate")
yaml = pytest.importorskip("yaml")  # both come with kubernetes-validate
jsonschema = pytest.importorskip("jsonschema")


render = load_file(ROOT / "deploy" / "render.py", register_as="kiln_deploy_render")  # it defines dataclasses
K8S_VERSIONS = ["1.29.0", kv.latest_version()]

SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "properties": {"matchLabels": {
                    "type": "object", "additionalProperties": {"type": "string"}}}},
                "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "properties": {
                        "port": {"type": "string"}, "path": {"type": "string"}, "scheme": {"type": "string"},
                        "interval": {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?"
                                                                  "(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
                        "scrapeTimeout": {"type": "string"}}}},
            },
        },
    },
}


def _documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / "deploy" / "manifests" / name).read_text()) if d]


def _by_kind(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in docs}


@pytest.mark.parametrize("name", sorted(render.OUTPUTS))
def test_committed_manifests_are_current(name):
    assert (ROOT / "deploy" / "manifests" / name).read_text() == render.render_python(render.OUTPUTS[name]), \
        "stale: run python deploy/render.py"


@pytest.mark.parametrize("name", sorted(render.OUTPUTS))
def test_python_render_matches_helm_template(name):
    helm = render.render_helm(render.OUTPUTS[name])
    if helm is None:
        pytest.skip("helm not installed")
    ours = [d for d in yaml.safe_load_all(render.render_python(render.OUTPUTS[name])) if d]
    assert ours == [d for d in yaml.safe_load_all(helm) if d]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", sorted(render.OUTPUTS))
def test_manifests_validate_against_kubernetes_schemas(name, version):
    kinds = []
    for doc in _documents(name):
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
        else:
            kv.validate(doc, version, strict=True)
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["Deployment", "HorizontalPodAutoscaler", "PersistentVolumeClaim",
                             "PodDisruptionBudget", "Service", "ServiceMonitor"]


def test_validator_rejects_broken_objects():
    """The schema check has teeth: a typo'd field and a wrong type are both errors."""
    deployment = _by_kind(_documents("kiln.yaml"))["Deployment"]
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    for broken in (typo, wrong_type):
        with pytest.raises(kv.ValidationError):
            kv.validate(broken, K8S_VERSIONS[-1], strict=True)
    monitor = copy.deepcopy(_by_kind(_documents("kiln.yaml"))["ServiceMonitor"])
    monitor["spec"]["endpoints"][0]["interval"] = "fifteen"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("name", sorted(render.OUTPUTS))
def test_objects_refer_to_each_other(name):
    objs = _by_kind(_documents(name))
    deployment, service = objs["Deployment"], objs["Service"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (deployment["spec"]["selector"]["matchLabels"], service["spec"]["selector"],
                     objs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
                     objs["ServiceMonitor"]["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= pod_labels.items()
    assert objs["ServiceMonitor"]["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    container = _container(deployment)
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port_names == {"http": 8000, "grpc": 8001, "metrics": 8002}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(port_names)
    assert {e["port"] for e in objs["ServiceMonitor"]["spec"]["endpoints"]} <= {p["name"] for p in
                                                                                 service["spec"]["ports"]}
    target = objs["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert "replicas" not in deployment["spec"]  # the HPA owns it
    volumes = {v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert set(mounts.values()) <= volumes and "/models" in mounts and "/cache" in mounts
    claims = {v["persistentVolumeClaim"]["claimName"] for v in deployment["spec"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    assert objs["PersistentVolumeClaim"]["metadata"]["name"] in claims
    for init in deployment["spec"]["template"]["spec"].get("initContainers", []):
        assert {m["name"] for m in init["volumeMounts"]} <= volumes


@pytest.mark.parametrize("name", sorted(render.OUTPUTS))
def test_gpu_probes_and_graceful_shutdown(name):
    deployment = _by_kind(_documents(name))["Deployment"]
    pod, container = deployment["spec"]["template"]["spec"], _container(deployment)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["KILN_CACHE_DIR"] == "/cache"
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    # SIGKILL comes terminationGracePeriodSeconds after the preStop hook starts: it must outlast sleep + drain
    needed = int(pre_stop[1]) + float(env[ENV_DRAIN_TIMEOUT]) + float(env[ENV_DRAIN_DELAY])
    assert needed < pod["terminationGracePeriodSeconds"] <= needed + 30
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    strategy = deployment["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0 and strategy["maxSurge"] >= 1


def test_object_storage_variant_syncs_into_the_model_volume():
    pod = _by_kind(_documents("kiln-object-storage.yaml"))["Deployment"]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"][:3] == ["aws", "s3", "sync"] and init["command"][-1] == "/models"
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    assert "emptyDir" in models
    assert "initContainers" not in _by_kind(_documents("kiln.yaml"))["Deployment"]["spec"]["template"]["spec"]


def test_autoscaler_metrics_come_from_the_adapter_rules_over_real_counters():
    hpa = _by_kind(_documents("kiln.yaml"))["HorizontalPodAutoscaler"]
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert wanted == {"kiln_queue_time_us", "kiln_queue_size"}
    adapter = yaml.safe_load((ROOT / "deploy" / "prometheus-adapter-values.yaml").read_text())
    rules = adapter["rules"]["custom"]
    assert {r["name"]["as"] for r in rules} == wanted
    for rule in rules:
        used = set(re.findall(r"\bnv_[a-z_]+", rule["metricsQuery"] + rule["seriesQuery"]))
        assert used <= set(_COUNTERS), used - set(_COUNTERS)  # metrics the server really exports


def test_renderer_subset():
    r = render.Renderer({"a": {"on": True, "off": False, "n": 3, "items": [{"k": "v"}], "s": "x y"}},
                        {"name": "c", "version": "1", "appVersion": "2"})
    r.load_helpers('{{- define "lbl" -}}\nname: {{ .Chart.Name }}\n{{- end }}')
    text = ("x:\n  {{- include \"lbl\" . | nindent 2 }}\n{{- if .Values.a.off }}\nno\n{{- else }}\n"
            "y: {{ .Values.a.s | quote }}\n{{- end }}\nz: {{ add .Values.a.n 4 }}\nl:\n  {{- toYaml .Values.a.items"
            " | nindent 2 }}\nw: {{ not .Values.a.on }} {{ eq .Values.a.s \"x y\" }}\n")
    assert r.render(text) == 'x:\n  name: c\ny: "x y"\nz: 7\nl:\n  - k: v\nw: false true\n'
    for unsupported in ("{{ range .Values.a.items }}{{ end }}", "{{ .Values.a.n | upper }}", "{{ if .Values.a.on }}"):
        with pytest.raises(render.TemplateError):
            r.render(unsupported)
