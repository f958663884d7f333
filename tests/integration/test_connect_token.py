"""Spark Connect with a token: the server the tests share requires one (Spark's pre-shared key,
``spark.connect.authenticate.token``), a client that sends it works and one that does not is
refused, and sparkgpu lets a job's key travel over such a channel."""

import pytest

from sparkgpu.launch.backends.spark.sessions import check_key_transport

pytestmark = [pytest.mark.integration, pytest.mark.spark]


def connect(endpoint: str, token: str | None):
    """A session of its own: neither the default nor the active one, and closed without
    ``stop()``, which would stop the in-process server every test shares."""
    from pyspark.sql.connect.client.core import DefaultChannelBuilder
    from pyspark.sql.connect.session import SparkSession

    url = f"sc://{endpoint}/" + (f";token={token}" if token else "")
    session = SparkSession(connection=DefaultChannelBuilder(url))
    session.client.set_retry_policies([])  # a refusal is final: no backing off for minutes
    return session


def test_a_client_needs_the_servers_token(spark, monkeypatch):
    from pyspark.errors import PySparkException

    builder = spark.client._builder
    token, endpoint = builder.token, builder.endpoint
    assert token  # the server was started with one
    # From here on the token is only what a URL gives: pyspark also reads it from this variable.
    monkeypatch.delenv("SPARK_CONNECT_AUTHENTICATE_TOKEN", raising=False)

    with_token = connect(endpoint, token)
    try:
        assert with_token.range(3).count() == 3
        check_key_transport(with_token, "job-1")  # a token: the key may travel
    finally:
        with_token.client.close()

    for wrong in (None, "not-the-token"):
        refused = connect(endpoint, wrong)
        try:
            with pytest.raises(PySparkException, match="(?i)unauthenticated|invalid authentication"):
                refused.range(3).count()
        finally:
            refused.client.close()
