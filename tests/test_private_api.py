"""jax_side.private_api and actors.private_api: each private use of JAX and Ray still reaches what it names in the
pinned versions, and falls back to the public behaviour where it does not."""

from __future__ import annotations

import importlib.util

import pytest

from actors import private_api as ray_private
from jax_side import private_api as jax_private


class RecordingInit:
    """Stands in for ray.init: records its arguments; rejects underscore ones if told to,
    as a Ray without them does (before starting anything)."""

    def __init__(self, *, takes_private: bool, error: str | None = None):
        self.calls: list[dict] = []
        self.takes_private = takes_private
        self.error = error

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if self.error:
            raise RuntimeError(self.error)
        unknown = [k for k in kwargs if k.startswith("_")]
        if unknown and not self.takes_private:
            raise RuntimeError(f"Unknown keyword argument(s): {', '.join(unknown)}")


def test_init_local_ray_passes_the_temp_dir_and_system_config():
    init = RecordingInit(takes_private=True)
    ray_private.init_local_ray(init, temp_dir="/tmp/x", system_config={"a": 0},
                               address="local", num_cpus=2)
    assert init.calls == [{"address": "local", "num_cpus": 2, "_temp_dir": "/tmp/x",
                           "_system_config": {"a": 0}}]


def test_init_local_ray_falls_back_to_the_public_arguments(caplog):
    init = RecordingInit(takes_private=False)
    with caplog.at_level("WARNING", logger="actors.private_api"):
        ray_private.init_local_ray(init, temp_dir="/tmp/x", system_config={}, address="local")
    assert init.calls[-1] == {"address": "local"}
    assert "takes neither _temp_dir nor _system_config" in caplog.text


def test_init_local_ray_reraises_other_errors():
    init = RecordingInit(takes_private=True, error="Ray has already been started")
    with pytest.raises(RuntimeError, match="already been started"):
        ray_private.init_local_ray(init, temp_dir="/tmp/x", system_config={})
    assert len(init.calls) == 1


def test_ray_init_of_this_ray_takes_the_underscore_arguments():
    # Ray pops them from ray.init's **kwargs: they are named in its source.
    import inspect

    import ray

    source = inspect.getsource(ray.init)
    assert '"_temp_dir"' in source and '"_system_config"' in source


def test_the_ray_logger_filtered_is_a_module_of_this_ray():
    assert importlib.util.find_spec(ray_private.ray_worker_logger().name) is not None


def test_no_coordination_client_without_joining():
    assert jax_private.coordination_client() is None
