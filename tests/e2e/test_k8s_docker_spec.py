"""The k8s -> `docker run` translation used by the container e2e test maps each field of the
rendered Job (the e2e test then runs it for real)."""

from __future__ import annotations

from tests.fixtures.docker import docker_spec_from_job, render_overlay


def test_single_gpu_job_translates_to_docker_run() -> None:
    spec = docker_spec_from_job(
        render_overlay("single-gpu"),
        secret_env={"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"},
        overrides={"RUNNER_STEPS": "7"},
        mounts={"/data": "/srv/run"},
    )
    assert spec.command == ["runner", "demo"]
    assert spec.stop_grace_s == 120
    args = spec.run_args
    assert args[args.index("--user") + 1] == "10001:10001"
    assert "--read-only" in args
    assert args[args.index("--cap-drop") + 1] == "ALL"
    assert args[args.index("--security-opt") + 1] == "no-new-privileges"
    assert args[args.index("--memory") + 1] == "48g"
    assert "/srv/run:/data" in args
    assert "/tmp:uid=10001,gid=10001,mode=0755" in args
    assert "--entrypoint" not in args  # the image's init stays PID 1
    # ConfigMap, then Secret, then the caller's overrides.
    assert spec.env["RUNNER_MIRROR"] == "s3://my-bucket/spot-runner/single-gpu"
    assert spec.env["RUNNER_GRACE_SECONDS"] == "100"
    assert spec.env["AWS_SECRET_ACCESS_KEY"] == "s"
    assert spec.env["RUNNER_STEPS"] == "7"
    assert "RUNNER_STEPS=7" in args


def test_multi_node_args_keep_downward_api_variables_unexpanded() -> None:
    # NODE_RANK comes from the downward API, which only a kubelet fills in.
    spec = docker_spec_from_job(
        render_overlay("multi-node"), secret_env={}, overrides={}, mounts={}
    )
    assert spec.command[:4] == ["runner", "run", "--", "torchrun"]
    assert "--node-rank=$(NODE_RANK)" in spec.command
    assert "/dev/shm:uid=10001,gid=10001,mode=0755" in spec.run_args
