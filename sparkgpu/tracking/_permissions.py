"""Turns MLflow's permission refusals into errors that say which permission is missing."""

from __future__ import annotations

import contextlib
import os

from sparkgpu.errors import PermissionDeniedError

__all__ = ["translate_permission_errors"]

_DENIED = ("PERMISSION_DENIED", "UNAUTHENTICATED")


def _refusal_kind(exc: BaseException) -> str | None:
    """``"PERMISSION_DENIED"`` / ``"UNAUTHENTICATED"`` for refusals, else ``None``.

    MLflow's REST client raises ``MlflowException`` with these error codes; its artifact
    client raises ``requests`` HTTP errors carrying the status code instead.
    """
    code = getattr(exc, "error_code", None)
    if code in _DENIED:
        return code
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return {403: "PERMISSION_DENIED", 401: "UNAUTHENTICATED"}.get(status) if isinstance(status, int) else None


@contextlib.contextmanager
def translate_permission_errors(doing: str, needs: str, tracking_uri: str):
    """Re-raises MLflow permission refusals as :class:`PermissionDeniedError`.

    Args:
        doing: What was being done, e.g. ``"create a new version of registered model 'a.b.c'"``.
        needs: The permission it takes, e.g. ``"EDIT permission on registered model 'a.b.c'"``.
        tracking_uri: The server that refused, for the message.

    Raises:
        PermissionDeniedError: the server refused the request.
    """
    try:
        yield
    except Exception as exc:
        kind = _refusal_kind(exc)
        if kind is None:
            raise
        user = os.environ.get("MLFLOW_TRACKING_USERNAME")
        who = f"user '{user}'" if user else "the current user"
        if kind == "UNAUTHENTICATED":
            raise PermissionDeniedError(
                f"{tracking_uri} did not let {who} {doing}: not authenticated. Set MLFLOW_TRACKING_USERNAME "
                "and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) for that server."
            ) from exc
        raise PermissionDeniedError(
            f"{who[0].upper() + who[1:]} may not {doing}: that needs {needs}, which {tracking_uri} refused. "
            "Ask an owner with MANAGE permission, or an admin, to grant it."
        ) from exc
