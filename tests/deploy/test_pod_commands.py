"""The chart's container commands run in a real bash with KubeRay's
environment emulated: ``$KUBERAY_GEN_RAY_START_CMD`` built the way KubeRay's
operator builds it (``ray start`` + `` --key=value `` per rayStartParam,
``--block`` always added), and stand-in ``ray`` / ``tandem`` executables that
record their argv. Checks what the shell hands each program: the head starts
Ray without ``--block`` and then becomes ``tandem serve``; a worker's
``--resources`` reaches ``ray start`` as the JSON its pool's engines ask for."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

from tests.deploy.test_chart import EXPOSED, GPU_DISAGG, by_kind, render

RECORDER = """#!/bin/sh
python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$(basename "$0")" "$@" >> "$RECORD"
"""


def kuberay_start_cmd(head: bool, params: dict[str, str]) -> str:
    """KubeRay's generated command for these rayStartParams (pod.go:
    setMissingRayStartParams + convertParamMap, sorted keys)."""
    params = dict(params, block="true")
    if not head:
        params.setdefault("address", "tandem-head-svc.serving.svc.cluster.local:6379")
    flags = ""
    for key in sorted(params):
        value = params[key]
        if value.lower() == "true":
            flags += f" --{key} "
        elif value.lower() != "false":
            flags += f" --{key}={value} "
    return ("ray start --head" if head else "ray start") + flags


def run_container(container: dict, start_cmd: str, tmp_path: Path, env: dict) -> list[list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("ray", "tandem"):
        exe = bin_dir / name
        exe.write_text(RECORDER)
        exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    record = tmp_path / "argv.jsonl"
    record.unlink(missing_ok=True)
    full_env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        RECORD=str(record),
        KUBERAY_GEN_RAY_START_CMD=start_cmd,
        **env,
    )
    proc = subprocess.run(
        [*container["command"], *container["args"]],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_head_starts_ray_then_becomes_the_gateway(tmp_path):
    (cluster,) = by_kind(render(EXPOSED), "RayCluster")
    head_group = cluster["spec"]["headGroupSpec"]
    (container,) = head_group["template"]["spec"]["containers"]
    start_cmd = kuberay_start_cmd(True, head_group["rayStartParams"])
    assert "--block" in start_cmd
    calls = run_container(container, start_cmd, tmp_path, {"TANDEM_API_KEY": "s3cr3t"})
    ray_call, serve_call = calls
    assert ray_call == ["ray", "start", "--head", "--num-cpus=0"]
    assert serve_call == [
        "tandem", "serve", "--config", "/etc/tandem/serve.yaml", "--address", "auto",
        "--host", "0.0.0.0", "--port", "8000", "--api-key", "s3cr3t",
        "--log-format", "json", "--otlp-traces-endpoint", "http://otel-collector.monitoring:4318",
    ]  # fmt: skip


def test_worker_advertises_its_pool_resource(tmp_path):
    (cluster,) = by_kind(render(GPU_DISAGG), "RayCluster")
    for group in cluster["spec"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        start_cmd = kuberay_start_cmd(False, group["rayStartParams"])
        (ray_call,) = run_container(container, start_cmd, tmp_path, {})
        assert ray_call[:2] == ["ray", "start"] and "--block" in ray_call
        (resources,) = [a for a in ray_call if a.startswith("--resources=")]
        role = group["groupName"]
        assert json.loads(resources.removeprefix("--resources=")) == {f"tandem_{role}": 1}
