"""Lint and render a Helm chart with the real Helm library (helm-sdkpy), without a cluster.

Runs only in the Python 3.12 virtualenv `.helm-venv` (tests/test_deploy.py sets it up):

    .helm-venv/bin/python tests/helm_lint.py charts/baton -f charts/examples/gpu-2p4d.yaml
    .helm-venv/bin/python tests/helm_lint.py charts/baton --case default= --case gpu=charts/examples/gpu-2p4d.yaml --json

Each case is the chart's own values with one values file laid over them, as `helm lint -f`
and `helm install -f` do. For every case it reports:
- lint: Helm's linter (chart metadata, templates render, rendered YAML parses, values
  validate against values.schema.json) over a copy of the chart whose values.yaml is the
  merged values. helm-sdkpy's lint result drops the error text, so a failing lint is
  explained by the render below, which carries Helm's own message.
- render: `helm install` against a stand-in Kubernetes API server on 127.0.0.1 that only
  answers discovery and accepts creates, with release storage in memory: what `helm template`
  would print (the manifest and NOTES.txt), after Helm's values-schema check and its mapping of
  every kind onto a served API group/version.

Exit status 0 when every case lints without warnings or errors and renders; 1 otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

# Helm reads these from the environment the process started with (the Go runtime copies it
# when the library loads; later os.environ changes are not seen): release records in memory,
# and its cache/config/data folders in a scratch directory, never in the user's home.
if os.environ.get("HELM_DRIVER") != "memory" and __name__ == "__main__":
    _scratch = tempfile.mkdtemp(prefix="helm-lint-")
    _env = dict(os.environ, HELM_DRIVER="memory", BATON_HELM_SCRATCH=_scratch)
    for _name in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        _env[_name] = os.path.join(_scratch, _name.lower())
    os.execve(sys.executable, [sys.executable, *sys.argv], _env)

import helm_sdkpy  # noqa: E402  (after the environment above)

KUBE_VERSION = {"major": "1", "minor": "31", "gitVersion": "v1.31.0", "platform": "linux/amd64"}
# (group, version) -> [(kind, plural)]: the API the stand-in server serves. A chart kind that
# is not here fails to render, as it would on a real cluster without that API.
API = {
    ("", "v1"): [("ConfigMap", "configmaps"), ("Secret", "secrets"), ("Service", "services"),
                 ("ServiceAccount", "serviceaccounts"), ("PersistentVolumeClaim", "persistentvolumeclaims"),
                 ("Pod", "pods"), ("Namespace", "namespaces")],
    ("apps", "v1"): [("Deployment", "deployments"), ("StatefulSet", "statefulsets")],
    ("rbac.authorization.k8s.io", "v1"): [("Role", "roles"), ("RoleBinding", "rolebindings")],
    ("policy", "v1"): [("PodDisruptionBudget", "poddisruptionbudgets")],
    ("autoscaling", "v2"): [("HorizontalPodAutoscaler", "horizontalpodautoscalers")],
    ("discovery.k8s.io", "v1"): [("EndpointSlice", "endpointslices")],
    ("networking.k8s.io", "v1"): [("NetworkPolicy", "networkpolicies")],
    # The Prometheus Operator's CRDs, as on a cluster where it is installed.
    ("monitoring.coreos.com", "v1"): [("ServiceMonitor", "servicemonitors"), ("PodMonitor", "podmonitors")],
    # KEDA's, as on a cluster that runs it.
    ("keda.sh", "v1alpha1"): [("ScaledObject", "scaledobjects")],
}
SEVERITY = {0: "UNKNOWN", 1: "INFO", 2: "WARNING", 3: "ERROR"}


class _FakeApiServer(BaseHTTPRequestHandler):
    """Discovery documents, 404 for every object (nothing exists yet), and 201 for creates."""

    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/version":
            return self._send(200, KUBE_VERSION)
        if path == "/api":
            return self._send(200, {"kind": "APIVersions", "versions": ["v1"]})
        if path == "/apis":
            groups = {}
            for group, version in API:
                if group:
                    groups.setdefault(group, []).append({"groupVersion": f"{group}/{version}", "version": version})
            return self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": g, "versions": vs, "preferredVersion": vs[0]} for g, vs in groups.items()]})
        for (group, version), kinds in API.items():
            if path == (f"/apis/{group}/{version}" if group else f"/api/{version}"):
                return self._send(200, {
                    "kind": "APIResourceList", "groupVersion": f"{group}/{version}" if group else version,
                    "resources": [{"name": plural, "singularName": kind.lower(), "kind": kind,
                                   "namespaced": kind != "Namespace",
                                   "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]}
                                  for kind, plural in kinds]})
        return self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                "reason": "NotFound", "code": 404})

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(201)
        self.send_header("Content-Type", self.headers.get("Content-Type", "application/json"))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)  # created as sent


def merge_values(base: dict, override: dict) -> dict:
    """Helm's coalescing of a values file over the chart's: maps merge, null deletes a key."""
    out = dict(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_values(out[key], value)
        else:
            out[key] = value
    return out


def load_values(path: str | None) -> dict:
    if not path:
        return {}
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: a values file must be a mapping")
    return data


async def lint_case(chart: Path, override: dict, workdir: Path) -> dict:
    copy = workdir / chart.name
    shutil.copytree(chart, copy)
    merged = merge_values(yaml.safe_load((chart / "values.yaml").read_text()) or {}, override)
    (copy / "values.yaml").write_text(yaml.safe_dump(merged, sort_keys=False))
    result = await helm_sdkpy.Lint(helm_sdkpy.Configuration(namespace="lint")).run(str(copy))
    messages = [{"severity": SEVERITY.get(m.get("Severity"), str(m.get("Severity"))), "path": m.get("Path", "")}
                for m in result.get("Messages") or []]
    return {"messages": messages, "errors": len(result.get("Errors") or []),
            "ok": not result.get("Errors") and all(m["severity"] == "INFO" for m in messages)}


async def render_case(chart: Path, values: dict, kubeconfig: str, release: str, namespace: str) -> dict:
    config = helm_sdkpy.Configuration(namespace=namespace, kubeconfig=kubeconfig)
    try:
        result = await helm_sdkpy.Install(config).run(release, str(chart), values=values, wait=False)
    except helm_sdkpy.HelmError as exc:
        return {"ok": False, "error": str(exc), "manifest": "", "notes": ""}
    return {"ok": True, "error": "", "manifest": result.get("manifest", ""),
            "notes": (result.get("info") or {}).get("notes", "")}


def start_server() -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeApiServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    kubeconfig = yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "stand-in",
        "clusters": [{"name": "stand-in", "cluster": {"server": url}}],
        "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "stand-in"}}],
        "users": [{"name": "stand-in", "user": {}}]})
    return server, kubeconfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chart", type=Path)
    parser.add_argument("-f", "--values", action="append", default=[], help="a values file (one case each)")
    parser.add_argument("--case", action="append", default=[], metavar="NAME=FILE",
                        help="a named case; FILE may be empty for the chart's own values")
    parser.add_argument("--release", default="baton")
    parser.add_argument("--namespace", default="baton")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every case")
    parser.add_argument("--show-manifest", action="store_true")
    args = parser.parse_args(argv)

    cases = [(path, path) for path in args.values]
    for spec in args.case:
        name, _, path = spec.partition("=")
        cases.append((name, path))
    if not cases:
        cases = [("default", "")]

    server, kubeconfig = start_server()

    async def check(path: str, workdir: Path) -> dict:
        override = load_values(path)
        workdir.mkdir()
        lint, render = await asyncio.gather(lint_case(args.chart, override, workdir),
                                            render_case(args.chart, override, kubeconfig, args.release, args.namespace))
        return {"values_file": path, "lint": lint, "render": render}

    async def check_all(workdir: Path) -> dict:
        # Every case at once, in one event loop: Helm's calls run on threads, and a loop per call
        # waited about 0.4 s for them to wind down (half of a case's time, the CPU idle).
        checked = await asyncio.gather(*(check(path, workdir / str(i)) for i, (_, path) in enumerate(cases)))
        return dict(zip((name for name, _ in cases), checked))

    with tempfile.TemporaryDirectory(prefix="helm-lint-chart-") as workdir:
        report = asyncio.run(check_all(Path(workdir)))
    server.shutdown()
    if os.environ.get("BATON_HELM_SCRATCH"):
        shutil.rmtree(os.environ["BATON_HELM_SCRATCH"], ignore_errors=True)

    ok = all(case["lint"]["ok"] and case["render"]["ok"] for case in report.values())
    if args.json:
        print(json.dumps(report))
    else:
        for name, case in report.items():
            lint, render = case["lint"], case["render"]
            status = "ok" if lint["ok"] and render["ok"] else "FAILED"
            print(f"{name}: {status}")
            for message in lint["messages"]:
                print(f"  lint {message['severity']}: {message['path']}")
            if not render["ok"]:
                print(f"  render error: {render['error']}")
            elif args.show_manifest:
                print(render["manifest"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
