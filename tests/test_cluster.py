"""Cluster files and remote storage: the launcher config against Ray's own schema, the KubeRay
manifest, an s3:// corpus on a loopback S3 server, and `ray job submit` on loopback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import jax
import jsonschema
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import yaml

from ingest import BatchDigest, Config, ConfigError, SourceConfig
from jax_side import HostFeed, batch_sharding
from tests.helpers import free_port, write_parquet_corpus

ROOT = Path(__file__).resolve().parent.parent
SECRET = "s3cr3t-never-printed"


def test_launcher_config_validates_against_the_schema_shipped_in_ray():
    schema_path = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    schema = json.loads(schema_path.read_text())
    config = yaml.safe_load((ROOT / "cluster" / "cluster.yaml").read_text())
    jsonschema.validate(config, schema)
    types = config["available_node_types"]
    # Ingest workers take one CPU each: accelerator hosts and the head offer none.
    assert types["jax_host"]["resources"]["CPU"] == 0
    assert types[config["head_node_type"]]["resources"]["CPU"] == 0
    assert types["preprocess"]["resources"]["CPU"] > 0
    broken = dict(config, available_node_types={"x": {"resources": {"CPU": -1}}})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_rayjob_manifest_has_the_fields_kuberay_requires():
    job = yaml.safe_load((ROOT / "cluster" / "rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    assert job["metadata"]["name"]
    spec = job["spec"]
    assert spec["entrypoint"].startswith("ingest ")
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert head and all(c["name"] and c["image"] for c in head)
    for group in cluster["workerGroupSpecs"]:
        assert group["groupName"]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert all(c["image"] for c in group["template"]["spec"]["containers"])
    # Credentials come from a Secret, never inline.
    assert "AWS_SECRET_ACCESS_KEY" not in json.dumps(job).replace("# AWS_", "")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 with a bucket holding a small Parquet corpus."""
    moto_server = pytest.importorskip("moto.server")
    import boto3

    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "test-key-id", "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    local = tmp_path_factory.mktemp("s3_corpus")
    write_parquet_corpus(local, n_files=3, docs_per_file=40, row_group_size=10, seed=11)
    client = boto3.client("s3")
    client.create_bucket(Bucket="corpus")
    for f in sorted(local.iterdir()):
        client.upload_file(str(f), "corpus", f"train/{f.name}")
    try:
        yield local
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _digest(paths: tuple[str, ...]) -> str:
    cfg = Config(sources=(SourceConfig(paths=paths),), seq_len=32, global_batch_size=8,
                 num_streams=4, unit_rows=5, num_epochs=1)
    sharding = batch_sharding(jax.make_mesh((len(jax.devices()),), ("data",)), "data")
    d = BatchDigest()
    with HostFeed(cfg, sharding=sharding, backend="local") as feed:
        for batch in feed:
            d.update({k: np.asarray(v) for k, v in batch.items()})
    assert d.steps > 3
    return d.hexdigest()


def test_an_s3_corpus_feeds_the_same_batches_as_the_same_files_read_locally(s3):
    assert _digest(("s3://corpus/train/",)) == _digest((str(s3),))


def test_s3_errors_name_the_uri_and_never_the_credentials(s3, caplog):
    with pytest.raises(FileNotFoundError) as e:
        _digest(("s3://corpus/missing/",))
    assert "s3://corpus/missing/" in str(e.value)
    assert SECRET not in str(e.value) and SECRET not in caplog.text


def test_a_uri_with_embedded_credentials_is_refused_without_repeating_them():
    with pytest.raises(ConfigError) as e:
        SourceConfig(paths=(f"s3://AKIA:{SECRET}@corpus/train/",)) and Config(
            sources=(SourceConfig(paths=(f"s3://AKIA:{SECRET}@corpus/train/",)),))
    assert "embeds credentials" in str(e.value)
    assert SECRET not in str(e.value)


@pytest.mark.slow
def test_ray_job_submit_runs_ingest_on_a_loopback_cluster(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"text": [f"job doc {i}-{j} " * 20 for j in range(40)]}),
                       corpus / f"part-{i}.parquet", row_group_size=10)
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"sources": [{"paths": [str(corpus)]}], "seq_len": 32,
                                      "global_batch_size": 8, "num_streams": 4,
                                      "unit_rows": 5, "workers": 1}))
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.pop("RAY_ADDRESS", None)
    gcs, dash = free_port(), free_port()
    # A short temp dir: Ray's unix sockets live there, and pytest's paths exceed their limit.
    ray_tmp = tempfile.mkdtemp(prefix="rj", dir="/tmp")
    head = subprocess.Popen(
        [str(bin_dir / "ray"), "start", "--head", "--block", f"--port={gcs}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=2",
         "--include-dashboard=true", f"--temp-dir={ray_tmp}",
         # Free ports for the agents: the defaults (52365, ...) belong to the session cluster.
         f"--dashboard-agent-listen-port={free_port()}",
         f"--dashboard-agent-grpc-port={free_port()}",
         f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
         f"--ray-client-server-port={free_port()}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:  # the dashboard's job server answers a few seconds after the start
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{dash}/api/version", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or head.poll() is not None:
                    pytest.fail(f"the Ray head's dashboard did not answer within 90 s "
                                f"(head exit code {head.poll()})")
                threading.Event().wait(0.5)
        def submit(*args: str) -> tuple[subprocess.CompletedProcess, dict]:
            cmd = [str(bin_dir / "ray"), "job", "submit", f"--address=http://127.0.0.1:{dash}",
                   "--", "ingest", *args]
            deadline = time.monotonic() + 120
            while True:
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
                # The job agent starts after the dashboard answers; Ray says to try again.
                if "No available agent" not in out.stdout + out.stderr:
                    break
                if time.monotonic() > deadline:
                    pytest.fail("the Ray head's job agent was not ready within 120 s")
                threading.Event().wait(1.0)
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
            assert "succeeded" in out.stdout
            return out, next(json.loads(line) for line in reversed(out.stdout.splitlines())
                             if line.startswith("{"))

        out, summary = submit("run", str(config), "--steps", "3", "--json", "--no-progress")
        assert summary["steps"] == 3 and summary["backend"] == "ray"
        assert "steps 3" in out.stdout  # the human summary is in the job's logs too
        # The same cluster runs a materialize job through the worker pool.
        mat = tmp_path / "materialized"
        out, summary = submit("materialize", str(config), "--out", str(mat), "--json")
        assert summary["complete"] and summary["segments_written"] == summary["segments"] > 0
        assert f"materialize {mat}: complete" in out.stdout  # the human summary, in the logs
        assert json.loads((mat / "manifest.json").read_text())["complete"]
    finally:
        # Only this head's process group: `ray stop` would end every Ray cluster on the machine.
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
