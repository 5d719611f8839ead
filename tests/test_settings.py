"""Settings declared once: the asset configs and the training CLI are generated from the
settings models, with the same names, defaults and bounds."""

from __future__ import annotations

import pydantic
import pytest

from mm_assets.assets.model import HiddenStatesConfig, SpeculatorConfig
from mm_assets.domain.model.hidden_states import ExtractionSettings
from mm_assets.domain.model.settings import SpeculatorSettings
from mm_assets.train import parser


@pytest.mark.parametrize(
    ("config", "settings"),
    [(SpeculatorConfig, SpeculatorSettings), (HiddenStatesConfig, ExtractionSettings)],
)
def test_asset_config_has_every_setting_with_its_default(config, settings) -> None:
    for name, info in settings.model_fields.items():
        assert config.model_fields[name].default == info.default, name
        assert config.model_fields[name].description == info.description, name


def test_asset_config_keeps_the_bounds() -> None:
    with pytest.raises(pydantic.ValidationError, match="epochs"):
        SpeculatorConfig(epochs=0)
    with pytest.raises(pydantic.ValidationError, match="held_out_fraction"):
        SpeculatorConfig(held_out_fraction=1.5)


def test_training_cli_options_are_the_settings() -> None:
    defaults = vars(parser().parse_args(["--partition", "p"]))
    assert {k: v for k, v in defaults.items() if k not in ("partition", "retrain")} == (
        SpeculatorSettings().model_dump()
    )
    args = parser().parse_args(
        ["--partition", "p", "--learning-rate", "0.01", "--layer-ids", "[2, 16, 29, 32]"]
    )
    settings = SpeculatorSettings(
        **{k: v for k, v in vars(args).items() if k not in ("partition", "retrain")}
    )
    assert settings.learning_rate == 0.01 and settings.layer_ids == [2, 16, 29, 32]
