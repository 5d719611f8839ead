"""The dataset registry: built-in presets, the user's file, and entries refused at load."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from mm_assets.registry import DatasetSpec, load_registry, parse_entries, user_registry_file

PRESETS = {
    "sharegpt4v_coco": "sharegpt4v",
    "sharegpt": "sharegpt",
    "ultrachat": "messages",
    "demo_sharegpt4v_coco": "sharegpt4v",
    "demo_sharegpt": "sharegpt",
    "demo_benchmark": "messages",
    "mt_bench": "prompts",
    "speculator_benchmarks": "prompts",
    "mmstar": "prompts",
}


def _user_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str) -> Path:
    path = tmp_path / "datasets.yaml"
    path.write_text(text)
    monkeypatch.setenv("MM_ASSETS_DATASETS", str(path))
    return path


def test_builtin_registry_has_the_presets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MM_ASSETS_DATASETS", str(tmp_path / "absent.yaml"))
    registry = load_registry()
    assert {name: spec.format for name, spec in registry.items()} == PRESETS
    coco = registry["sharegpt4v_coco"]
    assert (coco.hub, coco.subset, coco.path) == ("Lin-Chen/ShareGPT4V", "ShareGPT4V", None)
    assert coco.filter == {"image_prefix": "coco/"}
    assert (coco.max_samples, coco.image_path_strip_prefix) == (50000, "coco/")
    assert registry["ultrachat"].split == "train_sft"
    assert registry["demo_sharegpt"].hub is None
    assert registry["demo_sharegpt"].responses == registry["demo_sharegpt4v_coco"].responses
    assert registry["demo_sharegpt"].responses == "target" and coco.responses == "dataset"
    assert all(spec.name == name for name, spec in registry.items())


def test_session_user_registry_loads() -> None:
    """conftest's user file (set for the whole session) parses and adds its entries."""
    registry = load_registry()
    assert set(PRESETS) | {"bad_inputs", "demo_tampered", "auto_text", "demo_wrong_root"} <= set(
        registry
    )
    assert registry["bad_inputs"].min_image_availability == 0.0


def test_keyword_construction_defaults_and_frozen() -> None:
    spec = DatasetSpec(name="d", format="sharegpt", path="/data/d.jsonl")
    assert (spec.hub, spec.subset, spec.split, spec.filter) == (None, None, "train", {})
    assert (spec.image_root, spec.image_path_strip_prefix) == (None, "")
    assert (spec.max_samples, spec.seed, spec.min_image_availability) == (None, 0, 0.95)
    assert spec.resolved_path() == Path("/data/d.jsonl")
    with pytest.raises(ValidationError):
        spec.max_samples = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="format"):
        DatasetSpec(name="d", format="llava", path="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no local path"):
        DatasetSpec(name="h", format="sharegpt", hub="org/ds").resolved_path()


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        pytest.param(
            "path: x.json\n  format: sharegpt\n  max_sample: 10",
            ["unknown key 'max_sample'", "did you mean 'max_samples'", "known: hub, path"],
            id="unknown-key",
        ),
        pytest.param(
            "path: x.json\n  format: sharegpt\n  max_samples: lots",
            ["'max_samples'", "valid integer", "'lots'", "positive whole number"],
            id="wrong-type",
        ),
        pytest.param(
            "path: x.json\n  format: sharegpt\n  max_samples: 0",
            ["'max_samples'", "greater than 0"],
            id="not-positive",
        ),
        pytest.param(
            "path: x.json\n  format: sharegpt\n  min_image_availability: 1.5",
            ["'min_image_availability'", "less than or equal to 1", "0 to 1"],
            id="fraction-out-of-range",
        ),
        pytest.param(
            "path: x.json\n  format: llava",
            ["'format'", "'sharegpt4v', 'sharegpt', 'messages' or 'prompts'", "'llava'"],
            id="unknown-format",
        ),
        pytest.param(
            "path: x.json",
            ["'format' is required", "sharegpt4v, sharegpt, messages"],
            id="missing-format",
        ),
        pytest.param(
            "path: x.json\n  hub: org/ds\n  format: sharegpt",
            ["exactly one of 'hub'", "'path'", "both are given"],
            id="hub-and-path",
        ),
        pytest.param(
            "format: sharegpt",
            ["exactly one of 'hub'", "'path'", "neither is given"],
            id="neither-hub-nor-path",
        ),
        pytest.param(
            "path: x.json\n  format: sharegpt\n  filter: [image_prefix]",
            ["'filter'", "valid dictionary", "{filter name: argument}"],
            id="filter-not-a-mapping",
        ),
        pytest.param(
            "path: x.json\n  format: sharegpt\n  filter: {image_prefx: coco/}",
            ["'filter.image_prefx': unknown name 'image_prefx'", "filters: image_prefix"],
            id="unknown-filter",
        ),
        pytest.param(
            "path: x.json\n  format: sharegpt\n  filter: {image_prefix: [coco/]}",
            ["'filter.image_prefix'", "valid string", "filters: image_prefix"],
            id="filter-argument-type",
        ),
        pytest.param(
            "path: x.json\n  format: sharegpt\n  min_supervised_tokens: 0",
            ["'min_supervised_tokens'", "greater than or equal to 1", "positive whole"],
            id="min-supervised-tokens",
        ),
        pytest.param(
            "path: x.json\n  format: sharegpt\n  max_tokenization_quarantine_ratio: 1.5",
            ["'max_tokenization_quarantine_ratio'", "less than or equal to 1", "a fraction"],
            id="max-quarantine-ratio",
        ),
        pytest.param(
            "path: x.json\n  format: sharegpt\n  name: other",
            ["unknown key 'name'", "its key in the file"],
            id="name-key",
        ),
    ],
)
def test_bad_entry_is_refused_naming_file_entry_and_field(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, entry: str, expected: list[str]
) -> None:
    path = _user_file(monkeypatch, tmp_path, f"my_vqa:\n  {entry}\n")
    with pytest.raises(ValueError) as info:
        load_registry()
    message = str(info.value)
    assert message.startswith(f"{path}: dataset 'my_vqa': ")
    assert "\n" not in message  # one problem, one line
    for fragment in expected:
        assert fragment in message


def test_bad_name_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = _user_file(monkeypatch, tmp_path, "my vqa:\n  path: x.json\n  format: sharegpt\n")
    with pytest.raises(ValueError) as info:
        load_registry()
    message = str(info.value)
    assert message.startswith(f"{path}: dataset 'my vqa': 'name': ")
    assert "letters, digits, '_', '-' and '.'" in message


def test_a_dataset_name_that_would_leave_its_directory_is_refused_naming_it() -> None:
    entries = {n: {"path": "x.json", "format": "sharegpt"} for n in ("a/b", "../x", "a..b")}
    with pytest.raises(ValueError) as info:
        parse_entries(entries, "f.yaml")
    lines = str(info.value).splitlines()
    assert [line.split(": 'name'")[0] for line in lines] == [
        f"f.yaml: dataset {n!r}" for n in entries
    ]
    assert all("without '..'" in line for line in lines)


def test_every_problem_is_reported_one_per_line() -> None:
    entries = {
        "a": {"path": "x", "format": "sharegpt", "max_sample": 5, "seed": "s"},
        "b": {"hub": "org/b", "format": "text"},
        "ok": {"hub": "org/ok", "format": "messages"},
        "c": ["not", "a", "mapping"],
    }
    with pytest.raises(ValueError) as info:
        parse_entries(entries, "~/datasets.yaml")
    lines = str(info.value).splitlines()
    assert len(lines) == 4
    assert all(line.startswith("~/datasets.yaml: dataset ") for line in lines)
    assert any("'a': unknown key 'max_sample'" in line for line in lines)
    assert any("'a': 'seed': input should be a valid integer" in line for line in lines)
    assert any("'b': 'format': input should be" in line for line in lines)
    assert any("'c': expected a mapping of keys, got list" in line for line in lines)


def test_not_a_mapping_or_not_yaml_names_the_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = _user_file(monkeypatch, tmp_path, "- just\n- a list\n")
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: expected a mapping"):
        load_registry()
    path.write_text("my_vqa: {path: [unclosed\n")
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: not valid YAML"):
        load_registry()


def test_user_file_replaces_and_adds_entries(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _user_file(
        monkeypatch,
        tmp_path,
        """
sharegpt:
  hub: my-org/my_sharegpt
  format: sharegpt
  max_samples: 10
my_vqa:
  path: /data/vqa.jsonl
  format: sharegpt4v
  filter: {image_prefix: "coco/"}
  seed: 7
""",
    )
    registry = load_registry()
    assert set(registry) == set(PRESETS) | {"my_vqa"}
    replaced = registry["sharegpt"]
    assert (replaced.hub, replaced.max_samples, replaced.seed) == ("my-org/my_sharegpt", 10, 0)
    added = registry["my_vqa"]
    assert (added.format, added.seed, added.filter) == ("sharegpt4v", 7, {"image_prefix": "coco/"})
    assert registry["ultrachat"].hub == "HuggingFaceH4/ultrachat_200k"


def test_empty_user_file_keeps_the_builtins(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _user_file(monkeypatch, tmp_path, "# nothing yet\n")
    assert set(load_registry()) == set(PRESETS)


def test_user_file_defaults_under_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MM_ASSETS_DATASETS")
    monkeypatch.setenv("MM_ASSETS_HOME", str(tmp_path))
    assert user_registry_file() == tmp_path.resolve() / "datasets.yaml"


def test_vars_are_expanded_in_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("MM_ASSETS_HOME", str(home))
    monkeypatch.setenv("MY_IMAGES", str(tmp_path / "images"))
    monkeypatch.delenv("COCO_DIR", raising=False)
    _user_file(
        monkeypatch,
        tmp_path,
        """
mine:
  path: ${MM_ASSETS_HOME}/data/mine.jsonl
  format: sharegpt4v
  image_root: ${MY_IMAGES}/coco
""",
    )
    registry = load_registry()
    assert registry["mine"].path == "${MM_ASSETS_HOME}/data/mine.jsonl"  # expanded on use
    assert registry["mine"].resolved_path() == home / "data" / "mine.jsonl"
    assert registry["mine"].resolved_image_root() == (tmp_path / "images" / "coco").resolve()
    demo = registry["demo_sharegpt4v_coco"]
    assert demo.resolved_path() == home / "demo" / "data" / "sharegpt4v_coco.json"
    assert demo.resolved_image_root() == (home / "demo" / "coco").resolve()
    text_only = DatasetSpec(name="t", format="sharegpt", path="x")
    assert text_only.resolved_image_root() == (home / "coco").resolve()


def test_a_renamed_key_is_refused_with_its_new_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _user_file(
        monkeypatch, tmp_path, "d:\n  path: x\n  format: sharegpt\n  max_quarantine_ratio: 0.2\n"
    )
    with pytest.raises(ValueError, match="'max_quarantine_ratio' is now called "
                       "'max_tokenization_quarantine_ratio'"):  # fmt: skip
        load_registry()


def test_stage_settings_are_checked_against_the_stages_models() -> None:
    """An entry's `settings` are validated like launch config: the stage must exist, each
    key must be one of its settings (a typo is named with the closest), values are typed."""
    from mm_assets.services.settings import STAGE_SETTINGS

    good = {"path": "x", "format": "sharegpt", "settings": {
        "target_responses": {"max_tokens": 64},
        "trained_speculator": {"learning_rate": "3e-3", "vllm_prompts": 8},
    }}  # fmt: skip
    spec = parse_entries({"ok": good}, "f.yaml", STAGE_SETTINGS)["ok"]
    assert spec.settings["trained_speculator"] == {"learning_rate": "3e-3", "vllm_prompts": 8}
    bad = {"path": "x", "format": "sharegpt", "settings": {
        "trained_speculatr": {"epochs": 2},
        "target_responses": {"max_token": 64, "temperature": -1},
        "hidden_states": [1],
    }}  # fmt: skip
    with pytest.raises(ValueError) as info:
        parse_entries({"d": bad}, "f.yaml", STAGE_SETTINGS)
    lines = str(info.value).splitlines()
    assert len(lines) == 4 and all(line.startswith("f.yaml: dataset 'd': ") for line in lines)
    assert "'settings.trained_speculatr': unknown stage" in lines[0]
    assert "did you mean 'trained_speculator'" in lines[0]
    assert "unknown setting 'max_token' (did you mean 'max_tokens'?" in lines[1]
    assert (
        "'settings.target_responses.temperature': input should be greater than or equal to 0"
        in lines[2]
    )
    assert "'settings.hidden_states': expected a mapping of settings" in lines[3]
    # without the stages' models (a caller below the assets) only their shape is checked
    loose = {stage: values for stage, values in bad["settings"].items() if stage != "hidden_states"}
    assert parse_entries({"d": {**bad, "settings": loose}}, "f.yaml")["d"].settings == loose


def test_the_demo_entries_carry_the_demo_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`make demo`, the UI and the CLI read the same entry, so they train the same draft."""
    from mm_assets.services.settings import STAGE_SETTINGS

    monkeypatch.setenv("MM_ASSETS_DATASETS", str(tmp_path / "absent.yaml"))
    registry = load_registry(STAGE_SETTINGS)
    for name in ("demo_sharegpt4v_coco", "demo_sharegpt"):
        settings = registry[name].settings
        assert settings["target_responses"] == {"max_tokens": 96}
        assert settings["trained_speculator"] == {
            "learning_rate": 3e-3,
            "batch_tokens": 512,
            "measure_untrained_in_vllm": False,
            "vllm_max_tokens": 96,
        }
        assert settings["speculator_benchmark"] == {"max_tokens": 64, "max_prompts_per_category": 3}


def test_a_path_may_not_name_a_secrets_variable() -> None:
    """A path shows in metadata and logs: `${...KEY}` there would print the key."""
    for path in ("/data/${MM_ASSETS_VLLM_API_KEY}/d.jsonl", "${AWS_SECRET_ACCESS_KEY}/x"):
        with pytest.raises(ValueError, match="names a secret's variable"):
            DatasetSpec(name="d", path=path, format="sharegpt")
    with pytest.raises(ValueError, match="HF_TOKEN"):
        DatasetSpec(name="d", path="/d", image_root="${HF_TOKEN}", format="sharegpt")
    assert DatasetSpec(name="d", path="${MM_ASSETS_HOME}/d.jsonl", format="sharegpt")


def test_a_path_variable_holding_a_url_with_a_password_is_refused_when_resolved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`DATABASE_URL` is not named like a secret, but its password would print with the path."""
    monkeypatch.setenv("DATABASE_URL", "postgres://u:pw-s3cret@db.example/data")
    monkeypatch.setenv("DATA_DIR", "/data")
    spec = DatasetSpec(name="d", path="${DATABASE_URL}/d.jsonl", format="sharegpt")
    with pytest.raises(ValueError, match=r"\$\{DATABASE_URL\} holds a URL with a password") as info:
        spec.resolved_path()
    assert "pw-s3cret" not in str(info.value)
    plain = DatasetSpec(name="d", path="${DATA_DIR}/d.jsonl", format="sharegpt")
    assert plain.resolved_path() == Path("/data/d.jsonl")


def test_a_url_is_shown_without_its_password() -> None:
    from mm_assets.common.urls import shown_url

    assert shown_url("https://user:p%40ss@gw.example:8443/team-a/v1") == (
        "https://user:***@gw.example:8443/team-a/v1"
    )
    assert shown_url("postgres://u:p@ss@db/x") == "postgres://u:***@db/x"
    assert shown_url("mlflow+https://:token@host") == "mlflow+https://:***@host"
    for kept in ("http://h:8000/v1", "https://user@h/v1", "/data/x", "s3://b/p", "http://["):
        assert shown_url(kept) == kept


def test_the_fleets_passwords_are_not_in_the_engines_repr_or_description() -> None:
    from mm_assets.services.engine import VllmEngine

    engine = VllmEngine(("http://fleet:pw-s3cret@h:8000/v1", "http://h2/v1"), api_key="k")
    assert "pw-s3cret" not in repr(engine) and "pw-s3cret" not in engine.describe()
    assert engine.describe() == "http://fleet:***@h:8000/v1, http://h2/v1"
    assert "base_urls=('http://fleet:***@h:8000/v1', 'http://h2/v1')" in repr(engine)
    assert "connector='auto'" in repr(engine) and engine.base_urls[0].endswith("@h:8000/v1")


def test_the_engines_key_is_not_in_its_repr() -> None:
    from mm_assets.services.engine import VllmEngine

    engine = VllmEngine(("http://h:8000/v1",), api_key="s3cret-value")
    assert "s3cret-value" not in repr(engine) and engine.api_key == "s3cret-value"
