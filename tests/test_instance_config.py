"""Every entry point runs in the repo's instance config (`dagster.yaml`: the accelerator
pool's limit, run monitoring), also in a `DAGSTER_HOME` that starts without one: `make
demo` once ran in such a home with neither."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
import yaml

from mm_assets.common import paths

REPO = Path(__file__).resolve().parents[1]
COMMITTED = yaml.safe_load((REPO / "dagster.yaml").read_text())


class _Stop(Exception):
    pass


def test_the_demo_runs_with_the_pool_limit_and_run_monitoring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m mm_assets.demo run` (what `make demo` runs) in a fresh home, stopped
    where it launches its first run: that run's instance has the committed settings."""
    from mm_assets.demo import __main__ as demo

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "fresh_home"))
    monkeypatch.setattr(demo, "build", lambda *args, **kwargs: tmp_path)
    launched: list[dg.DagsterInstance] = []

    def launch(job: dg.JobDefinition, *args: object, **kwargs: object) -> None:
        launched.append(kwargs["instance"])  # type: ignore[arg-type]
        raise _Stop

    monkeypatch.setattr(dg.JobDefinition, "execute_in_process", launch)
    with pytest.raises(_Stop):
        demo.run()
    (instance,) = launched
    assert instance.root_directory == str(tmp_path / "fresh_home")
    pools = COMMITTED["concurrency"]["pools"]["default_limit"]
    assert instance.get_concurrency_config().pool_config.default_pool_limit == pools == 1
    assert instance.run_monitoring_enabled
    settings = instance.run_monitoring_settings
    assert settings["free_slots_after_run_end_seconds"] == 30
    assert settings == COMMITTED["run_monitoring"]


def test_a_home_gets_the_committed_config_once_and_keeps_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    assert paths.ensure_dagster_home() == home
    assert (home / "dagster.yaml").read_text() == (REPO / "dagster.yaml").read_text()
    assert [p.name for p in home.iterdir()] == ["dagster.yaml"]  # nothing staged left over
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    paths.ensure_dagster_home()
    assert (home / "dagster.yaml").read_text() == "telemetry:\n  enabled: false\n"


def test_the_packaged_config_is_the_repos() -> None:
    """The installed package reads it (`mm_assets/dagster.yaml` links to the repo's)."""
    assert paths.instance_config() == (REPO / "dagster.yaml").read_text()
