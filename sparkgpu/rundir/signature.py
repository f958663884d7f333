"""The payload's signature: how the client signs a run dir and how every worker checks it.

``payload.sig`` is an HMAC-SHA256, under the job's key, of the SHA-256 of each signed file in
a fixed order: ``_air.py``, ``spec.json``, ``payload.pkl``, then the spec's ``signed_files``
sorted by name. :func:`verify_payload` is the one check, used by the node agent, the Spark
node task, the warm pool and the rank (through :meth:`RunDir.verify
<sparkgpu.rundir.directory.RunDir.verify>`), and by the generated ``_air.py`` before it runs a
shipped ``_hydrate.py``: there sparkgpu may not be importable yet, so this module uses the
standard library only and its text is copied into every ``_air.py``
(:func:`verifier_source`). That is also why it has no ``from __future__`` import, no
package-relative import and no exception class of its own.
"""

import hashlib
import hmac
import json
import os

__all__ = ["SIGNED_CORE", "SIGNATURE_FILE", "sign_payload", "verify_payload", "verifier_source"]

# The files every payload has, in the order they enter the signature.
SIGNED_CORE = ("_air.py", "spec.json", "payload.pkl")
SIGNATURE_FILE = "payload.sig"


def sign_payload(key, contents):
    """The signature of ``contents`` (bytes of each signed file, in signing order) under ``key``."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for data in contents:
        mac.update(hashlib.sha256(data).digest())
    return mac.hexdigest()


def verify_payload(run_dir, key):
    """Checks the signature of the payload in ``run_dir`` and returns what it covers.

    Each file is read once: callers run and unpickle exactly the bytes returned, never a file
    that may have changed on the staging store since.

    Args:
        run_dir: The job's run directory (a path).
        key: The job's key (bytes), or ``None``/empty when the worker got none.

    Returns:
        File name -> verified content (``_air.py``, ``spec.json``, ``payload.pkl`` and the
        spec's ``signed_files``), or ``None`` when there is no key, no signature, a missing
        file, or the files do not match the signature. Callers say why in their own terms.
    """
    if not key:
        return None
    files = {}
    try:
        for name in SIGNED_CORE:
            with open(os.path.join(run_dir, name), "rb") as f:
                files[name] = f.read()
        names = list(SIGNED_CORE) + sorted(json.loads(files["spec.json"]).get("signed_files", []))
        for name in names[len(SIGNED_CORE) :]:
            with open(os.path.join(run_dir, name), "rb") as f:
                files[name] = f.read()
        with open(os.path.join(run_dir, SIGNATURE_FILE), "rb") as f:
            signature = f.read().decode().strip()
    except (FileNotFoundError, ValueError, AttributeError, TypeError):
        return None  # a missing file; a spec, a list of names or a signature that does not parse
    expected = sign_payload(key, [files[name] for name in names])
    return files if signature and hmac.compare_digest(signature, expected) else None


def verifier_source():
    """This module's text, to paste into a generated ``_air.py`` (see the module docstring)."""
    with open(__file__, encoding="utf-8") as f:
        return f.read()
