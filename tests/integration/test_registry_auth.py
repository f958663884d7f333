"""Registry refusals from a real ``mlflow server --app-name basic-auth`` name the missing permission."""

from __future__ import annotations

import importlib.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from sparkgpu.errors import PermissionDeniedError
from sparkgpu.tracking import registry

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("flask_wtf") is None, reason="MLflow's basic-auth app needs `pip install mlflow[auth]`"
    ),
]

ADMIN_PASSWORD = "admin-" + secrets.token_hex(8)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
            return response.status == 200
    except OSError:  # not listening yet
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth-server")
    config = root / "basic_auth.ini"
    config.write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{root}/basic_auth.db\n"
        f"admin_username = admin\nadmin_password = {ADMIN_PASSWORD}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    port = _free_port()
    env = {
        **os.environ,
        "MLFLOW_AUTH_CONFIG_PATH": str(config),
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
        # The server's job runner (a dozen consumer processes, each importing MLflow) serves
        # none of what is tested here and took most of the module's CPU.
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    log = open(root / "server.log", "w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--app-name",
            "basic-auth",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{root}/mlflow.db",
            "--default-artifact-root",
            (root / "artifacts").as_uri(),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its workers in one group
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _healthy(uri):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start:\n{(root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()


def as_user(monkeypatch, username, password):
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", username)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)


@pytest.fixture(scope="module")
def users(server):
    from mlflow.server import get_app_client

    os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = "admin", ADMIN_PASSWORD
    try:
        auth = get_app_client("basic-auth", tracking_uri=server)
        passwords = {name: f"{name}-{secrets.token_hex(6)}" for name in ("alice", "bob")}
        for name, password in passwords.items():
            auth.create_user(name, password)
    finally:
        del os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]
    return passwords


def test_missing_permissions_are_named(server, users, monkeypatch):
    from mlflow import MlflowClient

    model = torch.nn.Linear(3, 1)
    as_user(monkeypatch, "alice", users["alice"])
    owned = registry.register(model, "main.ml.guarded", alias="champion", tracking_uri=server)
    assert owned.version == 1

    as_user(monkeypatch, "bob", users["bob"])
    assert [v.version for v in registry.versions("main.ml.guarded", tracking_uri=server)] == [1]  # READ by default
    bobs_experiment = MlflowClient(server).create_experiment("bob-experiments")
    bobs_run = MlflowClient(server).create_run(bobs_experiment).info.run_id
    with pytest.raises(PermissionDeniedError) as refused:
        registry.register(model, "main.ml.guarded", run_id=bobs_run, tracking_uri=server)
    message = str(refused.value)
    assert "User 'bob'" in message and "create a new version of registered model 'main.ml.guarded'" in message
    assert "EDIT permission on registered model 'main.ml.guarded'" in message
    with pytest.raises(PermissionDeniedError, match="MANAGE permission on registered model 'main.ml.guarded'"):
        registry.delete_alias("main.ml.guarded", "champion", tracking_uri=server)


def test_wrong_credentials_say_how_to_authenticate(server, users, monkeypatch):
    as_user(monkeypatch, "bob", "not-his-password")
    with pytest.raises(PermissionDeniedError, match="MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"):
        registry.versions("main.ml.guarded", tracking_uri=server)
