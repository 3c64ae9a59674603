"""The Helm chart, rendered by Helm's own engine, and the plain Kubernetes manifests: every object is
checked against the Kubernetes JSON schemas offline (kubernetes-validate), and what the objects mean
is checked too (probes, securityContext, Secret references, config the daemon accepts)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from watchdog.config.settings import load_config
from watchdog.policy.loader import parse_policy_text

try:  # the dev extra; CI installs it, so there a missing one is a failure
    import helm_python as helm
    import kubernetes_validate as kv
except ImportError:
    if os.environ.get("CI"):
        raise
    pytest.skip("dev extra not installed: helm-python-sdk, kubernetes-validate", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy/helm/llm-watchdog"
K8S = ROOT / "deploy/kubernetes"
KUBE_VERSIONS = ("1.25.0", "1.37.0")  # the chart's kubeVersion floor and the newest schemas
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}  # Prometheus Operator: no schema in kubernetes-validate
PLAIN_ENV = {"HOME", "XDG_CACHE_HOME"}  # the only variables the watchdog may get as plain values


def render(values: dict[str, Any] | Path | None = None, chart: Path = CHART) -> list[dict[str, Any]]:
    if isinstance(values, Path):
        values = yaml.safe_load(values.read_text())
    helm.disable_logging()  # the Go library's notes about symlinked files
    with helm.Chart.load(str(chart)) as c:
        out = c.render(values or {}, name="wd", namespace="ml")
    docs = [d for path, text in sorted(out.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]
    assert docs, "the chart rendered nothing"
    return docs


def validate_all(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["spec"]
            continue
        for version in KUBE_VERSIONS:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} (k8s {version}): {exc}") from exc


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def watchdog_container(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] == "llm-watchdog")


def check_pod(docs: list[dict[str, Any]], deployment: dict[str, Any], *, standalone: bool,
              secrets: dict[str, set[str]] | None = None) -> dict[str, Any]:
    """The watchdog container's probes, securityContext, volumes and env; returns the container."""
    pod = deployment["spec"]["template"]
    wd = watchdog_container(pod)
    assert wd["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert wd["startupProbe"]["httpGet"]["path"] == "/livez"
    if standalone:
        assert wd["readinessProbe"]["httpGet"]["path"] == "/readyz"
    else:
        assert "readinessProbe" not in wd, "a sidecar readiness probe would gate the serving pod"
    sc = wd["securityContext"]
    assert sc["runAsNonRoot"] and sc["runAsUser"] > 0 and sc["readOnlyRootFilesystem"]
    assert not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in wd["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/var/lib/llm-watchdog"]["name"]], "no writable state directory"
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    assert all(m.get("readOnly") for p, m in mounts.items() if p.startswith("/etc/"))
    config_maps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    for v in volumes.values():
        if "configMap" in v and v["configMap"]["name"] != "llama-fp8-policies":  # external by design
            assert v["configMap"]["name"] in config_maps, f"volume {v['name']} mounts a ConfigMap defined nowhere"
    for env in wd["env"]:
        if "value" in env:
            assert env["name"] in PLAIN_ENV, f"{env['name']} is a plain value; secrets come from secretKeyRef"
        ref = env.get("valueFrom", {}).get("secretKeyRef")
        if ref and secrets is not None:
            assert ref["key"] in secrets.get(ref["name"], set()), f"{env['name']}: no key {ref['key']} in {ref['name']}"
    return wd


def check_service(docs: list[dict[str, Any]], deployment: dict[str, Any]) -> dict[str, Any]:
    svc = next(d for d in docs if d["kind"] == "Service")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items(), "the Service selects no watchdog pod"
    port_names = {p["name"] for p in watchdog_container(deployment["spec"]["template"])["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    return svc


def check_config(docs: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 env_names: list[str]) -> Any:
    """The rendered config.yaml loads as the daemon loads it; the policies parse without errors."""
    for name in env_names:  # the Secret-provided variables, as the kubelet would set them
        monkeypatch.setenv(name, "secret-from-test" if name != "LLMWD_REDIS__URL" else "rediss://:pw@redis:6380/0")
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "config.yaml" in d["data"])
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    config = load_config(path)
    for d in docs:
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-policies"):
            for fname, text in d["data"].items():
                assert parse_policy_text(text, fname)[1] == [], fname
    return config


def test_standalone_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render()
    validate_all(docs)
    assert {d["kind"] for d in docs} == {"ConfigMap", "Deployment", "Service"}
    dep = one(docs, "Deployment")
    wd = check_pod(docs, dep, standalone=True)
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert wd["resources"]["limits"] == {"cpu": "1", "memory": "768Mi"} and "nvidia.com/gpu" not in wd["resources"]["limits"]
    check_service(docs, dep)
    config = check_config(docs, tmp_path, monkeypatch, [])
    assert config.server.host == "0.0.0.0" and config.server.port == 9464
    assert config.policies == ["/etc/llm-watchdog/policies"]
    policies = one(docs, "ConfigMap", "wd-llm-watchdog-policies")
    assert policies["data"]["default.yaml"] == (ROOT / "policies/default.yaml").read_text()


def test_standalone_production(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values_file = CHART / "ci/standalone-production-values.yaml"
    values = yaml.safe_load(values_file.read_text())
    docs = render(values_file)
    validate_all(docs)
    dep = one(docs, "Deployment")
    example_secret = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    wd = check_pod(docs, dep, standalone=True,
                   secrets={"llm-watchdog-secrets": set(example_secret["stringData"])})
    # the in-process engine's resources, with its GPU
    assert wd["resources"]["limits"] == {"cpu": "4", "memory": "12Gi", "nvidia.com/gpu": 1}
    secret_env = {e["name"] for e in wd["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert secret_env == {e["name"] for e in values["secretEnv"]}
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["kafka-tls"]["secret"]["secretName"] == "llm-watchdog-kafka-tls"
    config = check_config(docs, tmp_path, monkeypatch, sorted(secret_env))
    assert config.kafka.security["sasl_plain_password"] == "secret-from-test"  # env beat nothing in the file
    assert config.kafka.security["ssl_cafile"].startswith("/etc/llm-watchdog/kafka-tls/")
    assert "CHANGE-ME" not in json.dumps(docs) and "secret-from-test" not in json.dumps(docs)
    assert set(one(docs, "ConfigMap", "wd-llm-watchdog-policies")["data"]) == {
        "default.yaml", "strict-legal-medical.yaml", "chat-strict.yaml"}

    svc = check_service(docs, dep)
    sm = one(docs, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"

    dash = one(docs, "ConfigMap", "wd-llm-watchdog-dashboard")
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dash["metadata"]["annotations"]["grafana_folder"] == "LLM serving"
    assert json.loads(dash["data"]["llm-watchdog.json"]) == json.loads((ROOT / "deploy/grafana/llm-watchdog.json").read_text())

    rule = one(docs, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((ROOT / "deploy/prometheus/llm-watchdog-rules.yaml").read_text())
    if shutil.which("promtool"):
        (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
        check = subprocess.run(["promtool", "check", "rules", str(tmp_path / "rules.yaml")],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr


def test_sidecar_renders_the_serving_pod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values_file = CHART / "ci/sidecar-values.yaml"
    values = yaml.safe_load(values_file.read_text())
    docs = render(values_file)
    validate_all(docs)
    dep = one(docs, "Deployment", "llama-fp8")
    pod = dep["spec"]["template"]
    server = next(c for c in pod["spec"]["containers"] if c["name"] == "server")
    assert server == values["serving"]["containers"][0], "the serving container must stay as given"
    check_pod(docs, dep, standalone=False)
    assert pod["spec"]["securityContext"] == {"fsGroup": 1000}  # the serving pod's, not the watchdog's
    svc = check_service(docs, dep)
    assert svc["spec"]["publishNotReadyAddresses"] is True
    check_config(docs, tmp_path, monkeypatch, [])


def test_sidecar_include_into_a_parent_chart(tmp_path: Path) -> None:
    """serving.enabled false: a parent chart adds the watchdog container to a pod of its own."""
    parent = tmp_path / "serving"
    (parent / "templates").mkdir(parents=True)
    (parent / "charts").mkdir()
    shutil.copytree(CHART, parent / "charts/llm-watchdog", symlinks=False)
    (parent / "Chart.yaml").write_text("apiVersion: v2\nname: serving\nversion: 1.0.0\n"
                                       "dependencies: [{name: llm-watchdog, version: 0.1.0}]\n")
    values = yaml.safe_load((CHART / "ci/sidecar-include-values.yaml").read_text())
    (parent / "values.yaml").write_text(yaml.safe_dump({"llm-watchdog": values}))
    (parent / "templates/deployment.yaml").write_text(
        "{{- $wd := dict \"Values\" (index .Values \"llm-watchdog\") \"Release\" .Release"
        " \"Chart\" (dict \"Name\" \"llm-watchdog\" \"AppVersion\" \"0.1.0\" \"Version\" \"0.1.0\") }}\n"
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: llama-fp8}\nspec:\n"
        "  selector: {matchLabels: {app: llama-fp8}}\n  template:\n    metadata: {labels: {app: llama-fp8}}\n"
        "    spec:\n      containers:\n        - {name: server, image: my-server:1.0}\n"
        "        {{- include \"llm-watchdog.container\" $wd | nindent 8 }}\n"
        "      volumes:\n        {{- include \"llm-watchdog.volumes\" $wd | nindent 8 }}\n")
    docs = render({}, chart=parent)
    validate_all(docs)
    dep = one(docs, "Deployment", "llama-fp8")
    check_pod(docs, dep, standalone=False)
    assert not [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-policies")]
    svc = check_service(docs, dep)
    assert svc["spec"]["selector"] == {"app": "llama-fp8"}


@pytest.mark.parametrize(("values", "message"), [
    ({"mode": "sidcar"}, "at '/mode': value must be one of 'standalone', 'sidecar'"),  # values.schema.json
    ({"serviceMonitr": {"enabled": True}}, "additional properties 'serviceMonitr' not allowed"),
    ({"secretEnv": [{"name": "PAGERDUTY_ROUTING_KEY", "secret": "s"}]}, "at '/secretEnv/0': missing property 'key'"),
    ({"mode": "sidecar"}, "serving.containers"),  # the templates' own checks
    ({"mode": "sidecar", "serving": {"enabled": False}}, "serving.podLabels"),
    ({"policies": {"shipped": False}}, "no policy files"),
])
def test_bad_values_fail_with_a_message(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(values)


def test_chart_passes_helm_lint() -> None:
    for values in (None, CHART / "ci/standalone-production-values.yaml", CHART / "ci/sidecar-values.yaml"):
        report = helm.lint(str(CHART), yaml.safe_load(values.read_text()) if values else {}, strict=True,
                           kube_version="v1.30.0")
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert not problems, problems


def test_plain_manifests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = [d for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    validate_all(docs)
    secret = one(docs, "Secret", "llm-watchdog-secrets")
    dep = one(docs, "Deployment", "llama-fp8")
    check_pod(docs, dep, standalone=False, secrets={"llm-watchdog-secrets": set(secret["stringData"])})
    server = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "server")
    assert server["readinessProbe"]["httpGet"]["path"] == "/health"  # the server's own readiness only
    check_service(docs, dep)
    wd_env = [e["name"] for e in watchdog_container(dep["spec"]["template"])["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    config = check_config(docs, tmp_path, monkeypatch, wd_env)
    assert config.redis.url == "rediss://:pw@redis:6380/0"  # the Secret's value wins over the file's
    assert [c.kind for c in config.alerts.channels] == ["pagerduty", "slack"]
    assert config.server.status_url == "https://llm-watchdog.example.com/status"  # not the pod's 127.0.0.1


def test_packaged_chart_carries_the_linked_files(tmp_path: Path) -> None:
    """files/ holds symlinks (one copy of the rules, dashboard and policies): `helm package` must
    store their contents, and the archive must render what the directory renders."""
    archive = helm.package(str(CHART), destination=str(tmp_path))
    values = yaml.safe_load((CHART / "ci/standalone-production-values.yaml").read_text())
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        assert "llm-watchdog/files/llm-watchdog-rules.yaml" in names and not any("/ci/" in n for n in names)
        assert all(tar.getmember(n).isfile() for n in names if "/files/" in n), "a symlink was packaged"
    with helm.Chart.load_archive(Path(archive).read_bytes()) as packed, helm.Chart.load(str(CHART)) as source:
        assert packed.render(values, name="wd", namespace="ml") == source.render(values, name="wd", namespace="ml")


def _notes(values: dict[str, Any]) -> str:
    helm.disable_logging()
    with helm.Chart.load(str(CHART)) as c:
        out = c.render(values, name="wd", namespace="ml")
    return next((text for path, text in out.items() if path.endswith("NOTES.txt")), "")


@pytest.mark.parametrize("mode", ["standalone", "sidecar"])
def test_config_server_port_moves_the_container_port_and_every_probe(mode: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    values: dict[str, Any] = {"mode": mode, "config": {"server": {"port": 8080}}}
    if mode == "sidecar":
        values["serving"] = {"containers": [{"name": "server", "image": "vllm/vllm-openai:v0.6.0"}]}
    docs = render(values)
    validate_all(docs)
    dep = next(d for d in docs if d["kind"] == "Deployment")
    wd = check_pod(docs, dep, standalone=mode == "standalone")
    ports = {p["name"]: p["containerPort"] for p in wd["ports"]}
    assert ports == {"wd-metrics": 8080}
    probes = [wd[k] for k in ("startupProbe", "livenessProbe", "readinessProbe") if k in wd]
    assert probes and all(ports.get(p["httpGet"]["port"], p["httpGet"]["port"]) == 8080 for p in probes)
    svc = check_service(docs, dep)
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(9464, "wd-metrics")]
    assert check_config(docs, tmp_path, monkeypatch, []).server.port == 8080
    assert "9464" not in json.dumps(wd)


def test_service_port_alone_still_sets_the_daemon_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render({"service": {"port": 9100}})
    wd = watchdog_container(one(docs, "Deployment")["spec"]["template"])
    assert wd["ports"] == [{"name": "wd-metrics", "containerPort": 9100, "protocol": "TCP"}]
    assert check_config(docs, tmp_path, monkeypatch, []).server.port == 9100


def test_production_values_link_alerts_to_an_external_url_placeholder(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    values_file = CHART / "ci/standalone-production-values.yaml"
    docs = render(values_file)
    secret_env = [e["name"] for e in yaml.safe_load(values_file.read_text())["secretEnv"]]
    config = check_config(docs, tmp_path, monkeypatch, secret_env)
    assert config.alerts.channels and config.server.external_url
    assert config.server.status_url == "https://llm-watchdog.example.com/status"
    assert "127.0.0.1" not in config.server.status_url and "localhost" not in config.server.status_url
    assert "PLACEHOLDER" in values_file.read_text().split("external_url:")[0].rsplit("server:", 1)[1]
    assert "external_url" not in _notes(yaml.safe_load(values_file.read_text()))
    # without it, the install notes say where the links would point
    assert "config.server.external_url is not" in _notes(
        {"config": {"alerts": {"channels": [{"kind": "slack", "url": "https://hooks.example.com/x"}]}}})
