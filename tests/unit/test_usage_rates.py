"""Rate card and per-second billing."""

import pytest

from sparkgpu.spec.catalog import GPU_CATALOG
from sparkgpu.errors import ConfigurationError
from sparkgpu.usage.ledger import UsageRecord
from sparkgpu.usage.rates import DEFAULT_RATES, RateCard, billed_seconds


def test_every_catalog_type_has_a_default_rate_and_cpu_ranks_are_free():
    assert set(DEFAULT_RATES) == set(GPU_CATALOG)
    assert RateCard().rate("cpu") == 0.0
    assert all(rate > 0 for name, rate in DEFAULT_RATES.items() if name != "cpu")


def test_billing_is_per_started_second():
    assert billed_seconds(100.0, 100.0) == 0
    assert billed_seconds(100.0, 100.2) == 1
    assert billed_seconds(100.0, 161.0) == 61
    assert billed_seconds(100.0, 161.2) == 62
    assert billed_seconds(200.0, 100.0) == 0  # a clock that went backwards bills nothing


def test_an_eight_gpu_attempt_is_priced_from_its_running_seconds():
    card = RateCard({"H100": 6.0})
    record = UsageRecord.priced(
        job_id="j",
        job_name="train",
        attempt=0,
        user="ana",
        tags={"team": "ml"},
        backend="local",
        gpu_type="H100",
        gpus=8,
        simulated=False,
        status="succeeded",
        started_at=1000.0,
        ended_at=1000.0 + 3599.5,
        rates=card,
    )
    assert record.gpu_seconds == 8 * 3600
    assert record.gpu_hours == 8.0
    assert record.cost_usd == pytest.approx(48.0)
    assert record.rate_usd_per_gpu_hour == 6.0
    assert record.duration_s == pytest.approx(3599.5)


def test_inline_card_overrides_some_types_and_keeps_the_rest():
    card = RateCard.parse("H100=5, a10g=1.5")
    assert card.rate("H100") == 5.0
    assert card.rate("A10") == 1.5  # aliases resolve to catalog names
    assert card.rate("L4") == DEFAULT_RATES["L4"]
    assert card.rate("gpu") == 0.0  # outside the catalog: the card's default


def test_card_from_toml_and_yaml_files(tmp_path):
    toml = tmp_path / "rates.toml"
    toml.write_text("default = 2.0\n[rates]\nH100 = 9.5\n")
    card = RateCard.parse(str(toml))
    assert card.rate("H100") == 9.5 and card.rate("some-new-gpu") == 2.0
    yaml = tmp_path / "rates.yaml"
    yaml.write_text("H200: 11\nA100: 3\n")
    card = RateCard.parse(yaml)
    assert card.rate("H200") == 11.0 and card.rate("A100-40GB") == 3.0


@pytest.mark.parametrize(
    "value, match",
    [
        ("H100=lots", "rate for 'H100'"),
        ("H100=5,A10", "'A10' is not TYPE=DOLLARS_PER_GPU_HOUR"),
        ({"H100": -1}, "number >= 0"),
        ("/no/such/rates.yaml", "cannot read rate card"),
    ],
)
def test_bad_cards_name_the_entry(value, match):
    with pytest.raises(ConfigurationError, match=match):
        RateCard.parse(value)
