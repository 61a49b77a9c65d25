"""experiments/deploy: the Kubernetes manifests and the SSH launcher agree with the real CLI.

Every container / remote command is parsed: each flag must be defined by the module it runs
(its absl `--helpshort`), a representative of each is accepted by the real parser
(`--only_check_args`), every `--config.X` override names a real field and the resulting config
validates, and ports, addresses, shard indices, process counts, the token and TLS files line up.
"""

import ast
import functools
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from decoupled_diloco import config as config_lib
from tests.helpers import ROOT

DEPLOY = ROOT / "experiments" / "deploy"
MODULES = ("decoupled_diloco.syncer", "decoupled_diloco.learner")
NAMESPACE = "dd"
TOKEN_SECRET = "dd-run-token"
TLS_SECRET = "dd-syncer-tls"


def _docs():
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc, f"{path.name}: empty document"
            docs.append(doc)
    return docs


def _by(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _flags(args):
    """--name=value pairs of an argument list, in order (every argument must be one)."""
    out = []
    for arg in args:
        match = re.fullmatch(r"--([\w.]+)=(.*)", arg)
        assert match, f"not a --flag=value argument: {arg!r}"
        out.append((match.group(1), match.group(2)))
    return out


@functools.cache
def _all_defined_flags():
    """The flags each module defines itself (its absl --helpshort); both at once."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = {
        m: subprocess.Popen(
            [sys.executable, "-m", m, "--helpshort"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for m in MODULES
    }
    out = {}
    for module, proc in procs.items():
        text = proc.communicate(timeout=180)[0]
        names = set(re.findall(r"^\s+--(?:\[no\])?(\w+):", text, re.M))
        assert {"config"} <= names, text[-3000:]
        out[module] = frozenset(names)
    return out


def _defined_flags(module):
    return _all_defined_flags()[module]


def _config(flags):
    """The config that a command's --config and --config.X flags describe, validated."""
    from experiments.configs import tiny_lm

    files = [v for k, v in flags if k == "config"]
    assert files == ["experiments/configs/tiny_lm.py"], files
    overrides = {}
    for name, value in flags:
        if name.startswith("config."):
            try:
                overrides[name[len("config.") :]] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                overrides[name[len("config.") :]] = value  # a plain string
    base = config_lib.from_config_dict(tiny_lm.get_config())
    config = config_lib.replace(base, **overrides)
    config_lib.validate(config)
    return config


def _config_flags(flags, drop=("config.decoupled.syncer.tls_key",)):
    return [
        (k, v) for k, v in flags if (k == "config" or k.startswith("config.")) and k not in drop
    ]


def _containers(docs):
    """(kind, name, pod spec, container) of every workload."""
    out = []
    for doc in docs:
        if doc["kind"] in ("Deployment", "Job"):
            spec = doc["spec"]["template"]["spec"]
            for container in spec["containers"]:
                out.append((doc["kind"], doc["metadata"]["name"], spec, container))
    return out


def _module(container):
    command = container["command"]
    assert command[:2] == ["python", "-m"] and command[2] in MODULES, command
    return command[2]


def _mount_for(spec, container, path):
    """The volume that holds `path` in this container."""
    for mount in container.get("volumeMounts", []):
        if path == mount["mountPath"] or path.startswith(mount["mountPath"].rstrip("/") + "/"):
            return next(v for v in spec["volumes"] if v["name"] == mount["name"]), mount
    raise AssertionError(f"{container['name']}: nothing is mounted at {path}")


def test_every_document_parses_and_names_its_namespace():
    docs = _docs()
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "Job", "PersistentVolumeClaim"} <= kinds
    for doc in docs:
        assert doc["apiVersion"] and doc["metadata"]["name"], doc
        assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]


@pytest.mark.multiprocess
def test_k8s_commands_agree_with_the_cli():
    docs = _docs()
    containers = _containers(docs)
    configs = []
    for _, name, _, container in containers:
        module = _module(container)
        flags = _flags(container["args"])
        plain = {k for k, _ in flags if k != "config" and not k.startswith("config.")}
        assert plain <= _defined_flags(module), (name, plain - _defined_flags(module))
        assert not any("syncer.token" in k for k, _ in flags), "the token belongs in a secret"
        configs.append(_config_flags(flags))
    # One config for every process of the run (the syncers' private key aside).
    assert all(c == configs[0] for c in configs), "containers disagree on --config overrides"


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.multiprocess
def test_real_parser_accepts_a_representative_command(module):
    docs = _docs()
    container = next(c for *_, c in _containers(docs) if _module(c) == module)
    args = [a.replace("$(JOB_COMPLETION_INDEX)", "1") for a in container["args"]]
    out = subprocess.run(
        [sys.executable, "-m", module, *args, "--only_check_args"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
    )
    assert out.returncode == 0, out.stderr[-3000:]


def test_syncer_shards_ports_and_services_line_up():
    docs = _docs()
    services, deployments = _by(docs, "Service"), _by(docs, "Deployment")
    config = _config(
        _flags(
            deployments[next(iter(deployments))]["spec"]["template"]["spec"]["containers"][0][
                "args"
            ]
        )
    )
    shards = {}
    for name, deployment in deployments.items():
        assert deployment["spec"]["replicas"] == 1  # one writer per shard's state
        assert deployment["spec"]["strategy"]["type"] == "Recreate"
        pod = deployment["spec"]["template"]
        assert (
            deployment["spec"]["selector"]["matchLabels"].items()
            <= pod["metadata"]["labels"].items()
        )
        container = pod["spec"]["containers"][0]
        flags = dict(_flags(container["args"]))
        assert flags["host"] == "0.0.0.0"
        port = int(flags["port"])
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert named["grpc"] == port
        service = services[name]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(port, "grpc")]
        _mount_for(pod["spec"], container, flags["checkpoint_dir"])  # state survives restarts
        shards[int(flags["shard"])] = f"{name}.{NAMESPACE}.svc.cluster.local:{port}"
    assert sorted(shards) == list(range(config.decoupled.syncer.shards))
    # Every learner lists every shard, shard 0 first.
    expected = ",".join(shards[s] for s in sorted(shards))
    for _, name, _, container in _containers(docs):
        if _module(container) == "decoupled_diloco.learner":
            assert dict(_flags(container["args"]))["syncer"] == expected, name


def test_islands_are_indexed_jobs_with_a_reachable_coordinator():
    docs = _docs()
    services, jobs = _by(docs, "Service"), _by(docs, "Job")
    learner_ids = []
    for name, job in jobs.items():
        spec, pod = job["spec"], job["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert _module(container) == "decoupled_diloco.learner"
        flags = dict(_flags(container["args"]))
        config = _config(_flags(container["args"]))
        processes = int(flags["num_processes"])
        assert spec["completionMode"] == "Indexed"
        assert spec["completions"] == spec["parallelism"] == processes
        assert config.decoupled.island_processes == processes
        mesh = config_lib.parse_mesh_shapes(config)[int(flags["learner_id"])]
        assert mesh[0] * mesh[1] % processes == 0
        # Process k is pod k: its index comes from the Job, through the environment.
        assert flags["process_id"] == "$(JOB_COMPLETION_INDEX)"
        env = {e["name"]: e for e in container["env"]}
        path = env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert "batch.kubernetes.io/job-completion-index" in path
        # Process 0's DNS name through the headless Service of the pod's subdomain.
        host, port = flags["coordinator"].rsplit(":", 1)
        subdomain = pod["subdomain"]
        assert host == f"{name}-0.{subdomain}.{NAMESPACE}.svc.cluster.local"
        service = services[subdomain]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"] == {"job-name": name}
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert named["coordinator"] == int(port)
        assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [
            (int(port), "coordinator")
        ]
        # One checkpoint directory shared by the island's processes.
        volume, _ = _mount_for(pod, container, flags["workdir"])
        claims = _by(docs, "PersistentVolumeClaim")
        claim = claims[volume["persistentVolumeClaim"]["claimName"]]
        assert "ReadWriteMany" in claim["spec"]["accessModes"]
        assert pod["restartPolicy"] == "OnFailure"  # the island comes back after a failure
        learner_ids.append(int(flags["learner_id"]))
    assert sorted(learner_ids) == list(range(config.num_learners))


def test_every_process_gets_its_secret_and_its_tls_files():
    """Syncers get the run token; a learner only its own credential (it acts only as itself)."""
    docs = _docs()
    for _, _, spec, container in _containers(docs):
        env = {e["name"]: e for e in container["env"]}
        ref = env["DD_RUN_TOKEN"]["valueFrom"]["secretKeyRef"]
        flags = dict(_flags(container["args"]))
        if _module(container) == "decoupled_diloco.syncer":
            assert ref == {"name": TOKEN_SECRET, "key": "token"}
        else:
            assert ref == {"name": f"dd-learner-{flags['learner_id']}", "key": "credential"}
        wanted = {"config.decoupled.syncer.tls_cert": "tls.crt"}
        if _module(container) == "decoupled_diloco.syncer":
            wanted["config.decoupled.syncer.tls_key"] = "tls.key"
        else:
            assert "config.decoupled.syncer.tls_key" not in flags, "learners need no key"
        for flag, key in wanted.items():
            volume, mount = _mount_for(spec, container, flags[flag])
            assert volume["secret"]["secretName"] == TLS_SECRET
            items = volume["secret"].get("items")
            relative = flags[flag][len(mount["mountPath"]) :].lstrip("/")
            assert relative == key if items is None else {"key": key, "path": relative} in items


def _ssh_commands():
    env = {k: v for k, v in os.environ.items()}
    env["DRY_RUN"] = "1"
    out = subprocess.run(
        ["bash", str(DEPLOY / "ssh" / "launch.sh"), str(DEPLOY / "ssh" / "cluster.env.example")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    rows = [line.split("\t") for line in out.stdout.splitlines()]
    for _, session, secret, _ in rows:  # syncers read the run token; learners their credential
        island = session.split("-")[2]  # dd-island-I-K
        assert secret == (
            "~/.dd_run_token" if "syncer" in session else f"~/.dd_learner_credential.{island}"
        )
    return [(host, session, shlex.split(command)) for host, session, _, command in rows]


@pytest.mark.multiprocess
def test_ssh_launcher_commands_agree_with_the_cli():
    rows = _ssh_commands()
    syncers = [(h, dict(_flags(c[1:]))) for h, s, c in rows if c[0] == "decoupled_diloco.syncer"]
    learners = [(h, dict(_flags(c[1:]))) for h, s, c in rows if c[0] == "decoupled_diloco.learner"]
    assert len(syncers) + len(learners) == len(rows)
    configs = []
    for _, session, command in rows:
        flags = _flags(command[1:])
        plain = {k for k, _ in flags if k != "config" and not k.startswith("config.")}
        assert plain <= _defined_flags(command[0]), (session, plain - _defined_flags(command[0]))
        configs.append(_config_flags(flags))
    assert all(c == configs[0] for c in configs)
    config = _config(configs[0])
    assert [int(f["shard"]) for _, f in syncers] == list(range(config.decoupled.syncer.shards))
    addresses = ",".join(f"{h}:{f['port']}" for h, f in syncers)
    islands = {}
    for host, flags in learners:
        assert flags["syncer"] == addresses
        islands.setdefault(int(flags["learner_id"]), []).append((host, flags))
    assert sorted(islands) == list(range(config.num_learners))
    for members in islands.values():
        assert [int(f["process_id"]) for _, f in members] == list(range(len(members)))
        assert {int(f["num_processes"]) for _, f in members} == {len(members)}
        leader = members[0][0]
        assert {f["coordinator"].rsplit(":", 1)[0] for _, f in members} == {leader}
        assert len({f["workdir"] for _, f in members}) == 1  # shared by the island


def test_dockerfile_exposes_the_ports_the_manifests_use():
    text = (DEPLOY / "Dockerfile").read_text()
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split()}
    used = set()
    for *_, container in _containers(_docs()):
        used |= {p["containerPort"] for p in container["ports"]}
    assert used == exposed


def test_learners_trust_the_certificate_without_the_syncers_key():
    from decoupled_diloco.syncer.server import SyncerServer

    base = config_lib.ExperimentConfig(mode="decoupled")
    learner = config_lib.replace(base, **{"decoupled.syncer.tls_cert": "/etc/dd-tls/tls.crt"})
    config_lib.validate(learner)  # a learner needs no private key
    with pytest.raises(config_lib.ConfigError, match="tls_key needs tls_cert"):
        config_lib.replace(base, **{"decoupled.syncer.tls_key": "/etc/dd-tls/tls.key"})
    with pytest.raises(ValueError, match="a TLS syncer needs its private key"):
        SyncerServer(learner, host="127.0.0.1", port=0, token="t")


def test_ssh_launcher_gives_each_island_only_its_learners_credential(tmp_path):
    """launch.sh for real, with `ssh` and `tmux` replaced by recorders that run on this machine.

    Each host is a home folder of its own: the syncers' hosts read the run token there, each
    island host receives its learner's credential (mode 600) and never the run token, and no
    secret appears on any command line.
    """
    from decoupled_diloco.comm import auth

    token = "0123456789abcdef0123456789abcdef"
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(
        '#!/bin/bash\nhost=$1; shift\nmkdir -p "$HOSTS/$host"\n'
        'printf "%s\\t%s\\n" "$host" "$*" >> "$LOG"\nHOME="$HOSTS/$host" bash -c "$*"\n'
    )
    (bin_dir / "tmux").write_text("#!/bin/bash\nexit 0\n")  # its command line is in the log
    for tool in ("ssh", "tmux"):
        (bin_dir / tool).chmod(0o755)
    home = tmp_path / "operator"
    home.mkdir()
    (home / ".dd_run_token").write_text(token + "\n")
    stale = tmp_path / "hosts" / "gpu-01" / ".dd_learner_credential.0"  # an older run's, 0644
    stale.parent.mkdir(parents=True)
    stale.write_text("old")
    stale.chmod(0o644)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(home),
        "HOSTS": str(tmp_path / "hosts"),
        "LOG": str(log),
    }
    subprocess.run(
        ["bash", str(DEPLOY / "ssh" / "launch.sh"), str(DEPLOY / "ssh" / "cluster.env.example")],
        env=env,
        timeout=60,
        check=True,
    )
    islands = {"gpu-01": 0, "gpu-02": 0, "gpu-03": 1, "gpu-04": 1}  # cluster.env.example's
    for host, learner_id in islands.items():
        credential = tmp_path / "hosts" / host / f".dd_learner_credential.{learner_id}"
        assert credential.read_text().strip() == auth.learner_credential(token, learner_id)
        assert credential.stat().st_mode & 0o777 == 0o600
    assert not list((tmp_path / "hosts").glob("*/.dd_run_token"))  # nothing sent it anywhere
    text = log.read_text()
    assert token not in text and "learner-0-" not in text and "learner-1-" not in text
    assert text.count("tmux new-session") == 6
