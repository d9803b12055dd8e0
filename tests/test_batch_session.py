"""A local Ray that `ingest-batch` starts leaves no session dir behind (issue 29, case 10). Its own module:
tests/test_batch.py holds one Ray for all its tests, and this one starts and stops its own."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
pytestmark = pytest.mark.xdist_group("ray")


@needs_ray
def test_a_local_ray_leaves_no_session_dir():
    import ray

    from kvchat.ingest.batch import ray_session

    if ray.is_initialized():
        pytest.skip("a Ray of this process is running")
    before = set(Path("/tmp").glob("kvchat-ray-*"))
    with ray_session(ray, None):
        made = set(Path("/tmp").glob("kvchat-ray-*")) - before
        assert len(made) == 1 and any(next(iter(made)).glob("session_*"))  # Ray's session is in it
    assert not any(p.exists() for p in made)
