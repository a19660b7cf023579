"""The JobSet overlay (k8s/overlays/jobset): renders with `kubectl kustomize`, is a JobSet that
the JobSet v1alpha2 schema and admission rules accept (tests/fixtures/jobset_schema.py, from
the API types), its job template is a batch/v1 Job the Kubernetes schema accepts, and its
values do what the overlay promises: a preemption restarts the whole gang without using up
maxRestarts, exit 2 or 3 fails it, torchrun's static rendezvous meets on pod 0's DNS name
(as torchrun's own parser reads the args), every node has its own disk and the same bucket.
No cluster: what the Job and JobSet controllers do with a pod failure is replayed
from their source (the fixture's `pod_failure_message` and `jobset_action`)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
from pathlib import Path
from typing import Any
from unittest import mock

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.fixtures import jobset_schema as js
from tests.fixtures.cli_options import cli_env_vars
from tests.fixtures.docker import K8S_DIR, _kubectl, find_resource, render_overlay
from tests.fixtures.k8s_schema import K8S_VERSION, validate_resource

OVERLAY = "jobset"
NODE = "node"
# podFailurePolicy's Job failure reason for a FailJob rule (batch/v1 JobReasonPodFailurePolicy)
POD_FAILURE_POLICY = "PodFailurePolicy"


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render_overlay(OVERLAY)


@pytest.fixture(scope="module")
def jobset(docs: list[dict[str, Any]]) -> dict[str, Any]:
    doc: dict[str, Any] = find_resource(docs, "JobSet")
    return doc


def job_spec(jobset: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = js.replicated_job(jobset, NODE)["template"]["spec"]
    return spec


def pod_spec(jobset: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = job_spec(jobset)["template"]["spec"]
    return spec


def runner_container(jobset: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod_spec(jobset)["containers"]
    assert container["name"] == "runner"
    return container


def expand(args: list[str], container: dict[str, Any], annotations: dict[str, str]) -> list[str]:
    """The kubelet's $(VAR) expansion of `args`, for variables the downward API fills from the
    pod's annotations (what the JobSet controller puts on the pod)."""
    values = {}
    for var in container.get("env", []):
        path = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
        if match := re.fullmatch(r"metadata\.annotations\['([^']+)'\]", path):
            values[var["name"]] = annotations[match.group(1)]

    def one(arg: str) -> str:
        return re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), m.group(0)), arg)

    return [one(a) for a in args]


def torchrun_flags(args: list[str]) -> dict[str, str]:
    separator = args.index("--")
    assert args[: separator + 2] == ["runner", "run", "--", "torchrun"]
    assert args[-3:] == ["-m", "runner", "demo"]
    flags = args[separator + 2 : -3]
    assert all(f.startswith("--") and "=" in f for f in flags), flags
    return dict(f.removeprefix("--").split("=", 1) for f in flags)


def test_overlay_renders_a_valid_jobset_job_and_monitor(docs: list[dict[str, Any]]) -> None:
    assert sorted(d["kind"] for d in docs) == [
        "ConfigMap",
        "JobSet",
        "PodMonitor",
        "PrometheusRule",
    ]
    jobset = find_resource(docs, "JobSet")
    js.validate_jobset(jobset)
    try:
        kubernetes_validate.validate(js.as_batch_job(jobset, NODE), K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"the JobSet's job template is no valid batch/v1 Job: {exc.message}")
    for doc in docs:
        if doc["kind"] != "JobSet":
            validate_resource(doc, f"overlays/{OVERLAY}")


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node: Any = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def _rename(doc: dict[str, Any], path: str, new_key: str) -> None:
    *parents, last = path.split(".")
    node: Any = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[new_key] = node.pop(last)


RULES = "spec.failurePolicy.rules"
BROKEN_JOBSETS = {
    "misspelt network field": lambda d: _rename(
        d, "spec.network.enableDNSHostnames", "enableDnsHostnames"
    ),
    "misspelt spec field": lambda d: _rename(d, "spec.replicatedJobs", "replicatedJob"),
    "misspelt rule field": lambda d: _rename(
        d, f"{RULES}.1.onJobFailureMessagePatterns", "onJobFailureMessagePattern"
    ),
    "unknown action": lambda d: _set(d, f"{RULES}.1.action", "RestartJobsetAndIgnoreMaxRestarts"),
    "unknown restart strategy": lambda d: _set(d, "spec.failurePolicy.restartStrategy", "Blocking"),
    "unknown failure reason": lambda d: _set(
        d, f"{RULES}.0.onJobFailureReasons", ["PodFailurePolicies"]
    ),
    "rule name with a hyphen": lambda d: _set(d, f"{RULES}.0.name", "usage-error"),
    "duplicate rule names": lambda d: _set(d, f"{RULES}.1.name", "UsageOrIntegrityError"),
    "rule targets no replicated job": lambda d: _set(
        d, f"{RULES}.1.targetReplicatedJobs", ["nodes"]
    ),
    "subdomain not a DNS label": lambda d: _set(d, "spec.network.subdomain", "Spot_Runner"),
    "replicas a string": lambda d: _set(d, "spec.replicatedJobs.0.replicas", "2"),
    "status in a manifest": lambda d: _set(d, "status", {"restarts": 0}),
    # <jobset>-node-1 over 63 characters
    "Job name too long": lambda d: _set(d, "metadata.name", "spot-runner-" + "x" * 50),
    # <jobset>-node-1 fits, <jobset>-node-1-0-<5 random> does not
    "pod name too long": lambda d: _set(d, "metadata.name", "spot-runner-" + "x" * 40),
}


@pytest.mark.parametrize("broken", sorted(BROKEN_JOBSETS))
def test_schema_check_refuses_a_broken_jobset(jobset: dict[str, Any], broken: str) -> None:
    doc = copy.deepcopy(jobset)
    BROKEN_JOBSETS[broken](doc)
    with pytest.raises(jsonschema.ValidationError):
        js.validate_jobset(doc)


def test_job_template_check_refuses_a_misspelt_job_field(jobset: dict[str, Any]) -> None:
    job = copy.deepcopy(js.as_batch_job(jobset, NODE))
    job["spec"]["podFailurePolicies"] = job["spec"].pop("podFailurePolicy")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_pod_failure_policy_marks_each_outcome_for_the_jobset(jobset: dict[str, Any]) -> None:
    spec = job_spec(jobset)
    assert pod_spec(jobset)["restartPolicy"] == "Never"  # podFailurePolicy requires it
    # A failure no rule matches fails this node's Job at once (BackoffLimitExceeded).
    assert spec["backoffLimit"] == 0
    assert spec["podFailurePolicy"]["rules"] == [
        {
            "action": "FailJob",
            "onExitCodes": {"containerName": "runner", "operator": "In", "values": [2, 3]},
        },
        {
            "action": "FailJob",
            "onExitCodes": {"containerName": "runner", "operator": "In", "values": [75]},
        },
        {
            "action": "FailJob",
            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
        },
    ]
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 3
    assert policy["restartStrategy"] == "BlockingRecreate"
    assert policy["rules"] == [
        {
            "name": "UsageOrIntegrityError",
            "action": "FailJobSet",
            "targetReplicatedJobs": [NODE],
            "onJobFailureReasons": [POD_FAILURE_POLICY],
            "onJobFailureMessagePatterns": ["matching FailJob rule at index 0$"],
        },
        {
            "name": "PreemptedOrStopped",
            "action": "RestartJobSetAndIgnoreMaxRestarts",
            "targetReplicatedJobs": [NODE],
            "onJobFailureReasons": [POD_FAILURE_POLICY],
            "onJobFailureMessagePatterns": [
                "matching FailJob rule at index 1$",
                "matching FailJob rule at index 2$",
            ],
        },
    ]


# (runner's exit code, pod conditions) -> (JobSet action, its rule; None: the default)
OUTCOMES = {
    (2, ()): ("FailJobSet", "UsageOrIntegrityError"),
    (3, ()): ("FailJobSet", "UsageOrIntegrityError"),
    # a configuration error stays one when the node goes away meanwhile
    (2, ("DisruptionTarget",)): ("FailJobSet", "UsageOrIntegrityError"),
    (75, ()): ("RestartJobSetAndIgnoreMaxRestarts", "PreemptedOrStopped"),
    (75, ("DisruptionTarget",)): ("RestartJobSetAndIgnoreMaxRestarts", "PreemptedOrStopped"),
    # preempted and SIGKILLed at the end of the grace period, or stopped without a final
    # checkpoint: still the cloud's doing
    (137, ("DisruptionTarget",)): ("RestartJobSetAndIgnoreMaxRestarts", "PreemptedOrStopped"),
    (1, ("DisruptionTarget",)): ("RestartJobSetAndIgnoreMaxRestarts", "PreemptedOrStopped"),
    # crashes: a counted gang restart
    (1, ()): ("RestartJobSet", None),
    (137, ()): ("RestartJobSet", None),
}


@pytest.mark.parametrize(
    ("exit_code", "conditions"),
    [pytest.param(*key, id="+".join([f"exit{key[0]}", *key[1]])) for key in sorted(OUTCOMES)],
)
def test_each_pod_outcome_gets_its_jobset_action(
    jobset: dict[str, Any], exit_code: int, conditions: tuple[str, ...]
) -> None:
    spec = job_spec(jobset)
    message = js.pod_failure_message(
        spec["podFailurePolicy"], container="runner", exit_code=exit_code, conditions=conditions
    )
    if message is None:
        # no FailJob rule: the failure counts against backoffLimit 0
        reason, message = "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    else:
        reason = POD_FAILURE_POLICY
    action = js.jobset_action(jobset, NODE, reason=reason, message=message)
    assert action == OUTCOMES[(exit_code, conditions)]


def test_grace_period_outlasts_the_runner_deadline(
    docs: list[dict[str, Any]], jobset: dict[str, Any]
) -> None:
    config = find_resource(docs, "ConfigMap", "spot-runner-config")["data"]
    grace = float(config["RUNNER_GRACE_SECONDS"])
    assert grace == 100
    # 20 s for what the runner does after its deadline (kill, sweep, drain, exit)
    assert pod_spec(jobset)["terminationGracePeriodSeconds"] - grace == 20
    # `runner run` sets torchrun's SIGKILL delay to the grace period unless it is set
    env_names = {e["name"] for e in runner_container(jobset).get("env", [])}
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in env_names | set(config)


def torchrun_config(args: list[str]) -> tuple[Any, list[str]]:
    """torchrun's launch config and the script's args, as torchrun itself reads `args`."""
    from torch.distributed.run import config_from_args, parse_args

    # parse_args takes defaults from PET_* variables; config_from_args sets OMP_NUM_THREADS
    with mock.patch.dict(os.environ):
        for name in [n for n in os.environ if n.startswith("PET_")]:
            del os.environ[name]
        config, _cmd, cmd_args = config_from_args(parse_args(args[args.index("torchrun") + 1 :]))
    return config, list(cmd_args)


def check_rendezvous(jobset: dict[str, Any], nodes: int) -> None:
    assert js.replicated_job(jobset, NODE)["replicas"] == nodes
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    assert jobset["spec"]["network"]["publishNotReadyAddresses"] is True
    # one Indexed Job of one pod per node: pod 0 of Job i is node rank i
    spec = job_spec(jobset)
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 1, 1)
    container = runner_container(jobset)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["rendezvous"] == 29500
    # <jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>
    pod_zero = js.pod_dns_name(jobset, NODE, 0, 0)
    assert pod_zero == "spot-runner-node-0-0.spot-runner-nodes"
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    for index in range(nodes):
        annotations = js.pod_annotations(jobset, NODE, index)
        args = expand(container["args"], container, annotations)
        # static rendezvous on pod 0: no --rdzv-* flag
        assert torchrun_flags(args) == {
            "nnodes": str(nodes),
            "nproc-per-node": str(gpus),
            "node-rank": str(index),
            "master-addr": pod_zero,
            "master-port": "29500",
            "max-restarts": "0",
        }
        config, script_args = torchrun_config(args)
        assert (config.rdzv_backend, config.rdzv_endpoint) == ("static", f"{pod_zero}:29500")
        assert (config.min_nodes, config.max_nodes) == (nodes, nodes)
        assert config.rdzv_configs["rank"] == index
        assert (config.nproc_per_node, config.max_restarts) == (gpus, 0)
        assert script_args[-3:] == ["-m", "runner", "demo"]


def test_torchrun_meets_on_pod_zero_of_the_gang(jobset: dict[str, Any]) -> None:
    check_rendezvous(jobset, nodes=2)


def test_node_count_is_set_in_one_place(tmp_path: Path) -> None:
    # The patch the overlay's kustomization.yaml documents, in an overlay of one's own.
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                # kustomize refuses absolute paths
                "resources": [os.path.relpath(K8S_DIR / "overlays" / OVERLAY, tmp_path)],
                "patches": [
                    {
                        "target": {"kind": "JobSet", "name": "spot-runner"},
                        "patch": '[{"op": "replace", "path": '
                        '"/spec/replicatedJobs/0/replicas", "value": 4}]',
                    }
                ],
            }
        )
    )
    proc = subprocess.run(
        [_kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    jobset = find_resource([d for d in yaml.safe_load_all(proc.stdout) if d], "JobSet")
    js.validate_jobset(jobset)
    check_rendezvous(jobset, nodes=4)


def test_each_node_has_its_own_disk_and_shares_only_the_bucket(
    docs: list[dict[str, Any]], jobset: dict[str, Any]
) -> None:
    pod = pod_spec(jobset)
    container = runner_container(jobset)
    # every volume is the pod's own scratch: no PVC, hostPath, NFS, CSI or JobSet-made claim
    assert {v["name"]: sorted(set(v) - {"name"}) for v in pod["volumes"]} == {
        "run-dir": ["emptyDir"],
        "tmp": ["emptyDir"],
        "dshm": ["emptyDir"],
    }
    assert "volumeClaimPolicies" not in jobset["spec"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/data"] == "run-dir"
    config = find_resource(docs, "ConfigMap", "spot-runner-config")["data"]
    assert config["RUNNER_RUN_DIR"] == "/data/run"
    assert config["RUNNER_MIRROR"] == "s3://my-bucket/spot-runner/jobset"
    assert container["envFrom"] == [
        {"configMapRef": {"name": "spot-runner-config"}},
        {"secretRef": {"name": "spot-runner-s3"}},
    ]
    assert "command" not in container, "`command` would replace the image's init (dumb-init)"


def test_pods_land_on_spot_nodes_as_the_base_job_does(jobset: dict[str, Any]) -> None:
    base = yaml.safe_load((K8S_DIR / "base" / "job.yaml").read_text())["spec"]["template"]["spec"]
    pod = pod_spec(jobset)
    assert pod["tolerations"] == base["tolerations"]
    assert pod["affinity"] == base["affinity"]
    assert pod["securityContext"] == base["securityContext"]


def test_podmonitor_scrapes_every_node(docs: list[dict[str, Any]], jobset: dict[str, Any]) -> None:
    monitor = find_resource(docs, "PodMonitor")
    labels = job_spec(jobset)["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    ports = {p["name"]: p["containerPort"] for p in runner_container(jobset)["ports"]}
    config = find_resource(docs, "ConfigMap", "spot-runner-config")["data"]
    assert ports["metrics"] == int(config["RUNNER_METRICS_PORT"]) == 9400


def test_configmap_names_only_options_runner_run_reads(docs: list[dict[str, Any]]) -> None:
    config = find_resource(docs, "ConfigMap", "spot-runner-config")["data"]
    assert config["RUNNER_MAX_RESTARTS"] == "0"  # restarts are the JobSet's
    runner_keys = {k for k in config if k.startswith("RUNNER_")}
    assert not runner_keys - cli_env_vars("run")
    assert set(config) - runner_keys <= {"AWS_ENDPOINT_URL_S3", "AWS_REGION"}
