"""The files in cluster/ against the schemas that real clusters apply to them.

cluster.yaml against the cluster launcher's schema inside the ray package; rayjob.yaml against
KubeRay's RayJob CRD (its OpenAPI v3 schema, vendored in tests/data/, applied strictly: an
unknown field is an error, as with ``kubectl apply --validate=strict``); the Dockerfile's base
image against pyproject.toml's version ranges; and the names the manifests share (ConfigMap,
Secret, PVC, image, job) against each other and cluster/README.md.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml
from packaging.requirements import Requirement

from ingest import load_config

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster"
RAYJOB_SCHEMA = Path(__file__).parent / "data" / "kuberay-1.7.0-rayjob-v1-schema.yaml"


def pyproject() -> dict[str, Any]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def requirement(package: str) -> Requirement:
    """pyproject.toml's requirement on ``package`` (its range of versions)."""
    for dep in pyproject()["dependencies"]:
        req = Requirement(dep)
        if req.name == package:
            return req
    raise AssertionError(f"pyproject.toml does not require {package}")


def image_version(package: str) -> str:
    """The exact version of ``package`` the cluster image holds (cluster/Dockerfile: the Ray
    base image's tag, the jax it installs); every cluster file names the same."""
    text = (CLUSTER / "Dockerfile").read_text(encoding="utf-8")
    pattern = {"ray": r"ARG RAY_IMAGE=rayproject/ray:([\d.]+)-",
               "jax": r'"jax\[\$\{JAX_EXTRA\}\]==([\d.]+)"'}[package]
    m = re.search(pattern, text)
    assert m, f"cluster/Dockerfile names no exact {package} version ({pattern})"
    return m.group(1)


@pytest.mark.parametrize("package", ["ray", "jax"])
def test_the_image_versions_are_within_the_project_ranges(package):
    # A cluster's nodes and clients must run one Ray: the image fixes it, inside pyproject's
    # range, so that `pip install ingest` beside it keeps the image's Ray.
    version = image_version(package)
    assert requirement(package).specifier.contains(version), (package, version)


def load(name: str) -> Any:
    return yaml.safe_load((CLUSTER / name).read_text(encoding="utf-8"))


# -- cluster.yaml ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def launcher_schema() -> dict[str, Any]:
    return json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


def test_launcher_config_is_valid_for_the_launcher(launcher_schema):
    jsonschema.validate(load("cluster.yaml"), launcher_schema)


@pytest.mark.parametrize("break_it", [
    lambda c: c.update(dockr=c.pop("docker")),                      # a misspelled section
    lambda c: c["docker"].update(image=["not", "a", "string"]),
    lambda c: c["available_node_types"]["preprocess"]["resources"].update(CPU=-1),
    lambda c: c.pop("provider"),
])
def test_launcher_schema_rejects_broken_configs(launcher_schema, break_it):
    config = copy.deepcopy(load("cluster.yaml"))
    break_it(config)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, launcher_schema)


def test_every_launcher_node_runs_the_project_image_with_its_ray():
    config = load("cluster.yaml")
    image = config["docker"]["image"]
    assert image.rsplit(":", 1)[1] == pyproject()["version"]  # the image of this release
    # Commands run in the container: nothing installs the project on a host's own Python.
    commands = " ".join(config.get("setup_commands", []) + config.get("head_setup_commands", [])
                        + config.get("worker_setup_commands", []))
    assert "pip install" not in commands
    assert f"ray.__version__ == '{image_version('ray')}'" in commands  # a wrong image fails at `ray up`
    for name, node in config["available_node_types"].items():
        node_image = node.get("docker", {}).get("worker_image", image)
        assert node_image.split(":")[0] == image.split(":")[0], name


def test_launcher_starts_nodes_that_nothing_requests():
    """The autoscaler starts nodes for resource requests; ingest workers ask for CPUs only, so
    a node type offering no CPU must be started by min_workers."""
    config = load("cluster.yaml")
    for name, node in config["available_node_types"].items():
        if name == config["head_node_type"] or node["resources"].get("CPU", 1) > 0:
            continue
        assert node.get("min_workers", 0) == node["max_workers"] > 0, name


# -- rayjob.yaml -------------------------------------------------------------------------------


def strict(schema: Any) -> Any:
    """``schema`` with unknown fields refused wherever Kubernetes would prune or refuse them
    (objects with ``properties`` and neither ``additionalProperties`` nor
    ``x-kubernetes-preserve-unknown-fields``)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k not in ("enum", "required", "default") else v
           for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if ("additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def rayjob_schema() -> dict[str, Any]:
    text = RAYJOB_SCHEMA.read_text(encoding="utf-8")
    assert text.startswith("# KubeRay's RayJob custom resource schema")
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    return strict(json.loads(body))


def test_rayjob_is_valid_for_kuberay(rayjob_schema):
    jsonschema.Draft7Validator(rayjob_schema).validate(load("rayjob.yaml"))


@pytest.mark.parametrize("break_it", [
    lambda j: j["spec"]["rayClusterSpec"].update(enableInTreeAutoScaling=True),  # misspelled
    lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(replicas="4"),
    lambda j: j["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"].update(
        volumes=[{"name": "x", "configMap": {"nam": "y"}}]),
    lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].pop("groupName"),
])
def test_rayjob_schema_rejects_broken_manifests(rayjob_schema, break_it):
    job = copy.deepcopy(load("rayjob.yaml"))
    break_it(job)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(rayjob_schema).validate(job)


def pod_specs(job: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = job["spec"]["rayClusterSpec"]
    return [cluster["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in cluster["workerGroupSpecs"]]


def test_rayjob_runs_the_project_image_and_autoscales_its_groups():
    job = load("rayjob.yaml")
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == image_version("ray")
    images = {c["image"] for spec in pod_specs(job) for c in spec["containers"]}
    assert images == {load("cluster.yaml")["docker"]["image"]}
    if any("minReplicas" in g or "maxReplicas" in g for g in cluster["workerGroupSpecs"]):
        # Without the autoscaler the replica bounds are never acted on.
        assert cluster.get("enableInTreeAutoscaling") is True


def test_rayjob_mounts_what_the_readme_and_cluster_files_create():
    job = load("rayjob.yaml")
    readme = (CLUSTER / "README.md").read_text(encoding="utf-8")
    config_map = load("ingest-config.yaml")
    pvc = load("shared-pvc.yaml")
    assert pvc["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" in pvc["spec"]["accessModes"]
    secrets = set()
    for spec in pod_specs(job):
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{c['name']} mounts undeclared volume {m['name']}"
            secrets |= {e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e}
            # Every pod sees the shared volume at the same path (materialize --out).
            shared = [m for m in c.get("volumeMounts", [])
                      if "persistentVolumeClaim" in volumes[m["name"]]]
            assert [(m["mountPath"], volumes[m["name"]]["persistentVolumeClaim"]["claimName"])
                    for m in shared] == [("/shared", pvc["metadata"]["name"])], c["name"]
        for v in volumes.values():
            if "configMap" in v:
                assert v["configMap"]["name"] == config_map["metadata"]["name"]
    for secret in secrets:
        assert f"kubectl create secret generic {secret}" in readme
    for name in ("ingest-config.yaml", "shared-pvc.yaml", "rayjob.yaml"):
        assert f"kubectl apply -f cluster/{name}" in readme
    # The entrypoint reads a file the ConfigMap holds, at its mount path.
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (config_mount,) = [m["mountPath"] for m in head["containers"][0]["volumeMounts"]
                       if m["name"] == "config"]
    path = shlex.split(job["spec"]["entrypoint"])[2]
    assert Path(path).parent == Path(config_mount) and Path(path).name in config_map["data"]


def test_rayjob_comment_names_the_job_it_creates():
    text = (CLUSTER / "rayjob.yaml").read_text(encoding="utf-8")
    named = set(re.findall(r"kubectl logs -f job/([\w-]+)", text))
    assert named == {yaml.safe_load(text)["metadata"]["name"]}


def test_the_config_map_corpus_config_is_valid_and_floats_its_workers(tmp_path):
    path = tmp_path / "corpus.yaml"
    path.write_text(load("ingest-config.yaml")["data"]["corpus.yaml"], encoding="utf-8")
    cfg = load_config(str(path))
    assert cfg.runtime.pin_workers is False  # pods share their nodes' CPUs


# -- Dockerfile --------------------------------------------------------------------------------


def base_images(dockerfile: str) -> list[str]:
    """The FROM images, with ARG defaults substituted."""
    args: dict[str, str] = {}
    images = []
    for line in dockerfile.replace("\\\n", " ").splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0].upper() == "ARG" and "=" in words[1]:
            key, value = words[1].split("=", 1)
            args[key] = value.strip("'\"")
        elif words[0].upper() == "FROM":
            images.append(re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], words[1]))
    return images


def test_dockerfile_starts_from_the_image_ray_on_a_supported_python():
    text = (CLUSTER / "Dockerfile").read_text(encoding="utf-8")
    images = base_images(text)
    # The GPU variant, given as a build argument in the header's instructions.
    images += re.findall(r"--build-arg RAY_IMAGE=(\S+)", text)
    assert len(images) >= 2
    minimum = tuple(int(x) for x in re.fullmatch(r">=\s*(\d+)\.(\d+)",
                                                  pyproject()["requires-python"]).groups())
    for image in images:
        m = re.fullmatch(r"rayproject/ray:([\d.]+)-py(\d)(\d+)(-\w+)?", image)
        assert m, f"{image} is not a rayproject/ray image of a fixed version and Python"
        assert m.group(1) == image_version("ray"), image
        assert (int(m.group(2)), int(m.group(3))) >= minimum, image
    assert f'"jax[${{JAX_EXTRA}}]=={image_version("jax")}"' in text


def test_dockerfile_copies_every_package_and_what_the_build_needs():
    text = (CLUSTER / "Dockerfile").read_text(encoding="utf-8")
    copied = set()
    for line in text.splitlines():
        words = line.split()
        if words and words[0] == "COPY":
            copied |= {w for w in words[1:-1] if not w.startswith("--")}
    with open(ROOT / "pyproject.toml", "rb") as f:
        packages = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in packages} <= copied
    assert {"pyproject.toml", pyproject()["readme"]} <= copied
    assert all((ROOT / c).exists() for c in copied), copied


# -- the training recipes: rayjob-train-{gpu,tpu}.yaml, Dockerfile.{gpu,tpu} -------------------

# accelerator: (manifest, Dockerfile, Kubernetes resource, jax extra, JAX_PLATFORMS)
TRAIN = {"gpu": ("rayjob-train-gpu.yaml", "Dockerfile.gpu", "nvidia.com/gpu", "cuda12", "cuda"),
         "tpu": ("rayjob-train-tpu.yaml", "Dockerfile.tpu", "google.com/tpu", "tpu", "tpu")}
ACCELERATORS = sorted(TRAIN)


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return spec["containers"]


def groups(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}


def accelerator_group(job: dict[str, Any], resource: str) -> dict[str, Any]:
    found = [g for g in groups(job).values()
             if any(resource in c["resources"].get("limits", {})
                    for c in containers(g["template"]["spec"]))]
    assert len(found) == 1, f"expected one worker group with {resource}, got {len(found)}"
    return found[0]


@pytest.mark.parametrize("acc", ACCELERATORS)
def test_training_rayjob_is_valid_for_kuberay(rayjob_schema, acc):
    jsonschema.Draft7Validator(rayjob_schema).validate(load(TRAIN[acc][0]))


@pytest.mark.parametrize("acc", ACCELERATORS)
@pytest.mark.parametrize("break_it", [
    lambda j: j["spec"].update(entrypointNumGPUs=8),                            # misspelled
    lambda j: j["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "lifecycle"].update(prestop={"exec": {"command": ["ray", "stop"]}}),   # misspelled
    lambda j: j["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "ports"].append({"containerPort": "6379"}),                            # not an integer
])
def test_training_rayjob_schema_rejects_broken_manifests(rayjob_schema, acc, break_it):
    job = copy.deepcopy(load(TRAIN[acc][0]))
    break_it(job)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(rayjob_schema).validate(job)


@pytest.mark.parametrize("acc", ACCELERATORS)
def test_training_rayjob_puts_ingest_on_cpu_pods_and_training_on_the_accelerators(acc):
    name, _, resource, _, platform = TRAIN[acc]
    job = load(name)
    cluster = job["spec"]["rayClusterSpec"]
    train = accelerator_group(job, resource)
    cpu_groups = [g for g in groups(job).values() if g is not train]
    assert cpu_groups, "no CPU worker group for the ingest workers"
    # Ingest workers ask Ray for CPUs only: the head and the training pods offer none, so
    # every worker actor lands on a CPU pod.
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert train["rayStartParams"]["num-cpus"] == "0"
    for g in cpu_groups:
        assert g["rayStartParams"].get("num-cpus") != "0", g["groupName"]
        for c in containers(g["template"]["spec"]):
            assert not set(c["resources"]["limits"]) - {"cpu", "memory"}, g["groupName"]
    if any("minReplicas" in g or "maxReplicas" in g for g in cpu_groups):
        assert cluster.get("enableInTreeAutoscaling") is True
    # The entry point asks for every accelerator of the training pod, so Ray runs it there.
    (container,) = containers(train["template"]["spec"])
    chips = int(container["resources"]["limits"][resource])
    assert int(container["resources"]["requests"][resource]) == chips
    asked = (job["spec"].get("entrypointNumGpus") if acc == "gpu"
             else json.loads(job["spec"]["entrypointResources"])["TPU"])
    assert asked == chips
    assert train["replicas"] == train["minReplicas"] == train["maxReplicas"] == 1
    assert {"name": "JAX_PLATFORMS", "value": platform} in container["env"]


@pytest.mark.parametrize("acc", ACCELERATORS)
def test_every_training_rayjob_pod_has_requests_limits_ports_and_a_prestop_hook(acc):
    job = load(TRAIN[acc][0])
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    for spec in pod_specs(job):
        for c in containers(spec):
            res = c["resources"]
            for kind in ("cpu", "memory"):
                assert kind in res["requests"] and kind in res["limits"], (c["name"], kind)
            # Requests equal to limits: the pods' QoS is Guaranteed, never evicted first.
            assert res["requests"] == res["limits"], c["name"]
            assert c["lifecycle"]["preStop"]["exec"]["command"][-1] == "ray stop", c["name"]
            assert any(p["name"] == "metrics" for p in c["ports"]), c["name"]
    head_ports = {p["containerPort"]: p["name"] for p in containers(head)[0]["ports"]}
    assert {6379: "gcs-server", 8265: "dashboard", 10001: "client"}.items() <= head_ports.items()


def train_flags() -> set[str]:
    return set(re.findall(r'add_argument\("(--[\w-]+)"',
                          (ROOT / "examples" / "train.py").read_text(encoding="utf-8")))


@pytest.mark.parametrize("acc", ACCELERATORS)
def test_training_rayjob_runs_the_training_example_that_its_image_holds(acc):
    name, dockerfile, resource, _, _ = TRAIN[acc]
    job = load(name)
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["python", "/home/ray/ingest/examples/train.py"]
    flags = {a for a in argv[2:] if a.startswith("--")}
    assert flags <= train_flags(), flags - train_flags()
    text = (CLUSTER / dockerfile).read_text(encoding="utf-8")
    assert "COPY --chown=ray:users examples /home/ray/ingest/examples" in text
    ignored = (CLUSTER / f"{dockerfile}.dockerignore").read_text(encoding="utf-8").splitlines()
    assert "examples" not in ignored
    # The config and the checkpoint directory are where the training pod mounts them.
    (container,) = containers(accelerator_group(job, resource)["template"]["spec"])
    spec = accelerator_group(job, resource)["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    config = Path(argv[argv.index("--config") + 1])
    assert mounts[str(config.parent)]["configMap"]["name"] == load("ingest-config.yaml")[
        "metadata"]["name"]
    assert config.name in load("ingest-config.yaml")["data"]
    ckpt = Path(argv[argv.index("--checkpoint-dir") + 1])
    assert mounts[str(ckpt.parent)]["persistentVolumeClaim"]["claimName"] == load(
        "shared-pvc.yaml")["metadata"]["name"]
    # Images: the head and the ingest pods run cluster/Dockerfile's, the training pod its own.
    base = load("cluster.yaml")["docker"]["image"]
    built = re.search(rf"docker build -f cluster/{re.escape(dockerfile)} -t (\S+) \.", text)
    assert built, f"cluster/{dockerfile} names no build command"
    assert container["image"] == built.group(1) == f"{base}-{acc}"
    others = {c["image"] for s in pod_specs(job) for c in containers(s)} - {container["image"]}
    assert others == {base}
    named = set(re.findall(r"kubectl logs -f job/([\w-]+)", (CLUSTER / name).read_text()))
    assert named == {job["metadata"]["name"]}


@pytest.mark.parametrize("acc", ACCELERATORS)
def test_accelerator_dockerfile_installs_the_tested_ray_and_jax_build(acc):
    _, dockerfile, _, extra, _ = TRAIN[acc]
    text = (CLUSTER / dockerfile).read_text(encoding="utf-8")
    (image,) = base_images(text)
    m = re.fullmatch(r"rayproject/ray:([\d.]+)-py(\d)(\d+)-(cpu|gpu)", image)
    assert m and m.group(1) == image_version("ray"), image
    assert m.group(4) == ("gpu" if acc == "gpu" else "cpu"), image  # CUDA libraries for GPUs
    assert f'"jax[{extra}]=={image_version("jax")}"' in text
    copied = set()
    for line in text.splitlines():
        words = line.split()
        if words and words[0] == "COPY":
            copied |= {w for w in words[1:-1] if not w.startswith("--")}
    main = set()
    for line in (CLUSTER / "Dockerfile").read_text(encoding="utf-8").splitlines():
        words = line.split()
        if words and words[0] == "COPY":
            main |= {w for w in words[1:-1] if not w.startswith("--")}
    assert copied == main | {"examples"}


def test_cluster_readme_walks_through_the_training_jobs():
    readme = (CLUSTER / "README.md").read_text(encoding="utf-8")
    for acc in ACCELERATORS:
        name, dockerfile, *_ = TRAIN[acc]
        assert f"kubectl apply -f cluster/{name}" in readme
        assert f"docker build -f cluster/{dockerfile}" in readme
        assert f"kubectl logs -f job/{load(name)['metadata']['name']}" in readme
