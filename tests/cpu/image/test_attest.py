"""The signed, attested image (tools/image/attest.py, signing.py, verify.py, image_sbom.py) on
Debian's docker-registry on 127.0.0.1, with skopeo from the sealed root and a key pair generated
per test (skopeo generate-sigstore-key).

Tiny images stand in for the real one: the attachments, the signature and `verify` do not look
inside the layers, and the real image's SBOM has its own test (test_image_sbom.py).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.cpu.image.registry_fixtures import isolated_env, registry  # noqa: F401 (fixtures)
from tools.common.errors import UserError, run_cli
from tools.image import attest, signing, verify
from tools.image import image_sbom
from tools.image import layer as oci_layer
from tools.image import layout as oci_image
from tools.image import push as oci_push
from tools.image import image_contents
from tools.image import local_registry
from tools.image import registry_client

REPO_ROOT = Path(__file__).resolve().parents[3]
EPOCH = 1700000000
PATH = "kimi-k3/tiny"


def tiny_layout(work: Path, text: str) -> Path:
    tree = work / "tree"
    (tree / "tiny").mkdir(parents=True)
    (tree / "tiny" / "__init__.py").write_text(text)
    blob, desc = work / "l.tar.zst", work / "l.json"
    assert oci_layer.main(["--name", "tiny", "--out", str(blob), "--descriptor", str(desc),
                           "--site-tree", str(tree), "--source-date-epoch", str(EPOCH)]) == 0
    assert oci_image.main(["--out", str(work / "layout"), "--layer", str(desc), str(blob),
                           "--source-date-epoch", str(EPOCH)]) == 0
    return work / "layout"


def key_pair(tmp_path: Path, name: str) -> attest.Signer:
    passphrase = tmp_path / f"{name}.passphrase"
    passphrase.write_text(f"passphrase of {name}\n")
    passphrase.chmod(0o600)  # a secret is read only from a file no one else can read
    private, public = signing.generate(tmp_path / "keys" / name, passphrase)
    return attest.Signer(private, passphrase, public)


def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    for name in attest.LOCK_FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO_ROOT / name, root / name)
    return root


def attestations(tmp_path: Path, signer: attest.Signer, sbom_text: str = '{"spdxVersion":"SPDX-2.3","packages":[]}\n'
                 ) -> oci_push.Attestations:
    sbom = tmp_path / "image.spdx.json"
    sbom.write_text(sbom_text)
    cyclonedx = tmp_path / "image.cdx.json"
    cyclonedx.write_text('{"bomFormat":"CycloneDX","specVersion":"1.6"}\n')
    root = checkout(tmp_path)
    locks = {name: root / name for name in attest.LOCK_FILES}
    gate = tmp_path / "gate.json"
    gate.write_text('{"patches": []}\n')

    def statement(digest: str) -> dict:
        return attest.provenance_statement(manifest_digest=digest, stack="tiny", kernel_selection="kimi-k3",
                                           locks=locks, toolchain_pins=[], gate_manifests={"sglang": gate},
                                           sbom=sbom, source=attest.Source("git+file:///src", "0" * 40, False),
                                           sbom_cyclonedx=cyclonedx)
    return oci_push.Attestations(sbom, statement, signer, cyclonedx)


def run_verify(ref: str, key: Path, root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, str]]:
    rc = verify.verify(ref, key, root)
    lines = capsys.readouterr().out.splitlines()
    checks = {line.split()[1]: line.split()[0] for line in lines if line.startswith(("ok ", "FAIL "))}
    return rc, checks


ALL_OK = {c: "ok" for c in ("digest", "signature", "blobs", "provenance", "locks", "sbom")}


def test_push_attaches_and_verify_passes_and_a_second_push_uploads_nothing(
        tmp_path: Path, registry: local_registry.RegistryProcess, capsys: pytest.CaptureFixture[str]) -> None:
    layout = tiny_layout(tmp_path / "a", "A = 1\n")
    signer = key_pair(tmp_path, "k1")
    repo = registry_client.Repository(registry.host, PATH)
    first = oci_push.push(layout, repo, ["v1"], attestations=attestations(tmp_path, signer))
    digest = first.manifest_digest
    tags = registry_client.tags(repo, registry_client.Credentials(None, None, "none"))
    assert sorted(tags) == sorted(["v1", *(attest.attachment_tag(digest, k) for k in ("sbom", "att", "sig"))])
    capsys.readouterr()
    rc, checks = run_verify(f"{registry.host}/{PATH}:v1", signer.public_key_path, checkout(tmp_path), capsys)
    assert (rc, checks) == (0, ALL_OK)

    second = oci_push.push(layout, repo, ["v1"], attestations=attestations(tmp_path, signer))
    err = capsys.readouterr().err
    assert second.manifest_digest == digest  # signing never rewrites the image manifest
    assert second.blobs_uploaded == 0
    for kind in ("sbom", "att", "sig"):
        assert f"{attest.attachment_tag(digest, kind)}: already there, kept" in err


def _push_signed(tmp_path: Path, registry: local_registry.RegistryProcess, name: str, text: str,
                 signer: attest.Signer, tag: str = "v1") -> str:
    layout = tiny_layout(tmp_path / name, text)
    repo = registry_client.Repository(registry.host, PATH)
    return oci_push.push(layout, repo, [tag], attestations=attestations(tmp_path / name, signer)).manifest_digest


def _skopeo_copy(registry: local_registry.RegistryProcess, src: str, dst: str) -> None:
    subprocess.run([signing.skopeo(), "copy", "--preserve-digests", "--src-tls-verify=false", "--dest-tls-verify=false",
                    f"docker://{registry.host}/{PATH}{src}", f"docker://{registry.host}/{PATH}{dst}"],
                   check=True, capture_output=True)


def _blob_file(registry: local_registry.RegistryProcess, digest: str) -> Path:
    hexpart = digest.split(":", 1)[1]
    return registry.root / "data" / "docker" / "registry" / "v2" / "blobs" / "sha256" / hexpart[:2] / hexpart / "data"


def _delete_manifest(registry: local_registry.RegistryProcess, tag: str) -> None:
    import urllib.request
    url = f"http://{registry.host}/v2/{PATH}/manifests/{tag}"
    head = urllib.request.Request(url, method="HEAD", headers={"Accept": oci_image.MANIFEST_MEDIA_TYPE})
    with urllib.request.urlopen(head) as resp:
        digest = resp.headers["Docker-Content-Digest"]
    with urllib.request.urlopen(urllib.request.Request(f"http://{registry.host}/v2/{PATH}/manifests/{digest}",
                                                       method="DELETE")) as resp:
        assert resp.status == 202


@pytest.mark.parametrize("tamper, failed", [
    ("retagged", {"signature", "blobs", "provenance", "locks", "sbom"}),
    ("flipped_layer_byte", {"blobs"}),
    ("other_key", {"signature", "blobs", "provenance", "locks", "sbom"}),
    ("provenance_of_another_digest", {"provenance", "locks", "sbom"}),
    ("missing_sbom", {"sbom"}),
    ("replaced_sbom", {"sbom"}),
    ("missing_signature", {"signature", "blobs"}),
    ("lock_changed", {"locks"}),
])
def test_verify_fails_by_name(tamper: str, failed: set[str], tmp_path: Path, registry: local_registry.RegistryProcess,
                              capsys: pytest.CaptureFixture[str]) -> None:
    k1 = key_pair(tmp_path, "k1")
    signer = key_pair(tmp_path, "k2") if tamper == "other_key" else k1
    digest = _push_signed(tmp_path, registry, "a", "A = 1\n", signer)
    root = checkout(tmp_path)
    ref = f"{registry.host}/{PATH}:v1"
    if tamper == "retagged":
        # Another image (unsigned, no attachments) pushed under the tag verified before.
        other = tiny_layout(tmp_path / "b", "B = 2\n")
        oci_push.push(other, registry_client.Repository(registry.host, PATH), ["v1"])
    elif tamper == "flipped_layer_byte":
        _, manifest_bytes = oci_image.read_index_manifest(tmp_path / "a" / "layout")
        blob = _blob_file(registry, json.loads(manifest_bytes)["layers"][0]["digest"])
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0x01
        blob.write_bytes(bytes(data))
    elif tamper == "provenance_of_another_digest":
        other = _push_signed(tmp_path, registry, "b", "B = 2\n", k1, tag="v2")
        _skopeo_copy(registry, ":" + attest.attachment_tag(other, "att"), ":" + attest.attachment_tag(digest, "att"))
    elif tamper == "missing_sbom":
        _delete_manifest(registry, attest.attachment_tag(digest, "sbom"))
    elif tamper == "replaced_sbom":
        # An SBOM that leaves a package out, under the tag: the provenance's digest no longer matches.
        fake = tmp_path / "fake-sbom"
        attest.write_artifact(fake, attest.SPDX_MEDIA_TYPE, b'{"spdxVersion":"SPDX-2.3","packages":[]} \n')
        registry_ = attest.Registry(registry_client.Repository(registry.host, PATH), registry_client.Credentials(None, None, "none"),
                                    tmp_path)
        registry_.push_artifact(fake, attest.attachment_tag(digest, "sbom"))
    elif tamper == "missing_signature":
        _delete_manifest(registry, attest.attachment_tag(digest, "sig"))
    elif tamper == "lock_changed":
        (root / "third_party" / "pins.lock.json").write_text("{}\n")
    capsys.readouterr()
    rc, checks = run_verify(ref, k1.public_key_path, root, capsys)
    assert rc == 1
    assert {c for c, state in checks.items() if state == "FAIL"} == failed, checks
    assert set(checks) == set(ALL_OK)


def test_verify_reports_a_malformed_provenance_as_present(tmp_path: Path, registry: local_registry.RegistryProcess,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """An .att artifact that is there but holds no DSSE envelope is named as such, not as missing;
    a push replaces it."""
    k1 = key_pair(tmp_path, "k1")
    digest = _push_signed(tmp_path, registry, "a", "A = 1\n", k1)
    repo = registry_client.Repository(registry.host, PATH)
    registry_ = attest.Registry(repo, registry_client.Credentials(None, None, "none"), tmp_path)
    tag = attest.attachment_tag(digest, "att")
    malformed = {"not JSON": (attest.DSSE_MEDIA_TYPE, b"not json"),
                 "a JSON list": (attest.DSSE_MEDIA_TYPE, b"[]"),
                 "not the envelope's shape": (attest.DSSE_MEDIA_TYPE, b'{"payload": 1}'),
                 "no envelope layer": ("text/plain", b"{}")}
    lines = {}
    for i, (name, (media_type, data)) in enumerate(malformed.items()):
        attest.write_artifact(tmp_path / f"fake{i}", media_type, data)
        registry_.push_artifact(tmp_path / f"fake{i}", tag)
        capsys.readouterr()
        assert verify.verify(f"{registry.host}/{PATH}:v1", k1.public_key_path, checkout(tmp_path)) == 1
        lines[name] = next(line for line in capsys.readouterr().out.splitlines() if line.split()[1:2] == ["provenance"])
    for name, line in lines.items():
        assert line.startswith(f"FAIL provenance {repo}:{tag}: present but malformed ("), (name, line)
        assert "missing" not in line, (name, line)
    oci_push.push(tmp_path / "a" / "layout", repo, ["v1"], attestations=attestations(tmp_path / "a", k1))
    capsys.readouterr()
    assert run_verify(f"{registry.host}/{PATH}:v1", k1.public_key_path, checkout(tmp_path), capsys) == (0, ALL_OK)


def test_verify_refuses_a_digest_the_registry_does_not_serve(tmp_path: Path, registry: local_registry.RegistryProcess,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    k1 = key_pair(tmp_path, "k1")
    _push_signed(tmp_path, registry, "a", "A = 1\n", k1)
    with pytest.raises(UserError, match="no such manifest"):
        verify.verify(f"{registry.host}/{PATH}@sha256:{'0' * 64}", k1.public_key_path, checkout(tmp_path))
    with pytest.raises(UserError, match="expected HOST"):
        verify.verify(f"{registry.host}/{PATH}", k1.public_key_path, checkout(tmp_path))


def test_keys_refuse_overwrite_and_a_wrong_passphrase(tmp_path: Path) -> None:
    k1 = key_pair(tmp_path, "k1")
    with pytest.raises(UserError, match="refusing to overwrite"):
        signing.generate(Path(str(k1.key).removesuffix(".private")), k1.passphrase_file)
    wrong = tmp_path / "wrong"
    wrong.write_text("not it\n")
    wrong.chmod(0o600)
    with pytest.raises(UserError, match="does not decrypt"):
        signing.load_private_key(k1.key, wrong)
    with pytest.raises(UserError, match="not a sigstore private key"):
        signing.load_private_key(k1.public_key_path, k1.passphrase_file)
    # The envelope helper: another key's signature is named as such.
    k2 = key_pair(tmp_path, "k2")
    envelope = signing.dsse_sign(b"{}", attest.IN_TOTO_PAYLOAD_TYPE, signing.load_private_key(k1.key, k1.passphrase_file))
    assert signing.dsse_open(envelope, signing.load_public_key(k1.public_key_path), attest.IN_TOTO_PAYLOAD_TYPE) == b"{}"
    with pytest.raises(ValueError, match="no signature by this key"):
        signing.dsse_open(envelope, signing.load_public_key(k2.public_key_path), attest.IN_TOTO_PAYLOAD_TYPE)


# ---------------------------------------------------------------- keys: malformed, readable by others, where written

def _key_doc(key: Path) -> dict:
    """The JSON inside a sigstore private key file's PEM block."""
    return json.loads(base64.b64decode("".join(key.read_text().splitlines()[1:-1])))


def _write_key(path: Path, doc: dict) -> Path:
    body = "\n".join(textwrap.wrap(base64.b64encode(json.dumps(doc).encode()).decode(), 64))
    path.write_text(f"-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----\n{body}\n-----END ENCRYPTED SIGSTORE PRIVATE KEY-----\n")
    path.chmod(0o600)
    return path


def _sealed_non_key(passphrase: bytes) -> dict:
    """A key file that decrypts with `passphrase` to bytes that are no private key."""
    from nacl.secret import SecretBox
    salt, nonce = os.urandom(32), os.urandom(24)
    secret = hashlib.scrypt(passphrase, salt=salt, n=1024, r=8, p=1, dklen=32)
    ciphertext = SecretBox(secret).encrypt(b"not a PKCS#8 key", nonce).ciphertext
    return {"kdf": {"name": "scrypt", "params": {"N": 1024, "r": 8, "p": 1}, "salt": base64.b64encode(salt).decode()},
            "cipher": {"name": "nacl/secretbox", "nonce": base64.b64encode(nonce).decode()},
            "ciphertext": base64.b64encode(ciphertext).decode()}


def _b64(n: int) -> str:
    return base64.b64encode(b"\1" * n).decode()


MALFORMED_KEYS = {
    "N not a power of 2": lambda d: d["kdf"]["params"].update(N=1000),
    "N zero": lambda d: d["kdf"]["params"].update(N=0),
    "N a boolean": lambda d: d["kdf"]["params"].update(N=True),
    "N a string": lambda d: d["kdf"]["params"].update(N="65536"),
    "N a float": lambda d: d["kdf"]["params"].update(N=65536.0),
    "N too large for memory": lambda d: d["kdf"]["params"].update(N=1 << 40),
    "r zero": lambda d: d["kdf"]["params"].update(r=0),
    "p negative": lambda d: d["kdf"]["params"].update(p=-1),
    "params missing": lambda d: d["kdf"].pop("params"),
    "kdf a string": lambda d: d.update(kdf="scrypt"),
    "salt not base64": lambda d: d["kdf"].update(salt="!!not base64!!"),
    "salt 16 bytes": lambda d: d["kdf"].update(salt=_b64(16)),
    "nonce 12 bytes": lambda d: d["cipher"].update(nonce=_b64(12)),
    "nonce a number": lambda d: d["cipher"].update(nonce=24),
    "ciphertext not base64": lambda d: d.update(ciphertext="*" * 40),
    "ciphertext shorter than its MAC": lambda d: d.update(ciphertext=_b64(8)),
    "cipher aes-gcm": lambda d: d["cipher"].update(name="aes-256-gcm"),
}


def test_a_malformed_private_key_is_one_line_naming_it_and_the_fix(tmp_path: Path) -> None:
    k1 = key_pair(tmp_path, "k1")
    cases = {name: (lambda d, f=mutate: (f(d), d)[1])(_key_doc(k1.key)) for name, mutate in MALFORMED_KEYS.items()}
    cases["decrypts to no key"] = _sealed_non_key(k1.passphrase_file.read_bytes().split(b"\n")[0])
    problems = {}
    for i, (name, doc) in enumerate(cases.items()):
        path = _write_key(tmp_path / f"bad{i}.private", doc)
        try:
            signing.load_private_key(path, k1.passphrase_file)
            problems[name] = "accepted"
        except UserError as e:
            msg = str(e)
            if not (msg.startswith(f"--sign-key {path}: ") and "\n" not in msg
                    and "python3 -m tools.image.signing generate" in msg and "skopeo generate-sigstore-key" in msg):
                problems[name] = f"UserError {msg!r}"
        except Exception as e:  # noqa: BLE001 - a traceback is what this test rules out
            problems[name] = f"{type(e).__name__}: {e}"
    assert problems == {}
    wrong = tmp_path / "wrong.passphrase"
    wrong.write_text("not it\n")
    wrong.chmod(0o600)
    with pytest.raises(UserError) as e:
        signing.load_private_key(k1.key, wrong)
    assert str(e.value).startswith(f"--sign-passphrase-file {wrong}: does not decrypt {k1.key}") and "\n" not in str(e.value)


def test_a_secret_others_can_read_is_refused_naming_the_chmod(tmp_path: Path) -> None:
    k1 = key_pair(tmp_path, "k1")
    for path in (k1.key, k1.passphrase_file):
        for mode in (0o644, 0o640, 0o604, 0o620):
            path.chmod(mode)
            with pytest.raises(UserError, match=re.escape(f"chmod 600 {path}")) as e:
                signing.load_private_key(k1.key, k1.passphrase_file)
            assert str(e.value).startswith(("--sign-key " if path == k1.key else "--sign-passphrase-file ") + str(path))
            path.chmod(0o600)
    # A link is judged by what it points at (a link's own mode is always 0777).
    link = tmp_path / "link.private"
    link.symlink_to(k1.key)
    assert signing.load_private_key(link, k1.passphrase_file) is not None
    k1.key.chmod(0o644)
    with pytest.raises(UserError, match=re.escape(f"chmod 600 {link}")):
        signing.load_private_key(link, k1.passphrase_file)
    # generate reads the passphrase file too: refused before skopeo writes anything.
    k1.passphrase_file.chmod(0o640)
    with pytest.raises(UserError, match=re.escape(f"chmod 600 {k1.passphrase_file}")):
        signing.generate(tmp_path / "new" / "k2", k1.passphrase_file)
    assert not (tmp_path / "new").exists() or not any((tmp_path / "new").iterdir())


@pytest.mark.parametrize("key_source", ["flags", "local"])
def test_push_refuses_a_readable_secret_before_a_registry_starts(key_source: str, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    layout = tiny_layout(tmp_path / "a", "A = 1\n")
    sbom = tmp_path / "image.spdx.json"
    sbom.write_text('{"spdxVersion":"SPDX-2.3","packages":[]}\n')
    argv = ["--layout", str(layout), "--sbom", str(sbom), "--stack", "tiny", "--workspace", str(tmp_path),
            "--lock", str(REPO_ROOT / "third_party" / "pins.lock.json")]
    if key_source == "flags":
        k1 = key_pair(tmp_path, "k1")
        k1.key.chmod(0o644)
        argv += ["--sign-key", str(k1.key), "--sign-passphrase-file", str(k1.passphrase_file)]
        readable = k1.key
    else:  # the local key under the cache root, its passphrase made readable since it was generated
        _, readable, _ = signing.local_key()
        readable.chmod(0o644)
    capsys.readouterr()
    try:
        with pytest.raises(UserError, match=re.escape(f"chmod 600 {readable}")):
            oci_push.main(argv)
    finally:
        local_registry.stop_local_registry()  # in case one was started
    assert "started local registry" not in capsys.readouterr().err
    assert not (tmp_path / "cache" / "registry" / "state.json").exists()


def test_generate_under_a_regular_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    passphrase = tmp_path / "pass"
    passphrase.write_text("secret\n")
    passphrase.chmod(0o600)
    somefile = tmp_path / "somefile"
    somefile.write_text("not a directory\n")
    with pytest.raises(UserError) as e:
        signing.generate(somefile / "key", passphrase)
    msg = str(e.value)
    assert msg.startswith(f"--out-prefix {somefile / 'key'}: ") and str(somefile) in msg and "\n" not in msg
    capsys.readouterr()
    assert run_cli(signing.main, ["generate", "--out-prefix", str(somefile / "key"), "--passphrase-file",
                                  str(passphrase)]) == 2
    assert capsys.readouterr().err == f"error: {msg}\n"


def test_generated_secrets_are_owner_only_from_creation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The private key and the local key's passphrase are 0600 from the moment they exist, not
    after a chmod: skopeo runs under umask 077 (this stand-in writes its files the plain way,
    0666 less the umask, as a tool that does not care would), the passphrase is created 0600."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "skopeo"
    stand_in.write_text('#!/bin/sh\n# generate-sigstore-key --output-prefix PREFIX --passphrase-file FILE\n'
                        'echo private > "$3.private"\necho public > "$3.pub"\n')
    stand_in.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(os, "chmod", lambda *args, **kwargs: None)  # no chmod after the fact
    umask = os.umask(0o022)
    try:
        private, passphrase, public = signing.local_key()
    finally:
        os.umask(umask)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in (private, passphrase)} == \
        {private.name: "0o600", passphrase.name: "0o600"}
    assert public.read_text() == "public\n"


def test_local_key_is_generated_once_and_reused(tmp_path: Path) -> None:
    first = signing.local_key()
    assert all(p.is_file() for p in first)
    assert oct(first[0].stat().st_mode & 0o777) == "0o600" and oct(first[1].stat().st_mode & 0o777) == "0o600"
    assert signing.local_key() == first
    assert signing.load_private_key(first[0], first[1]) is not None


def test_a_mismatched_key_pair_is_refused_before_anything_is_pushed(tmp_path: Path, registry: local_registry.RegistryProcess) -> None:
    k1, k2 = key_pair(tmp_path, "k1"), key_pair(tmp_path, "k2")
    mixed = attest.Signer(k1.key, k1.passphrase_file, k2.public_key_path)
    layout = tiny_layout(tmp_path / "a", "A = 1\n")
    repo = registry_client.Repository(registry.host, PATH)
    with pytest.raises(UserError, match="its public key is not"):
        oci_push.push(layout, repo, ["v1"], attestations=attestations(tmp_path, mixed))
    client = registry_client.RegistryClient(repo, registry_client.Credentials(None, None, "none"))
    _, manifest_bytes = oci_image.read_index_manifest(layout)
    assert [client.blob_exists(l["digest"]) for l in json.loads(manifest_bytes)["layers"]] == [False]
    assert registry_client.tags(repo, registry_client.Credentials(None, None, "none")) == []


def test_the_provenance_takes_the_kernel_selection_from_the_image(tmp_path: Path) -> None:
    tree = tmp_path / "aot"
    (tree / "flashinfer" / "data" / "aot").mkdir(parents=True)
    (tree / "flashinfer" / "data" / "aot" / "kernel_cache.json").write_text('{"selection": "kimi-k3", "modules": {}}')
    blob, desc = tmp_path / "kc.tar.zst", tmp_path / "kc.json"
    assert oci_layer.main(["--name", "kernel_cache", "--out", str(blob), "--descriptor", str(desc),
                           "--site-tree", str(tree), "--source-date-epoch", str(EPOCH)]) == 0
    assert oci_image.main(["--out", str(tmp_path / "with"), "--layer", str(desc), str(blob),
                           "--source-date-epoch", str(EPOCH)]) == 0
    assert image_contents.kernel_selection(tmp_path / "with") == "kimi-k3"
    assert image_contents.kernel_selection(tiny_layout(tmp_path / "without", "A = 1\n")) == ""


def test_image_sbom_lists_the_triton_layers_kernels_and_driver_module(tmp_path: Path) -> None:
    """Every compiled file of the triton layer: its cubins and Triton's driver module (.so); not
    the .json metadata beside them."""
    tree = tmp_path / "triton"
    (tree / "usr/share/kimi-k3/triton/KEY").mkdir(parents=True)
    (tree / "usr/share/kimi-k3/triton/DRIVER").mkdir()
    files = {"KEY/k.cubin": b"cubin", "KEY/k.json": b"{}", "DRIVER/cuda_utils.cpython-311-x86_64-linux-gnu.so": b"elf"}
    for rel, data in files.items():
        (tree / "usr/share/kimi-k3/triton" / rel).write_bytes(data)
    blob, desc = tmp_path / "t.tar.zst", tmp_path / "t.json"
    assert oci_layer.main(["--name", "triton", "--out", str(blob), "--descriptor", str(desc),
                           "--tree", f"/usr/share/kimi-k3/triton={tree / 'usr/share/kimi-k3/triton'}",
                           "--source-date-epoch", str(EPOCH)]) == 0
    assert oci_image.main(["--out", str(tmp_path / "img"), "--layer", str(desc), str(blob),
                           "--source-date-epoch", str(EPOCH)]) == 0
    assert image_sbom.compiled_modules(tmp_path / "img") == sorted(
        ("triton", f"/usr/share/kimi-k3/triton/{rel}", hashlib.sha256(data).hexdigest())
        for rel, data in files.items() if not rel.endswith(".json"))


def test_image_sbom_of_a_tiny_image_is_the_same_from_two_paths(tmp_path: Path) -> None:
    """syft's time, random namespace and scanned path are taken out: two copies, one document."""
    layout = tiny_layout(tmp_path / "a", "A = 1\n")
    copy = tmp_path / "elsewhere" / "image.oci"
    shutil.copytree(layout, copy)
    from tools.pins import debian
    from tools.pins import lock as lockfile
    lock = lockfile.load(REPO_ROOT / "third_party" / "pins.lock.json")
    base = debian.load_set(REPO_ROOT / "third_party" / "debian.lock.json", "image-base")
    built = [image_sbom.build(p, stack="pypi", lock=lock, base=base, manifests=[], epoch=EPOCH) for p in (layout, copy)]
    assert built[0] == built[1]  # SPDX and CycloneDX alike
    docs = [spdx for spdx, _ in built]
    assert str(tmp_path) not in json.dumps(built[0])
    cyclonedx = built[0][1]
    assert cyclonedx["metadata"]["timestamp"] == "2023-11-14T22:13:20Z"
    assert re.match(r"^urn:uuid:[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$", cyclonedx["serialNumber"])
    assert docs[0]["creationInfo"]["created"] == "2023-11-14T22:13:20Z"
    root = next(p for p in docs[0]["packages"] if p.get("primaryPackagePurpose") == "CONTAINER")
    assert root["checksums"][0]["checksumValue"] == json.loads((layout / "index.json").read_text())[
        "manifests"][0]["digest"].split(":")[1]


@pytest.mark.parametrize("filled, named", [(True, True), (False, False)])
def test_a_scan_that_stops_silently_names_a_full_scratch_disk(filled: bool, named: bool, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """syft -q exits 1 and says nothing when its scratch's file system fills up, and it removes
    what it unpacked before it exits: the one line names that file system, the least it had left
    during the scan and the fix, though the space is back by then; with room left throughout it
    does not."""
    layout = tiny_layout(tmp_path / "a", "A = 1\n")
    full = tmp_path / "disk-full"
    fake = tmp_path / "syft"
    # The stand-in fills the disk for a second (the marker file), frees it, then fails silently.
    fill = f"touch {full}; sleep 1; rm {full}; " if filled else "sleep 1; "
    fake.write_text(f"#!/bin/sh\n{fill}exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(image_sbom, "syft_binary", lambda: fake)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(image_sbom.shutil, "disk_usage",
                        lambda _path: usage._replace(free=10 if full.exists() else 1 << 50))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(UserError) as e:
        image_sbom.run_syft(layout, scratch)
    assert not full.exists()
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"--layout {layout}: syft could not scan it: exit 1 with no message")
    assert message.endswith("pass an OCI layout from //image:image")
    assert (f"its scratch directory's file system, {tmp_path}, had 10 B free at its lowest during the scan" in message
            and "point TMPDIR at a larger file system" in message) is named, message


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
