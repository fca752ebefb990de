"""The deploy files: they parse, their psserver command lines are accepted by the real CLI,
and the ports and names they share agree across files."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from psserver.cli import VERBS
from tests.deploy.commands import (
    DEPLOY,
    ROOT,
    Command,
    all_commands,
    argv_of,
    commands_in_shell,
    load_yaml,
    option,
    parse,
)

K8S = DEPLOY / "kubernetes"
SCRIPTS = sorted((DEPLOY / "slurm").glob("*.sbatch")) + sorted(DEPLOY.rglob("*.sh"))
COMMANDS = all_commands()


def _docs(path: Path) -> list[dict]:
    return load_yaml(path)


def _k8s(kind: str, name: str | None = None) -> dict:
    for path in sorted((K8S / "base").glob("*.yaml")):
        for doc in _docs(path):
            if doc.get("kind") == kind and (name is None or doc["metadata"]["name"] == name):
                return doc
    raise AssertionError(f"no {kind} {name or ''} in {K8S / 'base'}")


def _k8s_all(kind: str) -> list[dict]:
    return [d for p in sorted((K8S / "base").glob("*.yaml")) for d in _docs(p) if d.get("kind") == kind]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _port(container: dict, name: str) -> int:
    for p in container["ports"]:
        if p["name"] == name:
            return p["containerPort"]
    raise AssertionError(f"container {container['name']} has no port {name}")


# ---- every file parses, every command line is accepted ----------------------------------


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_yaml_parses(path):
    docs = load_yaml(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert isinstance(doc, dict)


def test_commands_found_everywhere():
    sources = {c.source.split(":")[0].split("@")[0] for c in COMMANDS}
    for expected in ("deploy/docker/compose.yaml", "deploy/kubernetes/base/server-statefulset.yaml",
                     "deploy/kubernetes/base/trainers-job.yaml", "deploy/kubernetes/collective/pytorchjob.yaml",
                     "deploy/slurm/ps.sbatch", "deploy/slurm/ddp.sbatch", "deploy/slurm/fsdp.sbatch",
                     "deploy/slurm/fsdp-tp.sbatch", "deploy/README.md", "deploy/wireguard/make-mesh.sh",
                     "deploy/wireguard/README.md", "README.md"):
        assert expected in sources, f"no psserver command line found in {expected}"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.source)
def test_command_line_accepted_by_the_cli(command: Command):
    args = parse(command.argv)
    assert args.command in {verb.name for verb in VERBS}


def test_extraction_handles_wrappers_and_variables():
    text = (
        'PORT=${PSSERVER_PORT:-29511}\n'
        '# psserver serve --not-a-flag   (a comment)\n'
        'srun --nodes=1 --ntasks=1 \\\n'
        '    psserver serve --host "$HOST" --port "$PORT" &\n'
        'kubectl -n psserver get pods\n'
        'torchrun --nnodes="$N" -m psserver train --mode ddp | tee log\n'
    )
    cmds = commands_in_shell(text, "t")
    assert [c.argv for c in cmds] == [
        ["serve", "--host", "1", "--port", "29511"],
        ["train", "--mode", "ddp"],
    ]
    with pytest.raises(AssertionError, match="rejected"):
        parse(["serve", "--no-such-flag"])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_pass_bash_n(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert script.read_text().startswith("#!/bin/bash")
    assert os.access(script, os.X_OK), f"{script} is not executable"


def test_healthcheck_script_compiles():
    path = DEPLOY / "docker" / "healthcheck.py"
    compile(path.read_text(), str(path), "exec")  # no __pycache__ left in deploy/


# ---- Docker ------------------------------------------------------------------------------


def _dockerfile() -> str:
    return (DEPLOY / "docker" / "Dockerfile").read_text()


def _torch_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [d.split("==", 1)[1].strip() for d in deps if re.match(r"^torch\s*==", d)]
    assert len(pins) == 1, deps
    return pins[0]


def test_dockerfile_base_image_names_the_pinned_torch():
    text = _dockerfile()
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.M))
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert len(froms) == 1
    image = re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], froms[0])
    m = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime", image)
    assert m, f"base image {image} is not an official pytorch/pytorch runtime tag"
    assert m.group(1) == _torch_pin(), f"base image has torch {m.group(1)}, pyproject pins {_torch_pin()}"


def test_dockerfile_user_entrypoint_healthcheck():
    text = _dockerfile()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0"), "the image must run as a non-root user"
    assert re.search(r'^ENTRYPOINT\s+\["psserver"\]', text, re.M)
    assert re.search(r"^RUN\s+python -m pip install /opt/psserver-src", text, re.M)
    hc = re.search(r"^HEALTHCHECK\s.*?CMD\s+(.*)$", text, re.M | re.S)
    assert hc and "psserver-healthcheck" in hc.group(1)
    assert "COPY deploy/docker/healthcheck.py /usr/local/bin/psserver-healthcheck" in text
    exposed = {int(p) for line in re.findall(r"^EXPOSE\s+(.*)$", text, re.M) for p in line.split()}
    compose = _compose()
    server = _argv(compose["services"]["server"])
    assert {int(option(server, "--port")), int(option(server, "--control-port")),
            int(option(server, "--metrics-port"))} <= exposed
    # the health check's default address is the control plane's default port
    health = (DEPLOY / "docker" / "healthcheck.py").read_text()
    assert f'"127.0.0.1:{option(server, "--control-port")}"' in health


def test_dockerignore_keeps_what_pip_needs():
    ignored = (DEPLOY / "docker" / "Dockerfile.dockerignore").read_text().split()
    for needed in ("psserver", "pyproject.toml", "README.md", "deploy", "protos"):
        assert needed not in ignored


def test_healthcheck_script_against_a_grpc_health_server():
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    script = str(DEPLOY / "docker" / "healthcheck.py")

    def check(address: str, *args: str, **extra: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
        env.update({"PSSERVER_HEALTH_ADDRESS": address, "HOSTNAME": "psserver", **extra})
        return subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=30)

    follower = {"PSSERVER_NUM_SERVERS": "2", "PSSERVER_SERVER_RANK": "1"}
    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        r = check(f"127.0.0.1:{port}")
        assert r.returncode == 1 and "NOT_SERVING" in r.stderr
        assert check(f"127.0.0.1:{port}", "--live").returncode == 0  # it answers: alive, not ready
        r = check(f"127.0.0.1:{port}", "--ready")
        assert r.returncode == 2 and "usage: psserver-healthcheck [--live]" in r.stderr
        # a server of rank > 0 that answers is held to the answer
        assert check(f"127.0.0.1:{port}", **follower).returncode == 1
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert check(f"127.0.0.1:{port}").returncode == 0
    finally:
        server.stop(None)
    assert check(f"127.0.0.1:{port}").returncode == 1  # nobody listening
    assert check(f"127.0.0.1:{port}", "--live").returncode == 1
    # nobody listening on a server of rank > 0: server 0 serves the control plane, so it passes
    assert check(f"127.0.0.1:{port}", **follower).returncode == 0
    # the pod-index label missing (an empty PSSERVER_SERVER_RANK): the host name's ordinal, as the CLI
    assert check(f"127.0.0.1:{port}", PSSERVER_NUM_SERVERS="2", PSSERVER_SERVER_RANK="",
                 HOSTNAME="psserver-2").returncode == 0
    assert check(f"127.0.0.1:{port}", PSSERVER_NUM_SERVERS="2", SLURM_PROCID="1").returncode == 0
    # but not server 0, nor a lone server whatever its host name
    assert check(f"127.0.0.1:{port}", PSSERVER_NUM_SERVERS="2", PSSERVER_SERVER_RANK="0",
                 HOSTNAME="psserver-1").returncode == 1
    assert check(f"127.0.0.1:{port}", PSSERVER_NUM_SERVERS="2", HOSTNAME="psserver-0").returncode == 1
    assert check(f"127.0.0.1:{port}", PSSERVER_NUM_SERVERS="1", PSSERVER_SERVER_RANK="1").returncode == 1


RANK_VARIABLES = ("PSSERVER_NUM_SERVERS", "PSSERVER_SERVER_RANK", "SLURM_PROCID", "HOSTNAME")


def test_healthcheck_reads_the_rank_as_the_cli_does(monkeypatch):
    import importlib.util

    from psserver.cli.serve import default_server_rank

    spec = importlib.util.spec_from_file_location("psserver_healthcheck", DEPLOY / "docker" / "healthcheck.py")
    hc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hc)
    cases = [{}, {"PSSERVER_SERVER_RANK": "3"}, {"PSSERVER_SERVER_RANK": "", "HOSTNAME": "psserver-4"},
             {"SLURM_PROCID": "2", "HOSTNAME": "node-7"}, {"PSSERVER_SERVER_RANK": "x", "SLURM_PROCID": "5"},
             {"HOSTNAME": "server"}, {"HOSTNAME": "psserver-12"}]
    for case in cases:
        for name in RANK_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HOSTNAME", "server")  # not the test machine's own name
        for name, value in case.items():
            monkeypatch.setenv(name, value)
        assert hc.server_rank() == default_server_rank(), case


# ---- Compose -----------------------------------------------------------------------------


def _compose() -> dict:
    (doc,) = _docs(DEPLOY / "docker" / "compose.yaml")
    return doc


def _argv(service_or_container: dict) -> list[str]:
    argv = argv_of(service_or_container, entrypoint_is_psserver=True)
    assert argv is not None
    return argv


def test_compose_names_and_ports_agree():
    compose = _compose()
    services = compose["services"]
    server = services["server"]
    sargv = _argv(server)
    assert sargv[0] == "serve"
    host, port = option(sargv, "--host"), int(option(sargv, "--port"))
    assert host == "server" and server.get("hostname", "server") == "server"
    assert (DEPLOY / "docker" / server["build"]["context"] / server["build"]["dockerfile"]).resolve() == (
        DEPLOY / "docker" / "Dockerfile").resolve()
    published = server["ports"]
    for p in published:
        assert str(p).startswith("127.0.0.1:"), f"{p} is published beyond the host's loopback"
    container_ports = {int(str(p).rsplit(":", 1)[1]) for p in published}
    assert int(option(sargv, "--control-port")) in container_ports
    assert int(option(sargv, "--metrics-port")) in container_ports
    assert port not in container_ports, "the RPC port must not be published"
    assert option(sargv, "--control-host") == "0.0.0.0"  # reachable through the published port
    # token: a compose secret mounted at /run/secrets/<name>
    token = option(sargv, "--auth-token-file")
    name = token.removeprefix("/run/secrets/")
    assert name in server["secrets"] and name in compose["secrets"]
    # checkpoints on the volume, resumed on start
    assert "--resume" in sargv
    mounts = [v.split(":")[1] for v in server["volumes"]]
    assert any(option(sargv, "--checkpoint-dir").startswith(m) for m in mounts)
    assert "psserver-healthcheck" in " ".join(server["healthcheck"]["test"])

    trainers = {k: v for k, v in services.items() if k != "server"}
    assert len(trainers) == 2
    ranks = []
    for svc in trainers.values():
        argv = _argv(svc)
        assert argv[0] == "train"
        assert option(argv, "--server") == f"{host}:{port}"
        assert int(option(argv, "--num-trainers")) == len(trainers)
        ranks.append(int(option(argv, "--rank")))
        assert svc["depends_on"]["server"]["condition"] == "service_healthy"
        assert svc["healthcheck"] == {"disable": True}
        assert set(svc["networks"]) == set(server["networks"])
        assert "ports" not in svc
    assert sorted(ranks) == list(range(len(trainers)))


def test_compose_override_adds_a_second_server():
    compose = _compose()
    (override,) = _docs(DEPLOY / "docker" / "compose.servers.yaml")
    server = compose["services"]["server"]
    sargv = _argv(server)
    assert set(override["services"]) == {"server", "psserver-1"}
    # server 0 keeps compose.yaml's command and takes S from the environment
    assert set(override["services"]["server"]) == {"environment"}
    num_servers = override["services"]["server"]["environment"]["PSSERVER_NUM_SERVERS"]
    one = override["services"]["psserver-1"]
    argv = _argv(one)
    assert argv[0] == "serve"
    ns = parse(argv)
    assert ns.num_servers == int(num_servers) == 2 and ns.server_rank == 1
    assert option(argv, "--coordinator") == f"{option(sargv, '--host')}:{option(sargv, '--port')}"
    assert option(argv, "--host") == one["hostname"] == "psserver-1"  # its own address on the network
    for flag in ("--model", "--join-token-file", "--checkpoint-dir"):
        assert option(argv, flag) == option(sargv, flag), flag
    assert "--supervise" in argv and "--resume" in argv
    assert one["image"] == server["image"] and set(one["networks"]) == set(server["networks"])
    assert "ports" not in one, "the second server publishes nothing"
    assert one["secrets"] == [option(argv, "--join-token-file").removeprefix("/run/secrets/")]
    assert one["healthcheck"] == {"disable": True}  # no control plane to ask
    # its own volume: checkpoints/server-1/ next to server 0's checkpoints/server-0/ in another
    (volume,) = one["volumes"]
    name, mount = volume.split(":")
    assert name in override["volumes"] and name not in {v.split(":")[0] for v in server["volumes"]}
    assert option(argv, "--checkpoint-dir").startswith(mount + "/")
    # the trainers stay as they are: they learn the second server from server 0
    text = (DEPLOY / "README.md").read_text()
    assert "-f deploy/docker/compose.yaml -f deploy/docker/compose.servers.yaml up" in text


# ---- Kubernetes --------------------------------------------------------------------------


def _server_container() -> dict:
    (c,) = _k8s("StatefulSet", "psserver")["spec"]["template"]["spec"]["containers"]
    return c


def _trainer_container() -> dict:
    (c,) = _k8s("Job", "psserver-trainers")["spec"]["template"]["spec"]["containers"]
    return c


def test_kustomization_resources_exist():
    for kdir in (K8S, K8S / "base", K8S / "gpu"):
        (k,) = _docs(kdir / "kustomization.yaml")
        for res in k.get("resources", []):
            assert (kdir / res).exists(), f"{kdir}/kustomization.yaml: {res} missing"
    listed = set(_docs(K8S / "base" / "kustomization.yaml")[0]["resources"])
    on_disk = {p.name for p in (K8S / "base").glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert listed == on_disk
    assert "secret.example.yaml" not in listed, "no token may be applied from the repository"


def test_statefulset_and_services_agree():
    sts = _k8s("StatefulSet", "psserver")
    c = _server_container()
    argv = _argv(c)
    assert argv[0] == "serve" and "--resume" in argv
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert _selects(sts["spec"]["selector"]["matchLabels"], pod_labels)

    headless = _k8s("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert _selects(headless["spec"]["selector"], pod_labels)
    rpc_port = int(option(argv, "--port"))
    assert {p["port"] for p in headless["spec"]["ports"]} == {rpc_port}
    assert _port(c, "rpc") == rpc_port

    # --host is the pod IP from the downward API
    assert option(c["args"], "--host") == "$(POD_IP)"
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"

    # the headless Service names a pod before it is ready: servers of rank > 0 join server 0 by name
    assert headless["spec"].get("publishNotReadyAddresses") is True

    # the control plane and the metrics are server 0's: the Service selects the pod psserver-0 only
    control = _k8s("Service", "psserver")
    assert control["spec"].get("type", "ClusterIP") == "ClusterIP"
    selector = dict(control["spec"]["selector"])
    assert selector.pop(POD_NAME_LABEL) == f"{sts['metadata']['name']}-0"
    assert _selects(selector, pod_labels)
    ports = {p["name"]: p for p in control["spec"]["ports"]}
    control_port, metrics_port = int(option(argv, "--control-port")), int(option(argv, "--metrics-port"))
    assert ports["control"]["port"] == control_port == _port(c, ports["control"]["targetPort"])
    assert ports["metrics"]["port"] == metrics_port == _port(c, ports["metrics"]["targetPort"])
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == metrics_port

    # the probes run the image's health check: the control plane on 127.0.0.1:<control port>
    # (--control-host 0.0.0.0 covers the loopback), passing on a server of rank > 0 that serves none;
    # startup and liveness ask only that it answers (server 0 waiting for a lost server process is
    # NOT_SERVING and must not be restarted), readiness that the job can train (SERVING)
    for probe, extra in (("startupProbe", ["--live"]), ("livenessProbe", ["--live"]), ("readinessProbe", [])):
        assert c[probe]["exec"]["command"] == ["python", HEALTHCHECK_IN_IMAGE, *extra], probe
        assert c[probe]["timeoutSeconds"] >= 5, f"{probe}: python starts and asks with a 3 s deadline"
    assert "PSSERVER_HEALTH_ADDRESS" not in env
    assert f'"127.0.0.1:{control_port}"' in (DEPLOY / "docker" / "healthcheck.py").read_text()
    assert f"COPY deploy/docker/healthcheck.py {HEALTHCHECK_IN_IMAGE}" in _dockerfile()
    assert option(argv, "--control-host") == "0.0.0.0"


POD_NAME_LABEL = "statefulset.kubernetes.io/pod-name"  # set on every pod by the StatefulSet controller
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # the pod's ordinal (Kubernetes 1.28+)
HEALTHCHECK_IN_IMAGE = "/usr/local/bin/psserver-healthcheck"


def test_statefulset_passes_rank_servers_and_coordinator():
    sts = _k8s("StatefulSet", "psserver")
    c = _server_container()
    argv = _argv(c)
    env = {e["name"]: e for e in c["env"]}
    # the rank: the pod's ordinal from the downward API, not a flag, so that a cluster without
    # the label (an empty value) falls back to the CLI's own default, the host name's ordinal
    assert env["PSSERVER_SERVER_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        f"metadata.labels['{POD_INDEX_LABEL}']")
    assert option(argv, "--server-rank") is None
    # S: an env value the kustomization keeps equal to the replicas (test_replicas_and_num_servers_agree)
    assert env["PSSERVER_NUM_SERVERS"]["value"] == str(sts["spec"]["replicas"])
    assert option(argv, "--num-servers") is None
    # server 0 through the headless Service's DNS name, on its store port
    host, port = option(argv, "--coordinator").rsplit(":", 1)
    assert host == f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}"
    assert int(port) == int(option(argv, "--port"))
    assert option(_argv(_trainer_container()), "--server") == option(argv, "--coordinator")
    # the parser takes them all, and the pod's environment turns into a rank and S
    ns = parse(argv)
    assert ns.coordinator == option(argv, "--coordinator")
    assert "--supervise" in argv and "--resume" in argv  # every server restarts from its checkpoint
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # servers wait for each other: start together


def _replacement() -> dict:
    (k,) = _docs(K8S / "base" / "kustomization.yaml")
    (r,) = k["replacements"]
    return r


def test_replicas_and_num_servers_agree():
    sts = _k8s("StatefulSet", "psserver")
    assert sts["spec"]["replicas"] == 1, "the default stays one server process"
    r = _replacement()
    assert r["source"] == {"kind": "StatefulSet", "name": "psserver", "fieldPath": "spec.replicas"}
    (target,) = r["targets"]
    assert target["select"] == {"kind": "StatefulSet", "name": "psserver"}
    c = _server_container()
    assert target["fieldPaths"] == [
        f"spec.template.spec.containers.[name={c['name']}].env.[name=PSSERVER_NUM_SERVERS].value"]
    # no overlay here changes the replicas behind the base's replacement
    for kdir in (K8S, K8S / "gpu"):
        (k,) = _docs(kdir / "kustomization.yaml")
        assert "replicas" not in k
        for patch in k.get("patches", []):
            assert "replicas" not in patch.get("patch", ""), kdir


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_copies_the_replicas_into_num_servers(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(K8S / "base", base)
    sts_file = base / "server-statefulset.yaml"
    text, n = re.subn(r"^  replicas: 1\b", "  replicas: 3", sts_file.read_text(), flags=re.M)
    assert n == 1
    sts_file.write_text(text)
    r = subprocess.run(["kubectl", "kustomize", str(base)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (sts,) = [d for d in yaml.safe_load_all(r.stdout) if d and d["kind"] == "StatefulSet"]
    env = {e["name"]: e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert sts["spec"]["replicas"] == 3 and env["PSSERVER_NUM_SERVERS"]["value"] == "3"


def test_statefulset_checkpoints_and_secret():
    sts = _k8s("StatefulSet", "psserver")
    c = _server_container()
    argv = _argv(c)
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert option(argv, "--checkpoint-dir").startswith(mounts[claim["metadata"]["name"]] + "/")

    secret = _secret()
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    secret_volumes = [n for n, v in volumes.items() if "secret" in v]
    assert len(secret_volumes) == 1
    vol = volumes[secret_volumes[0]]
    assert vol["secret"]["secretName"] == secret["metadata"]["name"]
    assert set(secret["stringData"]) == {CONTROL_KEY, JOIN_KEY}
    # the whole Secret is mounted (no items): every key is a file under the mount
    assert "items" not in vol["secret"]
    assert option(argv, "--auth-token-file") == f"{mounts[secret_volumes[0]]}/{CONTROL_KEY}"
    assert option(argv, "--join-token-file") == f"{mounts[secret_volumes[0]]}/{JOIN_KEY}"
    # the file is readable by the container's user: group-readable, group = fsGroup = runAsUser
    pod_security = sts["spec"]["template"]["spec"]["securityContext"]
    assert vol["secret"]["defaultMode"] & 0o040 and pod_security["fsGroup"] == pod_security["runAsUser"]
    for text in ((K8S / "kustomization.yaml").read_text(), (DEPLOY / "README.md").read_text(),
                 (K8S / "base" / "secret.example.yaml").read_text()):
        command = _kubectl_create_secret(text)
        assert command.startswith("kubectl -n psserver create secret generic " + secret["metadata"]["name"])
        for key in secret["stringData"]:
            assert f"--from-literal={key}=" in command, f"{key} missing from: {command}"


def test_statefulset_keeps_the_state_in_a_memory_volume_keyed_by_the_pod():
    """A container restart keeps the state (an emptyDir outlives the container); a new pod has a
    new UID, so it never maps another pod's state."""
    sts = _k8s("StatefulSet", "psserver")
    c = _server_container()
    argv = _argv(c)
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    state = volumes[mounts[str(Path(option(argv, "--state-dir")).parent)]]  # a directory of the server's own in it
    assert state["emptyDir"]["medium"] == "Memory" and state["emptyDir"]["sizeLimit"]
    assert option(c["args"], "--state-key") == "$(POD_UID)"  # (argv_of fills in placeholders)
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"


def test_compose_gives_the_state_room_in_dev_shm():
    server = _compose()["services"]["server"]
    assert "--supervise" in _argv(server) and server["shm_size"]


CONTROL_KEY, JOIN_KEY = "token", "join-token"


def _secret() -> dict:
    (secret,) = _docs(K8S / "base" / "secret.example.yaml")
    assert secret["kind"] == "Secret"
    return secret


def _kubectl_create_secret(text: str) -> str:
    """The ``kubectl ... create secret`` command in ``text`` (a YAML comment or a README), with
    comment marks and backslash continuations removed."""
    lines = [re.sub(r"^\s*#\s?", "", line) for line in text.splitlines()]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    (command,) = [line.strip() for line in joined.splitlines() if "create secret generic" in line]
    return command


def test_trainers_get_the_join_token_only():
    job = _k8s("Job", "psserver-trainers")
    secret = _secret()
    c = _trainer_container()
    argv = _argv(c)
    spec = job["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    secret_volumes = [n for n, v in volumes.items() if "secret" in v]
    assert len(secret_volumes) == 1
    vol = volumes[secret_volumes[0]]["secret"]
    assert vol["secretName"] == secret["metadata"]["name"]
    # only the join token: the control plane's token gives admin rights trainers do not need
    assert [item["key"] for item in vol["items"]] == [JOIN_KEY]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == secret_volumes[0]]
    assert mount.get("readOnly") is True
    assert option(argv, "--join-token-file") == f"{mount['mountPath']}/{vol['items'][0]['path']}"
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"]
    assert vol["defaultMode"] & 0o040
    # the server reads the same key of the same Secret
    server = _argv(_server_container())
    assert option(server, "--join-token-file").endswith("/" + JOIN_KEY)
    assert "--reconnect" in argv  # rejoins a server restarted by --supervise


def test_trainers_are_an_indexed_job():
    job = _k8s("Job", "psserver-trainers")
    sts = _k8s("StatefulSet", "psserver")
    c = _trainer_container()
    argv = _argv(c)
    assert argv[0] == "train"
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == int(option(argv, "--num-trainers"))
    assert option(c["args"], "--rank") == "$(RANK)"
    env = {e["name"]: e for e in c["env"]}
    assert env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    host, port = option(argv, "--server").rsplit(":", 1)
    assert host == f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}"
    assert int(port) == int(option(_argv(_server_container()), "--port"))


def test_network_policy_admits_only_trainers_and_servers_to_rpc():
    server_labels = _k8s("StatefulSet", "psserver")["spec"]["template"]["metadata"]["labels"]
    trainer_labels = _k8s("Job", "psserver-trainers")["spec"]["template"]["metadata"]["labels"]
    rpc_port = int(option(_argv(_server_container()), "--port"))
    policies = _k8s_all("NetworkPolicy")
    server_policies = [p for p in policies if _selects(p["spec"]["podSelector"]["matchLabels"], server_labels)]
    trainer_policies = [p for p in policies if _selects(p["spec"]["podSelector"]["matchLabels"], trainer_labels)]
    assert len(server_policies) == 1 and len(trainer_policies) == 1

    def rules_covering(policy: dict, port: int) -> list[dict]:
        out = []
        for rule in policy["spec"]["ingress"]:
            for p in rule.get("ports", [{}]):
                lo = p.get("port")
                if lo is None or lo <= port <= p.get("endPort", lo):
                    out.append(rule)
                    break
        return out

    def from_one_of(rule: dict, *label_sets: dict) -> bool:
        peers = rule.get("from")
        return bool(peers) and all(set(peer) == {"podSelector"} and any(
            _selects(peer["podSelector"]["matchLabels"], labels) for labels in label_sets) for peer in peers)

    def admitted(rules: list[dict], labels: dict) -> bool:
        return any(_selects(peer["podSelector"]["matchLabels"], labels)
                   for r in rules for peer in r.get("from", []) if "podSelector" in peer)

    sp = server_policies[0]
    assert "Ingress" in sp["spec"]["policyTypes"]
    for port in (rpc_port, 40000):  # the store and a TensorPipe (ephemeral) port
        rules = rules_covering(sp, port)
        assert rules, f"nobody can reach the server's port {port}"
        # every trainer talks to every server, and the servers (--num-servers > 1) to each other
        assert admitted(rules, trainer_labels), f"trainers cannot reach the servers' port {port}"
        assert admitted(rules, server_labels), f"the servers cannot reach each other's port {port}"
        assert all(from_one_of(r, trainer_labels, server_labels) for r in rules), (
            f"port {port} is open to more than the job's trainers and servers")
    control_port = int(option(_argv(_server_container()), "--control-port"))
    assert rules_covering(sp, control_port), "the control plane must stay reachable"
    tp = trainer_policies[0]
    rules = rules_covering(tp, 40000)

    def admits(labels: dict) -> bool:
        return any(_selects(peer["podSelector"]["matchLabels"], labels)
                   for r in rules for peer in r.get("from", []) if "podSelector" in peer)

    # the server calls back, and a joining trainer calls every member of the RPC group
    assert rules and admits(server_labels) and admits(trainer_labels)
    for r in rules:
        peers = r.get("from")
        assert peers and all(set(peer) == {"podSelector"} for peer in peers), "trainers' ports open beyond the job"
        assert all(_selects(peer["podSelector"]["matchLabels"], server_labels)
                   or _selects(peer["podSelector"]["matchLabels"], trainer_labels) for peer in peers)


def test_gpu_overlay_adds_a_gpu_to_the_server():
    (k,) = _docs(K8S / "gpu" / "kustomization.yaml")
    (patch,) = k["patches"]
    assert patch["target"] == {"kind": "StatefulSet", "name": "psserver"}
    ops = yaml.safe_load(patch["patch"])
    paths = {op["path"]: op.get("value") for op in ops}
    assert paths["/spec/template/spec/containers/0/resources/limits/nvidia.com~1gpu"] == 1


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds():
    def build(path: Path) -> list[dict]:
        r = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return [d for d in yaml.safe_load_all(r.stdout) if d]

    cpu, gpu = build(K8S), build(K8S / "gpu")
    kinds = sorted(d["kind"] for d in cpu)
    assert kinds == ["Job", "NetworkPolicy", "NetworkPolicy", "Service", "Service", "StatefulSet"]
    assert all(d["metadata"]["namespace"] == "psserver" for d in cpu)
    (sts,) = [d for d in gpu if d["kind"] == "StatefulSet"]
    assert sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    (cpu_sts,) = [d for d in cpu if d["kind"] == "StatefulSet"]
    assert "nvidia.com/gpu" not in cpu_sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    for built in (sts, cpu_sts):  # S is the replicas, in both builds
        env = {e["name"]: e for e in built["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["PSSERVER_NUM_SERVERS"]["value"] == str(built["spec"]["replicas"])
    (control,) = [d for d in cpu if d["kind"] == "Service" and d["metadata"]["name"] == "psserver"]
    assert control["spec"]["selector"][POD_NAME_LABEL] == "psserver-0"


def test_kubeflow_examples():
    (job,) = _docs(K8S / "collective" / "pytorchjob.yaml")
    assert job["kind"] == "PyTorchJob" and job["apiVersion"] == "kubeflow.org/v1"
    for role in ("Master", "Worker"):
        (c,) = job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["containers"]
        assert c["name"] == "pytorch"  # the operator requires this name
        assert c["command"][:3] == ["torchrun", "-m", "psserver"]
        assert option(c["command"], "--mode") in ("ddp", "fsdp")
    (tj,) = _docs(K8S / "collective" / "trainjob.yaml")
    assert tj["kind"] == "TrainJob"
    cmd = tj["spec"]["trainer"]["command"]
    assert option(cmd, "--mode") == "fsdp"
    assert int(option(cmd, "--tp-size")) == tj["spec"]["trainer"]["numProcPerNode"]  # TP inside a node


# ---- Slurm -------------------------------------------------------------------------------


def test_slurm_scripts_resolve_nodes_and_use_torchrun():
    ps = (DEPLOY / "slurm" / "ps.sbatch").read_text()
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in ps
    for name in ("ddp.sbatch", "fsdp.sbatch", "fsdp-tp.sbatch"):
        text = (DEPLOY / "slurm" / name).read_text()
        assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text
        for flag in ("srun ", "torchrun ", "--nnodes=", "--nproc-per-node=", "--rdzv-backend=c10d",
                     "--rdzv-endpoint=", "-m psserver train --mode"):
            assert flag in text, f"{name}: {flag}"
    tp = [c for c in COMMANDS if c.source.startswith("deploy/slurm/fsdp-tp.sbatch")]
    assert tp and option(tp[0].argv, "--tp-size") is not None and option(tp[0].argv, "--mode") == "fsdp"


def test_slurm_ps_ports_match_the_defaults_elsewhere():
    compose_server = _argv(_compose()["services"]["server"])
    (serve,) = [c for c in COMMANDS if c.source.startswith("deploy/slurm/ps.sbatch") and c.argv[0] == "serve"]
    (train,) = [c for c in COMMANDS if c.source.startswith("deploy/slurm/ps.sbatch") and c.argv[0] == "train"]
    for flag in ("--port", "--control-port", "--metrics-port"):
        assert option(serve.argv, flag) == option(compose_server, flag), flag
    # the trainers and the servers of rank > 0 point at server 0's store
    assert option(train.argv, "--server") == option(serve.argv, "--coordinator")
    assert option(train.argv, "--server").endswith(":" + option(serve.argv, "--port"))


def test_slurm_ps_starts_the_servers_in_one_step():
    text = (DEPLOY / "slurm" / "ps.sbatch").read_text()
    (serve,) = [c for c in COMMANDS if c.source.startswith("deploy/slurm/ps.sbatch") and c.argv[0] == "serve"]
    # rank, host, control and metrics hosts are each task's own: SERVER_TASK adds them (see test_slurm.py)
    for flag in ("--server-rank", "--host", "--control-host", "--metrics-host"):
        assert option(serve.argv, flag) is None, flag
    assert option(serve.argv, "--num-servers") is not None and option(serve.argv, "--coordinator") is not None
    assert 'NUM_SERVERS=${PSSERVER_NUM_SERVERS:-1}' in text  # one server unless asked
    assert '--server-rank "$SLURM_PROCID"' in text
    assert 'srun --job-name=psserver-servers --nodes="$NUM_SERVERS" --ntasks="$NUM_SERVERS" --ntasks-per-node=1' in text
    assert 'bash -c "$SERVER_TASK" server \\\n    psserver serve ' in text


# ---- join token and supervision ----------------------------------------------------------

# The deployments that start a parameter server and its trainers (not the README examples).
PS_DEPLOYMENTS = ("deploy/docker/compose.yaml", "deploy/docker/compose.servers.yaml",
                  "deploy/kubernetes/base/server-statefulset.yaml",
                  "deploy/kubernetes/base/trainers-job.yaml", "deploy/slurm/ps.sbatch")


def _ps_commands() -> list[Command]:
    return [c for c in COMMANDS if c.source.split(":")[0] in PS_DEPLOYMENTS
            and c.argv[0] in ("serve", "train") and option(c.argv, "--mode") in (None, "ps")]


def test_every_ps_deployment_uses_a_join_token():
    cmds = _ps_commands()
    assert {c.source.split(":")[0] for c in cmds} == set(PS_DEPLOYMENTS)
    for c in cmds:
        assert option(c.argv, "--join-token-file"), f"{c}: no --join-token-file"
        if c.argv[0] == "serve":
            assert "--supervise" in c.argv, f"{c}: the server should run under --supervise"
        else:
            assert "--reconnect" in c.argv, f"{c}: a trainer should rejoin a restarted server (--reconnect)"
    readme = (DEPLOY / "README.md").read_text()
    for c in cmds:
        if not c.source.startswith("deploy/slurm/"):  # the script's path is a variable
            assert f"--join-token-file {option(c.argv, '--join-token-file')}" in readme, f"{c}: not in deploy/README.md"


def test_supervise_comes_with_a_checkpoint_dir():
    """The state in memory survives a server process, not a host: every deployment checkpoints too."""
    supervised = [c for c in COMMANDS if c.argv[0] == "serve" and "--supervise" in c.argv]
    assert supervised
    for c in supervised:
        assert option(c.argv, "--checkpoint-dir"), f"{c}: --supervise needs --checkpoint-dir"


def test_compose_join_token_is_a_secret_of_server_and_trainers():
    compose = _compose()
    services = compose["services"]
    server = _argv(services["server"])
    control = option(server, "--auth-token-file").removeprefix("/run/secrets/")
    path = option(server, "--join-token-file")
    assert path.startswith("/run/secrets/")
    name = path.removeprefix("/run/secrets/")
    assert name != control, "the trainers must not need the control plane's token"
    assert name in compose["secrets"] and name in services["server"]["secrets"]
    env = compose["secrets"][name]["environment"]
    assert f"export {env}=" in (DEPLOY / "README.md").read_text()
    assert f"export {env}=" in (DEPLOY / "docker" / "compose.yaml").read_text()
    for svc_name, svc in services.items():
        if svc_name == "server":
            continue
        assert option(_argv(svc), "--join-token-file") == path, svc_name
        assert svc["secrets"] == [name], f"{svc_name}: the join token, and only it"


def test_slurm_ps_makes_a_private_join_token():
    text = (DEPLOY / "slurm" / "ps.sbatch").read_text()
    ps = [c for c in _ps_commands() if c.source.startswith("deploy/slurm/ps.sbatch")]
    (serve,) = [c for c in ps if c.argv[0] == "serve"]
    (train,) = [c for c in ps if c.argv[0] == "train"]
    assert option(serve.argv, "--join-token-file") == option(train.argv, "--join-token-file")
    assert '--join-token-file "$JOIN_TOKEN_FILE"' in text
    assert "JOIN_TOKEN_FILE=$RUN_DIR/join-token" in text
    assert "umask 077" in text and 'chmod 700 -- "$RUN_DIR"' in text and 'chmod 600 -- "$1"' in text
    assert 'new_token "$JOIN_TOKEN_FILE"' in text and 'new_token "$CONTROL_TOKEN_FILE"' in text
    # the control plane's token too: the script stops the servers through it
    assert option(serve.argv, "--auth-token-file") is not None
    assert "/dev/urandom" in text  # no network, no extra tool
    assert 'rm -rf -- "$MADE_RUN_DIR"' in text  # removed when the job ends
    assert "PSSERVER_JOIN_TOKEN_FILE" in (DEPLOY / "README.md").read_text()


# ---- WireGuard ---------------------------------------------------------------------------

WIREGUARD = DEPLOY / "wireguard"
MESH = WIREGUARD / "make-mesh.sh"


def test_make_mesh_script_is_checked_and_strict():
    assert MESH in SCRIPTS  # bash -n, shebang, executable: test_scripts_pass_bash_n
    text = MESH.read_text()
    assert "\nset -euo pipefail\n" in text
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    for tool in ("curl", "wget", "apt-get", "pip ", "ssh ", "scp "):
        assert tool not in code, f"make-mesh.sh runs {tool.strip()}: it must work offline"
    assert 'WG=${WG:-wg}' in text and "genkey" in code and "pubkey" in code


def test_mesh_addresses_agree_with_the_readmes():
    text = MESH.read_text()
    prefix = re.search(r"^PREFIX=(\S+)$", text, re.M).group(1)
    port = re.search(r"^PORT=(\d+)$", text, re.M).group(1)
    server = f"{prefix}.1"
    readme = (WIREGUARD / "README.md").read_text()
    assert f"UDP {port}" in readme and "wg-quick up wg0" in readme
    assert "Istio" in readme and "Linkerd" in readme
    cmds = [c for c in COMMANDS if c.source.startswith("deploy/wireguard/")]
    serves = [c for c in cmds if c.argv[0] == "serve"]
    trains = [c for c in cmds if c.argv[0] == "train"]
    assert serves and trains
    for c in serves:
        assert option(c.argv, "--host") in (server, DUMMY_HOST), c
        assert option(c.argv, "--join-token-file") and "--supervise" in c.argv, c
    for c in trains:
        host, _ = option(c.argv, "--server").rsplit(":", 1)
        assert host in (server, DUMMY_HOST), c
        assert option(c.argv, "--join-token-file"), c
    # the README's own commands name the mesh's server address literally
    assert any(option(c.argv, "--host") == server for c in serves if "@block" in c.source)
    root = (ROOT / "docs" / "reliability-and-security.md").read_text()
    assert f"--host {server}" in root and f"--server {server}:" in root


DUMMY_HOST = "1"  # what a shell variable becomes in the extracted command lines


# ---- README ------------------------------------------------------------------------------
# ---- README ------------------------------------------------------------------------------


def test_readme_documents_ports_and_security():
    text = (DEPLOY / "README.md").read_text()
    server = _argv(_compose()["services"]["server"])
    for port in (option(server, "--port"), option(server, "--control-port"), option(server, "--metrics-port")):
        assert port in text
    for word in ("TP_SOCKET_IFNAME", "unpickle", "bearer token", "TLS", "NetworkPolicy", "ephemeral",
                 "--host 0.0.0.0", "scontrol show hostnames"):
        assert word in text, word


@pytest.mark.parametrize("readme", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                                    *sorted(DEPLOY.rglob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_readme_links_exist(readme):
    text = readme.read_text()
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if "://" not in target:
            assert (readme.parent / target).exists(), f"{readme.relative_to(ROOT)} links to missing {target}"


def test_readmes_document_the_security_model():
    deploy = (DEPLOY / "README.md").read_text()
    for word in ("--join-token-file", "PSSERVER_JOIN_TOKEN", "HMAC-SHA256", "allow-list", "--supervise",
                 "--max-restarts", "plaintext", "8 MB", "wireguard/README.md", "exits 2"):
        assert word in deploy, word
    root = (ROOT / "docs" / "reliability-and-security.md").read_text()
    assert "\n## Security\n" in root
    section = root.split("\n## Security\n", 1)[1].split("\n## ", 1)[0]
    for word in ("--join-token-file", "PSSERVER_JOIN_TOKEN", "openssl rand -hex 32", "secrets.token_hex(32)",
                 "--supervise", "--reconnect", "plaintext", "NetworkPolicy", "deploy/wireguard/",
                 "deploy/README.md#security-model", "Metrics"):
        assert word in section, word
    # a refusal metric, once it exists, is named where the refusals are described
    metric = re.search(r"(psserver_rpc_refusals\w*)", (ROOT / "psserver" / "exporters.py").read_text())
    if metric:
        assert metric.group(1).removesuffix("_total") in section + deploy
