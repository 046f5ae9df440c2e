"""Which rows and streams a host owns, read off the batch sharding (jax_side.sharding), and the
shape checks that refuse a batch that cannot be laid out: on 8 forced CPU devices, one host."""

from __future__ import annotations

import jax
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from ingest import Config, ConfigError, SourceConfig
from jax_side import HostFeed, HostRows, batch_sharding, host_rows

pytestmark = pytest.mark.multidevice


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
    n = len(jax.devices())
    assert n == 8, f"needs XLA_FLAGS=--xla_force_host_platform_device_count=8, got {n} devices"


def mesh_1d():
    return jax.make_mesh((8,), ("data",))


def mesh_2d():
    return jax.make_mesh((4, 2), ("data", "model"))


SHARDINGS = {
    "1d-data": lambda: NamedSharding(mesh_1d(), PartitionSpec("data")),
    "2d-data": lambda: NamedSharding(mesh_2d(), PartitionSpec("data")),
    "2d-data+model": lambda: NamedSharding(mesh_2d(), PartitionSpec(("data", "model"))),
    "2d-model+data": lambda: NamedSharding(mesh_2d(), PartitionSpec(("model", "data"))),
    "2d-data,seq-model": lambda: NamedSharding(mesh_2d(), PartitionSpec("data", "model")),
    "2d-replicated-rows": lambda: NamedSharding(mesh_2d(), PartitionSpec(None, "model")),
}


@pytest.mark.parametrize("name", sorted(SHARDINGS))
@pytest.mark.parametrize("global_batch_size,num_streams", [(16, 8), (16, 16), (16, 1), (32, 4)])
def test_one_host_owns_every_row_and_every_stream(name, global_batch_size, num_streams):
    rows = host_rows(SHARDINGS[name](), global_batch_size, 64, num_streams)
    assert rows == HostRows(0, global_batch_size, tuple(range(num_streams)))


def test_batch_sharding_puts_rows_on_batch_axes_and_tokens_on_seq_axis():
    mesh = mesh_2d()
    assert batch_sharding(mesh) == NamedSharding(mesh, PartitionSpec("data", None))
    assert batch_sharding(mesh, ("data", "model")) == NamedSharding(
        mesh, PartitionSpec(("data", "model"), None))
    assert batch_sharding(mesh, "data", "model") == NamedSharding(
        mesh, PartitionSpec("data", "model"))


@pytest.mark.parametrize("sharding,global_batch_size,seq_len,field,shards", [
    (lambda: NamedSharding(mesh_1d(), PartitionSpec("data")), 12, 64, "global_batch_size", 8),
    (lambda: NamedSharding(mesh_2d(), PartitionSpec(("data", "model"))), 20, 64,
     "global_batch_size", 8),
    (lambda: NamedSharding(mesh_2d(), PartitionSpec("data")), 6, 64, "global_batch_size", 4),
    (lambda: NamedSharding(mesh_2d(), PartitionSpec("data", "model")), 16, 33, "seq_len", 2),
], ids=["1d-batch", "2d-batch-both-axes", "2d-batch-data", "2d-seq-model"])
def test_mesh_axis_not_dividing_a_dimension_is_refused_naming_the_field(
        sharding, global_batch_size, seq_len, field, shards):
    with pytest.raises(ValueError) as info:
        host_rows(sharding(), global_batch_size, seq_len, num_streams=2)
    message = str(info.value)
    size = global_batch_size if field == "global_batch_size" else seq_len
    assert f"{field}={size}" in message, message
    assert f"{shards} shards" in message, message


def test_every_misfit_dimension_is_reported_at_once():
    sharding = NamedSharding(mesh_2d(), PartitionSpec("data", "model"))
    with pytest.raises(ValueError) as info:
        host_rows(sharding, 6, 33, num_streams=2)
    message = str(info.value)
    assert "global_batch_size=6" in message, message
    assert "seq_len=33" in message, message


@pytest.mark.parametrize("global_batch_size,num_streams,divisors", [
    (12, 8, [1, 2, 3, 4, 6, 12]),
    (16, 3, [1, 2, 4, 8, 16]),
    (8, 16, [1, 2, 4, 8]),
])
def test_config_refuses_num_streams_not_dividing_global_batch_size(global_batch_size,
                                                                   num_streams, divisors):
    with pytest.raises(ConfigError) as info:
        Config(sources=(SourceConfig(paths=("corpus",)),), global_batch_size=global_batch_size,
               num_streams=num_streams)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert f"global_batch_size={global_batch_size}" in message, message
    assert f"num_streams={num_streams}" in message, message
    assert str(divisors) in message, message


def test_config_reports_num_streams_not_dividing_batch_beside_other_problems():
    with pytest.raises(ConfigError) as info:
        Config(sources=(SourceConfig(paths=("corpus",)),), seq_len=0, global_batch_size=12,
               num_streams=8)
    problems = info.value.problems
    assert any("seq_len=0" in p for p in problems), problems
    assert any("num_streams=8" in p and "[1, 2, 3, 4, 6, 12]" in p for p in problems), problems


def test_config_accepts_every_listed_divisor():
    for num_streams in (1, 2, 3, 4, 6, 12):
        cfg = Config(sources=(SourceConfig(paths=("corpus",)),), global_batch_size=12,
                     num_streams=num_streams)
        assert cfg.rows_per_stream * num_streams == 12


def test_feed_refuses_a_misfit_sharding_at_construction(tmp_path):
    # A mesh that does not divide the batch is an error at construction, naming the field.
    path = tmp_path / "tiny.parquet"
    pq.write_table(pa.table({"text": ["one document", "another one"]}), str(path))
    cfg = Config(sources=(SourceConfig(paths=(str(path),)),), seq_len=32, global_batch_size=12,
                 num_streams=2, unit_rows=1)
    with pytest.raises(ValueError, match="global_batch_size=12"):
        HostFeed(cfg, sharding=NamedSharding(mesh_1d(), PartitionSpec("data")),
                 backend="local")


def test_feed_refuses_a_sharding_that_is_not_a_named_sharding(tmp_path):
    path = tmp_path / "tiny.parquet"
    pq.write_table(pa.table({"text": ["one document", "another one"]}), str(path))
    cfg = Config(sources=(SourceConfig(paths=(str(path),)),), seq_len=32, global_batch_size=8,
                 num_streams=2, unit_rows=1)
    with pytest.raises(TypeError, match="NamedSharding"):
        HostFeed(cfg, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]),
                 backend="local")
