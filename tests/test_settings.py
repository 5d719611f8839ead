"""Settings declared once: the asset configs and the training CLI are generated from the
settings models, with the same names, defaults and bounds."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import dagster as dg
import pydantic
import pytest

from mm_assets.assets.benchmarks import BenchmarkConfig
from mm_assets.assets.config import stage_settings
from mm_assets.assets.model import HiddenStatesConfig, SpeculatorConfig
from mm_assets.assets.prep import TokenizationConfig
from mm_assets.assets.resources import StorageResource, VllmResource
from mm_assets.assets.responses import ResponsesConfig
from mm_assets.clients.vllm_server import EngineOptions
from mm_assets.domain.model.settings import OnlineSettings, SpeculatorSettings
from mm_assets.registry import DatasetSpec, DraftSpec, parse_entries
from mm_assets.services.settings import STAGE_SETTINGS, resolve
from mm_assets.train import parser

CONFIGS = {
    "tokenized_samples": TokenizationConfig,
    "target_responses": ResponsesConfig,
    "hidden_states": HiddenStatesConfig,
    "trained_speculator": SpeculatorConfig,
    "speculator_benchmark": BenchmarkConfig,
}


@pytest.mark.parametrize("stage", sorted(STAGE_SETTINGS))
def test_asset_config_has_every_setting_with_its_default(stage: str) -> None:
    config = CONFIGS[stage]
    for settings in STAGE_SETTINGS[stage]:
        for name, info in settings.model_fields.items():
            assert config.model_fields[name].default == info.default, name
            where = f" (registry entry: settings.{stage}.{name})"
            assert config.model_fields[name].description == info.description + where, name


def test_the_vllm_resource_has_every_engine_option_with_its_default() -> None:
    for name, info in EngineOptions.model_fields.items():
        assert VllmResource.model_fields[name].default == info.default, name
        assert VllmResource.model_fields[name].description == info.description, name
    options = VllmResource(dtype="float32", kv_cache_gib=1.0).engine().options
    assert options == EngineOptions(dtype="float32", kv_cache_gib=1.0)


def test_the_api_key_is_read_when_the_step_runs_never_kept_in_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The resource is built (as the code location loads) before the key is set; the
    step still serves with it, and the resource's config never holds it."""
    monkeypatch.delenv("MM_ASSETS_VLLM_API_KEY", raising=False)
    resource = VllmResource()
    monkeypatch.setenv("MM_ASSETS_VLLM_API_KEY", "s3cret")
    assert "s3cret" not in repr(resource) and "s3cret" not in str(resource.model_dump())
    seen: dict[str, str] = {}

    @dg.asset
    def probe(vllm: VllmResource) -> None:
        seen["key"] = vllm.engine().api_key

    assert dg.materialize([probe], resources={"vllm": resource}).success
    assert seen["key"] == "s3cret"
    monkeypatch.delenv("MM_ASSETS_VLLM_API_KEY")
    assert VllmResource().engine().api_key == "EMPTY"


def test_the_storage_root_and_fleet_are_the_environment_of_the_step(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    storage, vllm = StorageResource(), VllmResource()  # built before the variables are set
    monkeypatch.setenv("MM_ASSETS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MM_ASSETS_VLLM_URLS", "http://a:8000/v1, http://b:8000/v1")
    assert storage.root_dir() == tmp_path / "home" and storage.tables().root == tmp_path / "home"
    assert vllm.engine().base_urls == ("http://a:8000/v1", "http://b:8000/v1")
    assert vllm.engine("responses").managed
    assert StorageResource(root=str(tmp_path / "mine")).root_dir() == tmp_path / "mine"


def _settings_seen(spec: DatasetSpec, run_config: dict[str, Any]) -> SpeculatorSettings:
    """What a real asset step reads as its settings, for this entry and launch config."""
    seen: list[SpeculatorSettings] = []

    def step(context: dg.AssetExecutionContext, config: Any) -> None:
        seen.append(stage_settings(context, spec, "trained_speculator", SpeculatorSettings))

    # the real config class (this module's annotations are strings Dagster cannot resolve)
    step.__annotations__ |= {"context": dg.AssetExecutionContext, "config": SpeculatorConfig}
    asset = dg.asset(name="trained_speculator")(step)
    assert dg.materialize([asset], run_config=run_config).success
    return seen[0]


def test_settings_come_from_the_entry_unless_the_launch_sets_them() -> None:
    """Defaults, then the registry entry, then only the keys a launch set — even a launch
    that sets a key to its default value overrides the entry."""
    spec = DatasetSpec(
        name="d", path="x", format="sharegpt",
        settings={"trained_speculator": {"learning_rate": 3e-3, "batch_tokens": 512}},
    )  # fmt: skip
    plain = _settings_seen(spec, {})
    assert (plain.learning_rate, plain.batch_tokens, plain.epochs) == (3e-3, 512, 8)
    launched = {"ops": {"trained_speculator": {"config": {"batch_tokens": 1024, "epochs": 2}}}}
    both = _settings_seen(spec, launched)
    assert (both.learning_rate, both.batch_tokens, both.epochs) == (3e-3, 1024, 2)
    bare = _settings_seen(DatasetSpec(name="e", path="x", format="sharegpt"), {})
    assert bare == SpeculatorSettings()


def test_asset_config_keeps_the_bounds() -> None:
    with pytest.raises(pydantic.ValidationError, match="epochs"):
        SpeculatorConfig(epochs=0)
    with pytest.raises(pydantic.ValidationError, match="held_out_fraction"):
        SpeculatorConfig(held_out_fraction=1.5)


@pytest.mark.parametrize(
    ("config", "field", "value"),
    [
        (SpeculatorConfig, "learning_rate", math.inf),
        (SpeculatorConfig, "noise_std", math.inf),
        (ResponsesConfig, "temperature", math.inf),
        (ResponsesConfig, "request_timeout_s", math.inf),
        (VllmResource, "kv_cache_gib", math.inf),
        (VllmResource, "startup_timeout_s", math.inf),
        (HiddenStatesConfig, "concurrency", 10**6),
        (ResponsesConfig, "max_retries", 10**4),
        (BenchmarkConfig, "concurrency", 1025),
        (ResponsesConfig, "breaker_failures", 10**6),
        (SpeculatorConfig, "prefetch_batches", 10**6),
    ],
)
def test_floats_are_finite_and_counts_have_a_ceiling(config: Any, field: str, value: Any) -> None:
    """`inf` as a cache size or a timeout fails later as an OverflowError; a million
    requests in flight or retries exhaust memory or never give up: refused, naming the field."""
    with pytest.raises(pydantic.ValidationError, match=field):
        config(**{field: value})


def test_a_registry_entry_cannot_set_an_unbounded_value() -> None:
    settings = {"target_responses": {"concurrency": 10**9, "top_p": math.nan}}
    with pytest.raises(ValueError) as info:
        parse_entries(
            {"d": {"path": "x", "format": "sharegpt", "settings": settings}},
            "f.yaml",
            STAGE_SETTINGS,
        )
    text = str(info.value)
    where = "f.yaml: dataset 'd': 'settings.target_responses."
    assert f"{where}concurrency': input should be less than or equal to 1024" in text
    assert f"{where}top_p': input should be a finite number, got nan" in text


def test_training_cli_options_are_the_settings() -> None:
    """One option per field of the training settings; a value not given comes from the
    registry entry, then the default, as for the asset."""
    help_text = parser().format_help()
    for model in (SpeculatorSettings, OnlineSettings):
        for name in model.model_fields:
            assert f"--{name.replace('_', '-')}" in help_text
    given = vars(
        parser().parse_args(["--partition", "p", "--learning-rate", "0.01", "--hidden-states",
                             "online"])
    )  # fmt: skip
    assert given == {"partition": "p", "retrain": False, "learning_rate": 0.01,
                     "hidden_states": "online"}  # fmt: skip
    given.pop("partition"), given.pop("retrain")
    entry = {"trained_speculator": {"learning_rate": 3e-3, "batch_tokens": 512}}
    draft = DraftSpec(name="p", sources={"p": {}}, settings=entry)
    settings = resolve(draft, "trained_speculator", SpeculatorSettings, given)
    online = resolve(draft, "trained_speculator", OnlineSettings, given)
    assert (settings.learning_rate, settings.batch_tokens, settings.epochs) == (0.01, 512, 8)
    assert (online.hidden_states, online.online_cache) == ("online", "keep")
    with pytest.raises(SystemExit):
        parser().parse_args(["--partition", "p", "--online-cache", "sometimes"])


def test_layer_ids_are_a_setting_of_hidden_states_only() -> None:
    """Training reads the ids its states were generated with; choosing them again there
    could only disagree."""
    assert "layer_ids" not in SpeculatorSettings.model_fields
    with pytest.raises(SystemExit):
        parser().parse_args(["--partition", "p", "--layer-ids", "[2, 16, 29, 32]"])
    with pytest.raises(pydantic.ValidationError, match="layer_ids"):
        HiddenStatesConfig(layer_ids=[2, 4, 8])


def test_a_target_trusted_with_its_code_is_served_with_it() -> None:
    """`trust_remote_code` reaches the managed vLLM server as it reaches the processor."""
    from mm_assets.services.target import TargetModel

    trusted = VllmResource().engine("responses", TargetModel("/m", trust_remote_code=True))
    assert "--trust-remote-code" in trusted.options.extra_args
    assert (
        "--trust-remote-code"
        not in VllmResource().engine("responses", TargetModel("/m")).options.extra_args
    )
