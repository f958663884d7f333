"""Three-level model names: Unity Catalog's rules, completion, references, store encoding."""

from __future__ import annotations

import types

import pytest

from sparkgpu.config import reset_settings
from sparkgpu.errors import ConfigurationError
from sparkgpu.tracking.names import (
    ModelName,
    decode_from_store,
    encode_for_store,
    parse_model_name,
    parse_model_ref,
    validate_alias,
)


@pytest.fixture(autouse=True)
def _no_active_spark_session(monkeypatch):
    """Completion from settings is what a process without a Spark session gets; an earlier
    test's session must not leak into these."""
    monkeypatch.setattr("sparkgpu.tracking.names._active_spark_session", lambda: None)


def test_three_level_name_is_kept_as_given():
    name = parse_model_name("main.ml.ctr")
    assert (name.catalog, name.schema, name.model, name.completed_from) == ("main", "ml", "ctr", "name")
    assert str(name) == "main.ml.ctr"


def test_short_names_are_completed_from_settings_without_spark(monkeypatch):
    monkeypatch.setenv("SPARKGPU_REGISTRY_CATALOG", "prod")
    monkeypatch.setenv("SPARKGPU_REGISTRY_SCHEMA", "models")
    reset_settings()
    one = parse_model_name("ctr")
    two = parse_model_name("ml.ctr")
    assert str(one) == "prod.models.ctr" and one.completed_from == "settings"
    assert str(two) == "prod.ml.ctr"


def test_default_settings_complete_to_main_default():
    assert str(parse_model_name("ctr")) == "main.default.ctr"


def test_short_names_are_completed_from_a_given_session():
    catalog = types.SimpleNamespace(currentCatalog=lambda: "spark_catalog", currentDatabase=lambda: "feats")
    session = types.SimpleNamespace(catalog=catalog)
    name = parse_model_name("ctr", spark=session)
    assert str(name) == "spark_catalog.feats.ctr" and name.completed_from == "spark session"


@pytest.mark.parametrize(
    "bad, rule, suggestion",
    [
        ("Main.ml.ctr", "uppercase", "'main.ml.ctr'"),
        ("main.ml.click model", "space", "'main.ml.click_model'"),
        ("main.ml.ctr\x07", "control character", "'main.ml.ctr_'"),
        ("main.ml." + "m" * 256, "255", "'main.ml." + "m" * 255 + "'"),
        ("main.ml.ctr.v2", "at most three", "'main.ml.ctr_v2'"),
    ],
)
def test_rule_violations_name_the_rule_and_a_fix(bad, rule, suggestion):
    with pytest.raises(ConfigurationError) as info:
        parse_model_name(bad)
    assert rule in str(info.value)
    assert suggestion in str(info.value)


def test_slash_in_a_level_is_refused():
    # A slash in the model level would be read as a version separator in references, so
    # the check happens on names given directly.
    with pytest.raises(ConfigurationError, match="forward slash"):
        parse_model_name("main.ml/x.ctr")


def test_empty_level_is_refused():
    with pytest.raises(ConfigurationError, match="empty schema level"):
        parse_model_name("main..ctr")


def test_name_must_be_a_string():
    with pytest.raises(ConfigurationError, match="main.ml.ctr"):
        parse_model_name(None)


def test_references_with_version_alias_and_models_prefix():
    assert parse_model_ref("main.ml.ctr/3").version == 3
    ref = parse_model_ref("models:/main.ml.ctr@champion")
    assert (str(ref.name), ref.alias, ref.version) == ("main.ml.ctr", "champion", None)
    latest = parse_model_ref("main.ml.ctr")
    assert latest.version is None and latest.alias is None
    assert str(parse_model_ref("ctr@prod")) == "main.default.ctr@prod"


@pytest.mark.parametrize("bad", ["main.ml.ctr/0", "main.ml.ctr/three", "main.ml.ctr/-1"])
def test_bad_versions_are_refused(bad):
    with pytest.raises(ConfigurationError, match="positive integer"):
        parse_model_ref(bad)


@pytest.mark.parametrize("alias", ["latest", "v3", "has space", ""])
def test_bad_aliases_are_refused(alias):
    with pytest.raises(ConfigurationError, match="alias"):
        validate_alias(alias)


def test_good_alias_passes():
    assert validate_alias("champion-2") == "champion-2"


def test_store_encoding_round_trips_characters_mlflow_refuses():
    name = ModelName("main", "ml", "ctr:v1@eu%")
    stored = encode_for_store(name, unity_catalog=False)
    assert ":" not in stored and "@" not in stored
    assert stored.startswith("main.ml.ctr")
    assert decode_from_store(stored) == "main.ml.ctr:v1@eu%"


def test_plain_names_are_stored_readable_and_unity_catalog_gets_them_unchanged():
    name = ModelName("main", "ml", "ctr")
    assert encode_for_store(name, unity_catalog=False) == "main.ml.ctr"
    odd = ModelName("main", "ml", "a:b")
    assert encode_for_store(odd, unity_catalog=True) == "main.ml.a:b"
