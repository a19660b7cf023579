"""The Kubernetes manifests: schema-valid, renderable, and consistent with the runner.

Core resources are validated against the Kubernetes 1.30 OpenAPI schema (`kubernetes-validate`,
strict: unknown fields are errors). Prometheus Operator CRDs (PodMonitor, PrometheusRule) have no
schema there, so their structure is checked against a small JSON schema written from the
operator's v1 API reference."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.fixtures.cli_options import cli_env_vars
from tests.fixtures.docker import K8S_DIR, find_resource, render_overlay
from tests.fixtures.k8s_schema import CRD_SCHEMAS, validate_resource

OVERLAYS = ("single-gpu", "multi-node")
SPOT_LABELS = {
    "cloud.google.com/gke-spot": "true",
    "eks.amazonaws.com/capacityType": "SPOT",
    "karpenter.sh/capacity-type": "spot",
    "kubernetes.azure.com/scalesetpriority": "spot",
}


def plain_manifest_files() -> list[Path]:
    """Whole resources (kustomizations and strategic-merge patches are partial by design)."""
    return sorted(
        p
        for p in K8S_DIR.rglob("*.yaml")
        if p.name != "kustomization.yaml" and not p.name.endswith("-patch.yaml")
    )


def test_every_manifest_file_validates() -> None:
    files = plain_manifest_files()
    assert {p.name for p in files} >= {
        "job.yaml",
        "configmap.yaml",
        "secret.example.yaml",
        "podmonitor.yaml",
        "prometheusrule.yaml",
        "service.yaml",
    }
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            validate_resource(doc, str(path.relative_to(K8S_DIR)))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay: str) -> None:
    docs = render_overlay(overlay)
    kinds = sorted(d["kind"] for d in docs)
    expected = ["ConfigMap", "Job", "PodMonitor", "PrometheusRule"]
    if overlay == "multi-node":
        expected.append("Service")
    assert kinds == sorted(expected)
    for doc in docs:
        validate_resource(doc, f"overlays/{overlay}")


def test_crd_schema_check_rejects_a_broken_podmonitor() -> None:
    # The structural check must be able to fail: a misspelt field is refused.
    broken = yaml.safe_load((K8S_DIR / "base" / "podmonitor.yaml").read_text())
    broken["spec"]["podMetricsEndpoints"][0]["prot"] = broken["spec"]["podMetricsEndpoints"][0].pop(
        "port"
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, CRD_SCHEMAS["PodMonitor"])


def runner_container(job: dict[str, Any]) -> dict[str, Any]:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "runner"
    return container


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_job_survives_preemption_and_fails_fast_on_bad_input(overlay: str) -> None:
    docs = render_overlay(overlay)
    job = find_resource(docs, "Job")
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert job["spec"]["backoffLimit"] >= 1
    assert job["spec"]["podFailurePolicy"]["rules"] == [
        {
            "action": "FailJob",
            "onExitCodes": {"containerName": "runner", "operator": "In", "values": [2, 3]},
        },
        {
            "action": "Ignore",
            "onExitCodes": {"containerName": "runner", "operator": "In", "values": [75]},
        },
        {
            "action": "Ignore",
            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
        },
    ]
    # The kubelet SIGKILLs after the grace period: the runner's own budget must end first.
    config = find_resource(docs, "ConfigMap", "spot-runner-config")["data"]
    assert pod["terminationGracePeriodSeconds"] >= float(config["RUNNER_GRACE_SECONDS"]) + 10

    container = runner_container(job)
    assert "command" not in container, "`command` would replace the image's init (dumb-init)"
    assert container["args"][0] == "runner"
    assert {"secretRef": {"name": "spot-runner-s3"}} in container["envFrom"]
    assert {"configMapRef": {"name": "spot-runner-config"}} in container["envFrom"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    volumes = {v["name"]: v for v in pod["volumes"]}
    run_mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/data")
    assert "emptyDir" in volumes[run_mount["name"]]
    assert config["RUNNER_RUN_DIR"].startswith("/data/")
    assert pod["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_job_lands_on_spot_nodes_of_every_common_provider(overlay: str) -> None:
    pod = find_resource(render_overlay(overlay), "Job")["spec"]["template"]["spec"]
    tolerated = {t["key"] for t in pod["tolerations"] if t["operator"] == "Exists"}
    assert set(SPOT_LABELS) <= tolerated
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    selected = {
        (e["key"], value)
        for term in terms
        for e in term["matchExpressions"]
        if e["operator"] == "In"
        for value in e["values"]
    }
    assert selected == set(SPOT_LABELS.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_configmap_names_only_options_the_runner_reads(overlay: str) -> None:
    docs = render_overlay(overlay)
    config = find_resource(docs, "ConfigMap", "spot-runner-config")["data"]
    subcommand = runner_container(find_resource(docs, "Job"))["args"][1]
    runner_keys = {k for k in config if k.startswith("RUNNER_")}
    unknown = runner_keys - cli_env_vars(subcommand)
    assert not unknown, f"ConfigMap keys `runner {subcommand}` does not read: {sorted(unknown)}"
    other = set(config) - runner_keys
    assert other <= {"AWS_ENDPOINT_URL_S3", "AWS_REGION"}


def test_podmonitor_scrapes_the_runner_pods() -> None:
    docs = render_overlay("single-gpu")
    monitor = find_resource(docs, "PodMonitor")
    template = find_resource(docs, "Job")["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {
        p["name"]: p["containerPort"]
        for p in runner_container({"spec": {"template": template}})["ports"]
    }
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint["path"] == "/metrics"
    config = find_resource(docs, "ConfigMap", "spot-runner-config")["data"]
    assert ports[endpoint["port"]] == int(config["RUNNER_METRICS_PORT"])


def test_prometheusrule_carries_the_contract_alerts() -> None:
    rule = find_resource(render_overlay("single-gpu"), "PrometheusRule")
    alerts = {r.get("alert") for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {
        "RunnerCheckpointStale",
        "RunnerCheckpointMirrorLagging",
        "RunnerCheckpointFailures",
        "RunnerDown",
    } <= alerts


def test_multi_node_overlay_wires_torchrun_to_the_headless_service() -> None:
    docs = render_overlay("multi-node")
    job = find_resource(docs, "Job")
    service = find_resource(docs, "Service")
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["completionMode"] == "Indexed"
    nodes = job["spec"]["completions"]
    assert job["spec"]["parallelism"] == nodes >= 2
    assert service["spec"]["clusterIP"] == "None"
    assert pod["subdomain"] == service["metadata"]["name"]
    assert (
        service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    )

    args = runner_container(job)["args"]
    assert args[:4] == ["runner", "run", "--", "torchrun"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in args[4:] if a.startswith("--"))
    assert int(flags["nnodes"]) == nodes
    # Pod 0 of an Indexed Job is <job>-0, resolvable as <job>-0.<subdomain>.
    host, port = flags["rdzv-endpoint"].rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(port) == service["spec"]["ports"][0]["port"]
    rank_var = re.fullmatch(r"\$\((\w+)\)", flags["node-rank"])
    assert rank_var is not None
    env = {e["name"]: e for e in runner_container(job)["env"]}
    assert env[rank_var.group(1)]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
