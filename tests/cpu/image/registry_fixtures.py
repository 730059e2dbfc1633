"""Fixtures of the tests that push to a registry (test_image.py, test_attest.py): import them
into the test module (`from tests.cpu.image.registry_fixtures import isolated_env, registry`)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tools.image import push as oci_push
from tools.image import local_registry
from tools.image import registry_client

EPOCH = 1700000000


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No user credentials, keys or caches leak in; skopeo's temp files stay under tmp_path."""
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setenv("KIMI_K3_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SOURCE_DATE_EPOCH", str(EPOCH))
    for var in ("REGISTRY_AUTH_FILE", "XDG_RUNTIME_DIR", "XDG_CACHE_HOME", registry_client.USER_ENV, registry_client.PASSWORD_ENV,
                oci_push.SIGN_KEY_ENV, oci_push.SIGN_PASSPHRASE_ENV):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[local_registry.RegistryProcess]:
    """Debian's docker-registry on 127.0.0.1, storage under tmp_path/registry."""
    reg = local_registry.start_registry(tmp_path / "registry")
    yield reg
    local_registry.stop_registry(reg)
