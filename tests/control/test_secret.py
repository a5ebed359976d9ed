"""Where a group's secret comes from, on the driver and in the job's actors."""

from __future__ import annotations

import pytest

import weightsync as ws
from weightsync.control.group import resolve_secret


def test_the_driver_takes_the_secret_its_jobs_actors_see(ray_cluster, monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    # The driver's shell exports one WEIGHTSYNC_SECRET and ray.init(runtime_env=...) hands the job's
    # actors another: the actors can only see the runtime_env's, so the driver must use that one too, or
    # every join is refused as a wrong secret.
    job = ray_cluster.get_runtime_context().runtime_env["env_vars"]["WEIGHTSYNC_SECRET"]
    monkeypatch.setenv("WEIGHTSYNC_SECRET", "a-different-secret-from-the-shell")

    @ray_cluster.remote(num_cpus=0)
    def seen_by_an_actor() -> str | None:
        return resolve_secret("secret-precedence", None)

    assert ray_cluster.get(seen_by_an_actor.remote()) == job
    group = ws.Group.create("secret-precedence", num_sources=1, num_destinations=1)
    try:
        assert group.secret == job
    finally:
        group.shutdown()
