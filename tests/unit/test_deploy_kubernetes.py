"""deploy/kubernetes: every manifest is valid for the Kubernetes API, and the files agree with each other and with
the `trainwarden agent` and `trainwarden run` they configure.

Built-in kinds are checked with kubernetes-validate (the test extra) against Kubernetes' own OpenAPI schemas,
which it ships (no network), in strict mode: an unknown or misspelt field fails, as a wrong type or a missing
required field does. The ServiceMonitor is a custom resource those schemas do not have: it is checked with
``jsonschema`` (a dependency of kubernetes-validate) against ``SERVICE_MONITOR_SCHEMA``, written below from the
Prometheus Operator's CRD. The containers' command lines go through the real CLI (``main``, with the command's
work replaced by a recorder), the ConfigMap's agent.toml through the agent's own settings loader.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from trainwarden.agent.cli.main import main
from trainwarden.agent.common import exit_codes

yaml = pytest.importorskip("yaml", reason="PyYAML not installed (the test extra has it)")

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"

KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")
"""1.31: the oldest release in which every field used here is GA (a Job's podFailurePolicy); 1.37: the newest
the pinned kubernetes-validate ships schemas for."""

NOT_IN_KUBERNETES_SCHEMAS = {"ServiceMonitor", "Kustomization"}
"""Kinds checked by hand below; any other kind must be one kubernetes-validate knows."""

DOWNWARD_API_SAMPLES = {"spec.nodeName": "gpu-node-1", "metadata.name": "gpt-small-0-x7k2p",
                        "status.podIP": "10.1.2.3"}
"""What kubelet puts in a ``fieldRef`` variable, for expanding ``$(VAR)`` in the containers' arguments."""


def _documents() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        found += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return found


DOCUMENTS = _documents()


def one(kind: str, file: str | None = None) -> dict:
    matches = [doc for name, doc in DOCUMENTS if doc["kind"] == kind and file in (None, name)]
    assert len(matches) == 1, f"expected one {kind}{f' in {file}' if file else ''}, found {len(matches)}"
    return matches[0]


def pod_spec(kind: str) -> dict:
    return one(kind)["spec"]["template"]["spec"]


def container(kind: str) -> dict:
    (only,) = pod_spec(kind)["containers"]
    return only


def port_named(c: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return port


def container_env(c: dict) -> dict[str, str]:
    """The container's variables as kubelet sets them (``DOWNWARD_API_SAMPLES`` for the downward API's)."""
    return {var["name"]: var["value"] if "value" in var
            else DOWNWARD_API_SAMPLES[var["valueFrom"]["fieldRef"]["fieldPath"]] for var in c.get("env", [])}


def expanded_argv(c: dict) -> list[str]:
    """The container's command line as kubelet runs it: ``$(VAR)`` replaced by the container's variables (a
    reference to a variable that is not defined stays literal in Kubernetes: here it fails)."""
    env = container_env(c)

    def expand(arg: str) -> str:
        for name in re.findall(r"\$\((\w+)\)", arg):
            assert name in env, f"{c['name']}: $({name}) is not a variable of the container"
        return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)
    return [expand(a) for a in [*c["command"], *c.get("args", [])]]


def agent_toml() -> str:
    return one("ConfigMap")["data"]["agent.toml"]


@pytest.fixture
def agent_settings(tmp_path) -> dict:
    """The agent's settings as the DaemonSet's pod resolves them: the ConfigMap's file and the container's
    variables, through the agent's own loader."""
    from trainwarden.agent.cli.agent import resolve_settings
    from trainwarden.agent.cli.main import build_parser

    config = tmp_path / "agent.toml"
    config.write_text(agent_toml())
    env = {k: v for k, v in container_env(container("DaemonSet")).items() if k.startswith("TRAINWARDEN_")}
    return resolve_settings(build_parser().parse_args(["agent", "--config", str(config)]), environ=env)


# ---- the API's schemas ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_document_is_valid_for_the_kubernetes_api(version):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed (the test extra has it)")
    checked = []
    for name, doc in DOCUMENTS:
        if doc["kind"] in NOT_IN_KUBERNETES_SCHEMAS:
            continue
        try:
            kv.validate(doc, version, strict=True)
        except kv.SchemaNotFoundError:
            pytest.fail(f"{name}: kubernetes-validate has no schema for {doc['apiVersion']} {doc['kind']}; "
                        "check it by hand like the ServiceMonitor")
        except kv.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {'.'.join(map(str, exc.path))}: "
                        f"{exc.message}")
        checked.append(doc["kind"])
    assert sorted(checked) == ["ConfigMap", "DaemonSet", "Job", "Namespace", "PersistentVolumeClaim", "Service",
                               "Service", "ServiceAccount"]


def test_strict_validation_rejects_a_misspelt_field():
    """The check above is worth something: a field Kubernetes does not know fails, it is not dropped."""
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed (the test extra has it)")
    daemonset = yaml.safe_load((K8S / "daemonset.yaml").read_text())
    daemonset["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 9479
    with pytest.raises(kv.ValidationError, match="prot"):
        kv.validate(daemonset, KUBERNETES_VERSIONS[0], strict=True)


_DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
_LABEL_NAME = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}
_RELABEL = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod", "labelmap",
                            "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep", "lowercase", "Lowercase",
                            "uppercase", "Uppercase", "keepequal", "KeepEqual", "dropequal", "DropEqual"]},
        "modulus": {"type": "integer"}, "regex": {"type": "string"}, "replacement": {"type": "string"},
        "separator": {"type": "string"}, "sourceLabels": {"type": "array", "items": _LABEL_NAME},
        "targetLabel": {"type": "string"},
    },
}
_ANY = {}
"""A field the CRD has and these files do not use: allowed, its content not checked here."""
_LABEL_SELECTOR = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "required": ["key", "operator"], "additionalProperties": False,
            "properties": {"key": {"type": "string"}, "operator": {"type": "string"},
                           "values": {"type": "array", "items": {"type": "string"}}}}},
    },
}
SERVICE_MONITOR_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object", "required": ["name"], "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "maxLength": 253,
                         "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object", "required": ["endpoints", "selector"], "additionalProperties": False,
            "properties": {
                "endpoints": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"}, "targetPort": {"type": ["integer", "string"]},
                        "path": {"type": "string"}, "scheme": {"enum": ["http", "https"]},
                        "interval": {"type": "string", "pattern": _DURATION},
                        "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                        "honorLabels": {"type": "boolean"}, "honorTimestamps": {"type": "boolean"},
                        "relabelings": {"type": "array", "items": _RELABEL},
                        "metricRelabelings": {"type": "array", "items": _RELABEL},
                        "params": {"type": "object", "additionalProperties": {"type": "array",
                                                                              "items": {"type": "string"}}},
                        **{name: _ANY for name in (
                            "authorization", "basicAuth", "bearerTokenFile", "bearerTokenSecret", "enableHttp2",
                            "filterRunning", "followRedirects", "noProxy", "oauth2", "proxyConnectHeader",
                            "proxyFromEnvironment", "proxyUrl", "tlsConfig", "trackTimestampsStaleness")},
                    },
                }},
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
                "jobLabel": {"type": "string"},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "sampleLimit": {"type": "integer"}, "targetLimit": {"type": "integer"},
                **{name: _ANY for name in (
                    "attachMetadata", "bodySizeLimit", "convertClassicHistogramsToNHCB", "fallbackScrapeProtocol",
                    "keepDroppedTargets", "labelLimit", "labelNameLengthLimit", "labelValueLengthLimit",
                    "nativeHistogramBucketLimit", "nativeHistogramMinBucketFactor", "scrapeClass",
                    "scrapeClassicHistograms", "scrapeProtocols", "selectorMechanism")},
            },
        },
    },
}
"""The ServiceMonitor's fields, from the Prometheus Operator's CRD (monitoring.coreos.com_servicemonitors.yaml,
operator v0.84): every field of ``spec`` and of an endpoint is listed, so a misspelt one fails; the ones these
files use are typed as the CRD types them (durations, the relabel actions, label names)."""


def test_service_monitor_matches_the_prometheus_operator_crd():
    import jsonschema

    validator = jsonschema.Draft202012Validator(SERVICE_MONITOR_SCHEMA)
    monitor = copy.deepcopy(one("ServiceMonitor"))
    problems = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(monitor)]
    assert not problems
    monitor["spec"]["endpoints"][0]["honorLabel"] = True  # what the schema is for
    assert not validator.is_valid(monitor)


def test_kustomization_applies_every_manifest_but_the_example():
    kustomization = one("Kustomization")
    assert set(kustomization) == {"apiVersion", "kind", "resources"}
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed))
    assert set(listed) == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "example-job.yaml"}


# ---- the agent and the DaemonSet -----------------------------------------------------------------------------

def test_the_daemonset_runs_the_agent_with_the_configmaps_settings(tmp_path, monkeypatch, agent_settings):
    """The DaemonSet's command line and the ConfigMap's agent.toml, through `trainwarden agent` up to the start of
    the daemon: flags, the file, the variables and every check the CLI makes on them."""
    import trainwarden.agent.node.daemon as daemon

    spec = pod_spec("DaemonSet")
    c = container("DaemonSet")
    (config_volume,) = [v for v in spec["volumes"] if "configMap" in v]
    assert config_volume["configMap"]["name"] == one("ConfigMap")["metadata"]["name"]
    (mount,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == config_volume["name"]]
    argv = expanded_argv(c)
    assert argv[:2] == ["trainwarden", "agent"] and argv[2:] == [f"--config={mount}/agent.toml"]
    assert "agent.toml" in one("ConfigMap")["data"]

    (secret,) = [v for v in spec["volumes"] if "secret" in v]  # the etcd client certificate
    (secret_dir,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == secret["name"]]
    files = [agent_settings[k] for k in ("etcd_ca", "etcd_cert", "etcd_key")]
    assert all(f.startswith(secret_dir + "/") for f in files) and agent_settings["etcd"].startswith("https://")
    mounted = tmp_path / "secret"  # what kubelet mounts there, for the agent's check that the files exist
    mounted.mkdir()
    for f in files:
        (mounted / Path(f).name).write_text("PEM")
    (tmp_path / "agent.toml").write_text(agent_toml().replace(secret_dir + "/", f"{mounted}/"))
    for key, value in container_env(c).items():
        monkeypatch.setenv(key, value)
    started = []
    monkeypatch.setattr(daemon, "run_daemon", lambda options: started.append(options) or 0)
    assert main(argv[1:-1] + [f"--config={tmp_path / 'agent.toml'}"]) == 0
    (options,) = started
    assert options.agent.node == DOWNWARD_API_SAMPLES["spec.nodeName"]  # the Kubernetes node's name
    assert options.run_jobs is False and options.etcd == agent_settings["etcd"]


def test_the_probes_ask_the_health_port_the_config_opens(agent_settings):
    c = container("DaemonSet")
    probes = {kind: c[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert all(set(probe) & {"grpc", "exec", "httpGet", "tcpSocket"} == {"grpc"} for probe in probes.values())
    assert {probe["grpc"]["port"] for probe in probes.values()} == {agent_settings["health_port"]}
    assert port_named(c, "health") == agent_settings["health_port"]
    assert all(probe["grpc"].get("service", "") == "" for probe in probes.values())  # the agent's overall health
    assert agent_settings["health_host"] in ("0.0.0.0", "::")  # kubelet dials the pod's IP, not its loopback


def test_the_metrics_port_is_the_same_everywhere(agent_settings):
    port = agent_settings["metrics_port"]
    assert agent_settings["metrics_host"] in ("0.0.0.0", "::")
    c = container("DaemonSet")
    assert port_named(c, "metrics") == port
    assert one("DaemonSet")["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    service = one("Service", "service.yaml")
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == port and service_port["targetPort"] == "metrics"
    (endpoint,) = one("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["port"] == service_port["name"] and endpoint["path"] == "/metrics"


def test_prometheus_sees_the_agents_as_the_alert_rules_and_dashboards_expect():
    """The scrape job is named after the Service, and the alert on a silent agent asks for that job; the
    agent's `job` label (the training job's name) is kept, as deploy/prometheus.yml keeps it."""
    rules = (ROOT / "dashboards" / "prometheus" / "alerts.yml").read_text()
    (scrape_job,) = set(re.findall(r'up\{job="([^"]+)"\}', rules))
    assert one("Service", "service.yaml")["metadata"]["name"] == scrape_job
    assert "jobLabel" not in one("ServiceMonitor")["spec"]
    (endpoint,) = one("ServiceMonitor")["spec"]["endpoints"]
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    assert endpoint["honorLabels"] is prometheus["scrape_configs"][0]["honor_labels"] is True


def test_the_agents_writable_paths_are_its_mounts(agent_settings):
    """A read-only root filesystem: the socket's directory and the state home are the node's directories."""
    spec, c = pod_spec("DaemonSet"), container("DaemonSet")
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"] if not m.get("readOnly")}
    socket_dir = str(Path(agent_settings["socket"]).parent)
    assert mounts[socket_dir]["hostPath"]["path"] == socket_dir
    assert mounts[agent_settings["state_home"]]["hostPath"]["path"] == agent_settings["state_home"]
    assert "emptyDir" in mounts["/tmp"]


def test_the_agent_has_the_least_privilege_that_works():
    spec, c = pod_spec("DaemonSet"), container("DaemonSet")
    security = c["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["KILL"]}  # daemonset.yaml says why
    assert security["allowPrivilegeEscalation"] is False and not security.get("privileged")
    assert spec["hostPID"] is True and not spec.get("hostNetwork") and not spec.get("hostIPC")
    account = one("ServiceAccount")
    assert spec["serviceAccountName"] == account["metadata"]["name"]
    assert spec["automountServiceAccountToken"] is False and account["automountServiceAccountToken"] is False
    rbac = [doc["kind"] for _, doc in DOCUMENTS if doc["apiVersion"].startswith("rbac.authorization.k8s.io")]
    assert rbac == []  # the agent never calls the Kubernetes API
    env = container_env(c)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})  # NVML sees the GPUs without taking one


def test_labels_selectors_and_names_match():
    namespace = one("Namespace")["metadata"]["name"]
    for name, doc in DOCUMENTS:
        if doc["kind"] not in ("Namespace", "Kustomization") and name != "example-job.yaml":
            assert doc["metadata"]["namespace"] == namespace, f"{name}: {doc['kind']}"
    daemonset = one("DaemonSet")
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service = one("Service", "service.yaml")
    assert service["spec"]["selector"].items() <= pod_labels.items() and service["spec"]["clusterIP"] == "None"
    monitor = one("ServiceMonitor")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["namespaceSelector"]["matchNames"] == [namespace]

    job, job_service = one("Job"), one("Service", "example-job.yaml")
    job_pod = job["spec"]["template"]
    assert job_service["spec"]["selector"].items() <= job_pod["metadata"]["labels"].items()
    assert job_pod["spec"]["subdomain"] == job_service["metadata"]["name"]
    assert job_service["spec"]["ports"][0]["port"] == port_named(container("Job"), "metrics")
    (claim,) = [v["persistentVolumeClaim"]["claimName"] for v in job_pod["spec"]["volumes"]
                if "persistentVolumeClaim" in v]
    pvc = one("PersistentVolumeClaim")
    assert claim == pvc["metadata"]["name"] and pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_an_agent_runs_wherever_the_example_job_can():
    """The job's pods land only on nodes the DaemonSet selects, and the DaemonSet tolerates their taints."""
    agent, job = pod_spec("DaemonSet"), pod_spec("Job")
    assert agent["nodeSelector"].items() <= job["nodeSelector"].items()
    assert all(t in agent["tolerations"] for t in job["tolerations"])


# ---- the example job -----------------------------------------------------------------------------------------

def test_the_example_job_runs_trainwarden_run_per_pod(monkeypatch, agent_settings):
    """Its command line through `trainwarden run` up to the launch (every check of the CLI and of RunOptions),
    and sized as the Job: one node per pod, one worker per GPU, the etcd the agents use."""
    import trainwarden.agent.launch.run as launch

    c = container("Job")
    argv = expanded_argv(c)
    assert argv[:2] == ["trainwarden", "run"]
    for key, value in container_env(c).items():
        monkeypatch.setenv(key, value)
    launched = []
    monkeypatch.setattr(launch, "run", lambda opts: launched.append(opts) or 0)
    assert main(argv[1:]) == 0
    (opts,) = launched
    job = one("Job")["spec"]
    low, high = (int(n) for n in opts.nnodes.split(":"))
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"] == high and low >= 1
    assert opts.nproc_per_node == int(c["resources"]["limits"]["nvidia.com/gpu"])
    assert opts.node == DOWNWARD_API_SAMPLES["metadata.name"]  # unique per pod: a replacement is a new node
    assert opts.etcd == agent_settings["etcd"]
    assert opts.agent and opts.metrics_host == "0.0.0.0" and opts.metrics_port == port_named(c, "metrics")
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert container_env(c)["TRAINWARDEN_STATE_HOME"] in mounts
    ckpt_dir = next(a.split("=", 1)[1] for a in opts.script if a.startswith("--ckpt-dir="))
    (checkpoints,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "checkpoints"]
    assert Path(checkpoints) in Path(ckpt_dir).parents


def test_the_example_jobs_failure_policy_uses_trainwardens_exit_codes():
    spec = one("Job")["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # the Job's podFailurePolicy requires it
    fail, ignore = spec["podFailurePolicy"]["rules"]
    assert fail["action"] == "FailJob" and fail["onExitCodes"]["containerName"] == container("Job")["name"]
    assert set(fail["onExitCodes"]["values"]) == {exit_codes.EXIT_USAGE, exit_codes.EXIT_CONFIG}
    assert ignore == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}


@pytest.mark.parametrize("pods", ["low", "high"])
def test_the_example_training_command_fits_every_world_the_job_may_have(monkeypatch, pods):
    """The reference job's own parser, at the world size of the fewest and of the most pods (--nnodes)."""
    gpt = pytest.importorskip("trainwarden.runtime.examples.gpt", reason="torch not installed")
    argv = expanded_argv(container("Job"))
    nnodes = next(a.split("=", 1)[1] for a in argv if a.startswith("--nnodes="))
    nproc = int(next(a.split("=", 1)[1] for a in argv if a.startswith("--nproc-per-node=")))
    script = argv[argv.index("--") + 1:]
    assert script[:2] == ["-m", "trainwarden.runtime.examples.gpt"]
    nodes = int(nnodes.split(":")[0 if pods == "low" else -1])
    monkeypatch.setenv("WORLD_SIZE", str(nodes * nproc))
    cfg = gpt.parse_args(script[2:])
    assert cfg.mesh.dp * cfg.mesh.tp * cfg.mesh.pp == nodes * nproc
    assert cfg.batch == 64 and cfg.ckpt_dir.startswith("/checkpoints/")
