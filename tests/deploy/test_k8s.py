"""deploy/k8s (kustomize) checked against the compose file it mirrors: the same kimi-pd command
lines (parsed by the real CLI; only the per-pod address and id differ), the same secrets from one
Secret, the same probes, the load balancer's nginx.conf in step with deploy/lb's. Rendered with
`kubectl kustomize` where kubectl is installed (skipped with the reason otherwise); without it the
base files are read as written."""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from kimi_pd.planner.signal import DESIRED_METRIC
from tests.deploy.helpers import DEPLOY, NGINX_CONF, environment_of, parse_cli, run
from tests.deploy.test_deploy_configs import SECRET_VARS, kimi_pd_services, load_compose, service_argv

K8S = DEPLOY / "k8s"
OVERLAY = K8S / "overlays" / "example"
PER_POD = {"advertise_url", "kv_host", "worker_id", "func"}   # each pod's own (downward API); func: a closure
ROLES = ("prefill", "decode", "router")


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed (Debian: no package; https://kubernetes.io/docs/tasks/tools/)")
    return path


def render(target: Path) -> list[dict]:
    out = run([kubectl(), "kustomize", str(target)])
    assert out.returncode == 0, out.stderr.decode()
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def raw_base() -> list[dict]:
    return [doc for path in sorted((K8S / "base").glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render(OVERLAY) if shutil.which("kubectl") else raw_base()


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container(objects: list[dict], name: str, deployment: str | None = None) -> dict:
    spec = by_kind(objects, "Deployment")[deployment or name]["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] if c["name"] == name)


def pod_argv(c: dict) -> list[str]:
    """The container's kimi-pd command line with the downward-API variables filled as a pod would."""
    values = {"POD_IP": "10.0.0.7", "POD_NAME": "pod-0"}
    return ["kimi-pd", *(re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in c["args"])]


@pytest.fixture(scope="module")
def compose() -> dict[str, dict]:
    return load_compose()["services"]


@pytest.mark.parametrize("role", ROLES)
def test_same_flags_as_compose(objects, compose, role):
    k8s = vars(parse_cli(pod_argv(container(objects, role))))
    name = "router-1" if role == "router" else role
    ours = vars(parse_cli(service_argv(kimi_pd_services(compose)[name])))
    assert {k: v for k, v in k8s.items() if k not in PER_POD} == {k: v for k, v in ours.items() if k not in PER_POD}
    if role != "router":
        assert urlparse(k8s["advertise_url"]).hostname == k8s["kv_host"] == "10.0.0.7", "the pod's own address"
        assert k8s["worker_id"] == "pod-0", "registered under the pod name: unique per replica"
        env = {e["name"]: e for e in container(objects, role)["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


@pytest.mark.parametrize("role", ROLES)
def test_same_secrets_from_one_secret_and_none_inline(objects, compose, role):
    env = {e["name"]: e for e in container(objects, role)["env"]}
    name = "router-1" if role == "router" else role
    wanted = set(environment_of(compose[name])) - {"KIMI_PD_HEALTH_URL"}
    assert wanted <= set(env), f"{role}: missing {wanted - set(env)}"
    for var in wanted:
        ref = env[var]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "kimi-pd-secrets" and ref["key"] == var
    assert not any(e.get("value") for e in env.values() if e["name"] in SECRET_VARS), "a secret value inline"


@pytest.mark.parametrize("role", ROLES)
def test_same_probes_and_grace_as_compose(objects, compose, role):
    c = container(objects, role)
    name = "router-1" if role == "router" else role
    probe = urlparse(environment_of(compose[name])["KIMI_PD_HEALTH_URL"])
    ready = c["readinessProbe"]["httpGet"]
    assert (ready["path"], ready["port"]) == (probe.path, probe.port)
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": probe.port}, "live != ready: no restart loop"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 120, "compose start_period"
    spec = by_kind(objects, "Deployment")[role]["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] >= int(compose[name]["stop_grace_period"].rstrip("s"))
    models = next(m for m in c["volumeMounts"] if m["mountPath"] == "/models")
    assert models["readOnly"] is True


@pytest.mark.parametrize("role", ROLES)
def test_the_checkpoint_is_the_one_compose_writes(objects, compose, role):
    spec = by_kind(objects, "Deployment")[role]["spec"]["template"]["spec"]
    init = next(c for c in spec["initContainers"] if c["name"] == "checkpoint")
    ours = vars(parse_cli(service_argv(compose["checkpoint"])))
    assert vars(parse_cli(["kimi-pd", *init["args"]])) == ours
    assert vars(parse_cli(pod_argv(container(objects, role))))["model"] == ours["out"]


def test_store_lb_and_services(objects, compose):
    store = container(objects, "valkey")
    assert store["image"] == compose["valkey"]["image"] and store["args"] == compose["valkey"]["command"]
    services = by_kind(objects, "Service")
    assert {"valkey", "router", "lb"} <= set(services)
    assert "prefill" not in services and "decode" not in services, "workers are found through the store"
    assert all(s["spec"].get("type", "ClusterIP") == "ClusterIP" for s in services.values())
    redis = urlparse(vars(parse_cli(pod_argv(container(objects, "router"))))["redis_url"])
    assert (redis.hostname, redis.port) == ("valkey", services["valkey"]["spec"]["ports"][0]["port"])
    lb = container(objects, "nginx", "lb")
    assert lb["image"] == compose["lb"]["image"]
    mounts = {m["mountPath"] for m in lb["volumeMounts"]}
    assert {"/etc/nginx/nginx.conf", "/etc/nginx/kimi-pd-routers.conf"} <= mounts


def test_nginx_conf_is_deploy_lbs_with_the_cluster_resolver():
    ours, theirs = (K8S / "base" / "nginx.conf").read_text().splitlines(), NGINX_CONF.read_text().splitlines()
    assert len(ours) == len(theirs)
    changed = [(a, b) for a, b in zip(ours, theirs, strict=True) if a != b]
    assert [a.split()[0] for a, _ in changed] == ["#", "resolver"], changed
    routers = (K8S / "base" / "kimi-pd-routers.conf").read_text()
    assert re.findall(r"^server\s+(\S+)\s", routers, re.MULTILINE) == ["router:8000"]


def test_autoscalers_read_the_planner_signal(objects):
    hpas = by_kind(objects, "HorizontalPodAutoscaler") if shutil.which("kubectl") else {
        d["metadata"]["name"]: d for d in yaml.safe_load_all((K8S / "components/autoscale/hpa.yaml").read_text())}
    assert set(hpas) == {"prefill", "decode"}
    for pool, hpa in hpas.items():
        assert hpa["spec"]["scaleTargetRef"]["name"] == pool
        metric = hpa["spec"]["metrics"][0]["external"]
        assert metric["metric"]["name"] == DESIRED_METRIC
        assert metric["metric"]["selector"]["matchLabels"] == {"pool": pool}
        assert metric["target"] == {"type": "AverageValue", "averageValue": "1"}, "replicas = desired count"
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60, "scale-in is damped"


def test_rendered_overlay_is_complete_and_namespaced():
    objects = render(OVERLAY)
    assert all(o["metadata"].get("namespace") == "kimi-pd" for o in objects if o["kind"] != "Namespace")
    secret = by_kind(objects, "Secret")["kimi-pd-secrets"]
    assert set(secret["data"]) >= {"KIMI_PD_TRANSFER_SECRET", "KIMI_PD_ADMIN_TOKEN"}
    lb = by_kind(objects, "Deployment")["lb"]["spec"]["template"]["spec"]
    assert lb["volumes"][0]["configMap"]["name"] in by_kind(objects, "ConfigMap"), "generated name followed"
    for name, dep in by_kind(objects, "Deployment").items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    assert ref["name"] == "kimi-pd-secrets" and ref["key"] in secret["data"], (name, e["name"])
