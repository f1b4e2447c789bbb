"""The cluster specs the pipeline ships (Ray cluster launcher YAML, KubeRay RayJob, image) are
valid and agree with what the code relies on."""
from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from pipeline.config import parse
from jobs.forget import ForgetConfig

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"


def project_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)


def image_name() -> str:
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    version = re.search(r'org\.opencontainers\.image\.version="([^"]+)"', dockerfile).group(1)
    return f"unlearn-pipeline:{version}"


def test_dockerfile_installs_the_package_on_the_projects_ray():
    text = (CLUSTER / "Dockerfile").read_text()
    assert f"rayproject/ray:{ray.__version__}-" in text  # same Ray as the venv that submits
    assert re.search(r"pip install .*-e /opt/unlearn", text) and "unlearn --help" in text
    assert image_name() == f"unlearn-pipeline:{project_version()}"


def test_ray_cluster_launcher_yaml():
    raw = yaml.safe_load((CLUSTER / "ray-cluster.yaml").read_text())
    validate_config(prepare_config(copy.deepcopy(raw)))  # Ray's own schema and checks
    assert raw["provider"]["type"] == "local" and raw["provider"]["head_ip"] == "127.0.0.1"
    assert raw["docker"]["image"] == image_name()
    assert any("unlearn --help" in c for c in raw["setup_commands"])
    head = " ".join(raw["head_start_ray_commands"])
    flags = dict(f.split("=", 1) for f in shlex.split(head) if f.startswith("--") and "=" in f)
    assert "ray start --head" in head and "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in head
    assert flags["--node-ip-address"] == "127.0.0.1" and flags["--dashboard-host"] == "127.0.0.1"
    assert flags["--port"] == "6379" and flags["--dashboard-port"] == "8265"  # unlearn submit's default
    assert int(flags["--num-cpus"]) >= 1 and "--num-gpus" in flags
    worker = " ".join(raw["worker_start_ray_commands"])
    wflags = dict(f.split("=", 1) for f in shlex.split(worker) if f.startswith("--") and "=" in f)
    assert wflags["--address"] == "$RAY_HEAD_IP:6379" and int(wflags["--num-gpus"]) == 1
    from jobs.submit import DEFAULT_ADDRESS

    assert DEFAULT_ADDRESS == f"http://127.0.0.1:{flags['--dashboard-port']}"


def test_kuberay_rayjob_manifest():
    docs = {d["kind"]: d for d in yaml.safe_load_all((CLUSTER / "rayjob.yaml").read_text())}
    job = docs["RayJob"]
    assert job["apiVersion"] == "ray.io/v1"
    spec = job["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["unlearn", "forget"]
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert runtime_env["working_dir"] == "/opt/unlearn"  # where the Dockerfile copies the project
    assert ".venv/" in runtime_env["excludes"] and runtime_env["env_vars"]["HF_HUB_OFFLINE"] == "1"
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    head = cluster["headGroupSpec"]
    head_container = head["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head_container["ports"]}
    assert ports == {"gcs-server": 6379, "dashboard": 8265, "client": 10001}
    assert head_container["image"] == image_name()
    assert float(head["rayStartParams"]["num-gpus"]) == 0
    workers = cluster["workerGroupSpecs"][0]
    worker_container = workers["template"]["spec"]["containers"][0]
    assert worker_container["image"] == image_name()
    assert worker_container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert workers["rayStartParams"]["num-gpus"] == "1"
    # --workers N pool workers take one GPU each: the worker group must hold N GPUs
    n = int(argv[argv.index("--workers") + 1])
    assert workers["minReplicas"] * worker_container["resources"]["limits"]["nvidia.com/gpu"] >= n
    # the request the entrypoint names is in the ConfigMap mounted there, and it is a valid config
    config_path = Path(argv[argv.index("--config") + 1])
    mounts = {m["mountPath"]: m["name"] for m in head_container["volumeMounts"]}
    volumes = {v["name"]: v for v in head["template"]["spec"]["volumes"]}
    volume = volumes[mounts[str(config_path.parent)]]
    configmap = docs["ConfigMap"]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    request = parse(ForgetConfig, yaml.safe_load(configmap["data"][config_path.name]), "rayjob request")
    models_mount = next(m for m in head_container["volumeMounts"] if m["name"] == "models")["mountPath"]
    assert str(request.model).startswith(models_mount) and str(request.output).startswith(models_mount)
    assert any(m["mountPath"] == models_mount for m in worker_container["volumeMounts"])
