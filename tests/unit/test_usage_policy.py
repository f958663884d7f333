"""Usage policies: parsing, refusal before launch, budgets over rolling windows."""

import time

import pytest

from sparkgpu.errors import ConfigurationError, PolicyViolationError
from sparkgpu.spec import JobSpec, Resources, RunPolicy
from sparkgpu.usage.ledger import UsageLedger, UsageRecord
from sparkgpu.usage.meter import UsageMeter, enforce_policy
from sparkgpu.usage.policy import Budget, UsagePolicy
from sparkgpu.usage.rates import RateCard

NOW = time.time()


def job(gpus=2, gpu_type="A10", tags=None, max_runtime=None, name="train"):
    return JobSpec(
        job_id=f"{name}-1",
        name=name,
        resources=Resources(gpus, gpu_type),
        policy=RunPolicy(max_runtime=max_runtime),
        tags=tags if tags is not None else {"team": "ml"},
    )


def spend(ledger, gpu_hours, *, tags=None, user="ana", hours_ago=1.0, gpu_type="A10", gpus=1):
    end = NOW - hours_ago * 3600
    ledger.append(
        [
            UsageRecord.priced(
                job_id=f"past-{time.monotonic_ns()}",
                job_name="past",
                attempt=0,
                user=user,
                tags=tags if tags is not None else {"team": "ml"},
                backend="local",
                gpu_type=gpu_type,
                gpus=gpus,
                simulated=False,
                status="succeeded",
                started_at=end - gpu_hours / gpus * 3600,
                ended_at=end,
                rates=RateCard({"A10": 2.0}),
            )
        ]
    )


POLICY_YAML = """
name: ml-platform
allowed_gpu_types: [A10, H100]
max_gpus_per_job: 8
max_runtime: 7d
required_tags: [team]
budgets:
  team=ml: 100 GPU-hours per 30d
  team=ml,project=ctr: ["$50 per 7d", "2 GPU-hours per 1d"]
  "*": 5000 gpu-h / 30d
"""


def test_a_yaml_policy_reads_every_rule(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY_YAML)
    policy = UsagePolicy.from_file(path)
    assert policy.name == "ml-platform"
    assert policy.allowed_gpu_types == ("A10", "H100") and policy.max_gpus_per_job == 8
    assert policy.max_runtime == 7 * 86400 and policy.required_tags == ("team",)
    assert [b.label for b in policy.budgets] == [
        "team=ml: 100 GPU-hours per 30d",
        "team=ml,project=ctr: $50 per 7d",
        "team=ml,project=ctr: 2 GPU-hours per 1d",
        "*: 5000 GPU-hours per 30d",
    ]


def test_the_same_policy_in_toml(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text('name = "p"\nmax_gpus_per_job = 4\n[budgets]\n"user=bob" = "10 GPU-hours per 7d"\n')
    policy = UsagePolicy.from_file(path)
    assert policy.max_gpus_per_job == 4 and policy.budgets == (Budget({"user": "bob"}, 10.0, "gpu_hours", "7d"),)


@pytest.mark.parametrize(
    "data, match",
    [
        ({"max_gpu": 8}, r"unknown key\(s\) \['max_gpu'\]"),
        ({"allowed_gpu_types": ["V100"]}, "unknown gpu_type 'V100'"),
        ({"max_gpus_per_job": 0}, "max_gpus_per_job must be a positive integer"),
        ({"max_runtime": "forever"}, "max_runtime='forever' is not a duration"),
        ({"budgets": {"team=ml": "100 per 30d"}}, "has no unit"),
        ({"budgets": {"team=ml": "lots"}}, "not a budget; write e.g. '100 GPU-hours per 30d'"),
        ({"budgets": {"team": "1 GPU-hours per 1d"}}, "'team' is not key=value"),
        ({"budgets": ["team=ml: 1 GPU-hours per 1d"]}, "'budgets' must map a selector"),
    ],
)
def test_invalid_policies_name_the_rule(data, match):
    with pytest.raises(ConfigurationError, match=match):
        UsagePolicy.from_dict(data)


def test_a_missing_policy_file_says_which_setting_to_fix(tmp_path):
    with pytest.raises(ConfigurationError, match="SPARKGPU_USAGE_POLICY"):
        UsagePolicy.from_file(tmp_path / "absent.yaml")


def test_every_broken_rule_is_listed_with_its_numbers():
    policy = UsagePolicy(
        name="ml-platform",
        allowed_gpu_types=("A10",),
        max_gpus_per_job=4,
        max_runtime="1d",
        required_tags=("team", "project"),
    )
    with pytest.raises(PolicyViolationError) as err:
        policy.check_launch(job(8, "H100", {"team": "ml"}, max_runtime="7d"), user="ana")
    message = str(err.value)
    assert "refused by 'ml-platform' before launch" in message
    assert "gpu_type 'H100' is not allowed (allowed: A10)" in message
    assert "8 GPUs asked for, at most 4 per job" in message
    assert "max_runtime 7d exceeds the limit of 1d" in message
    assert "required tag(s) project missing" in message and "--tag project=..." in message


def test_a_job_within_the_rules_passes():
    policy = UsagePolicy(allowed_gpu_types=("A10",), max_gpus_per_job=4, max_runtime="1d", required_tags=("team",))
    policy.check_launch(job(4, "A10", {"team": "ml"}, max_runtime="12h"), user="ana")
    policy.check_launch(
        job(1, "A10", {"team": "ml"}), user="ana"
    )  # no cap asked: the runtime limit applies while it runs


def test_a_spent_budget_refuses_the_launch_and_counts_only_matching_usage(tmp_path):
    ledger = UsageLedger(str(tmp_path / "ledger"))
    policy = UsagePolicy.from_dict({"name": "p", "budgets": {"team=ml": "10 GPU-hours per 1d"}})
    spend(ledger, 6.0)
    spend(ledger, 50.0, tags={"team": "cv"})  # another team
    spend(ledger, 50.0, hours_ago=30)  # outside the window
    policy.check_launch(job(), "ana", ledger)  # 6 of 10 used: allowed
    spend(ledger, 4.0)
    with pytest.raises(
        PolicyViolationError,
        match=r"budget 'team=ml: 10 GPU-hours per 1d' is spent: "
        r"10.00 GPU-hours of 10.00 GPU-hours used in the last 1d",
    ):
        policy.check_launch(job(), "ana", ledger)
    policy.check_launch(job(tags={"team": "cv"}), "ana", ledger)  # the budget is not theirs


def test_dollar_budgets_and_user_selectors(tmp_path):
    ledger = UsageLedger(str(tmp_path / "ledger"))
    policy = UsagePolicy.from_dict({"budgets": {"user=bob": "$10 per 7d"}})
    spend(ledger, 5.0, user="bob")  # 5 A10-hours at $2
    with pytest.raises(PolicyViolationError, match=r"\$10.00 of \$10.00"):
        policy.check_launch(job(), "bob", ledger)
    policy.check_launch(job(), "ana", ledger)


def test_enforce_policy_uses_the_meter_policy_or_the_setting(tmp_path, monkeypatch):
    from sparkgpu.config import reset_settings

    strict = UsagePolicy(name="strict", max_gpus_per_job=1)
    with pytest.raises(PolicyViolationError, match="'strict'"):
        enforce_policy(job(2), [UsageMeter(str(tmp_path / "ledger"), policy=strict)])
    enforce_policy(job(2), [])  # no meter, no setting: nothing to enforce

    path = tmp_path / "policy.yaml"
    path.write_text("name: from-settings\nmax_gpus_per_job: 1\n")
    monkeypatch.setenv("SPARKGPU_USAGE_POLICY", str(path))
    reset_settings()
    with pytest.raises(PolicyViolationError, match="'from-settings'"):
        enforce_policy(job(2), [])  # passing no callbacks does not skip the policy
    enforce_policy(job(2), [UsageMeter(str(tmp_path / "ledger"), policy=False)])
