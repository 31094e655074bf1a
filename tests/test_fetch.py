"""Remote inputs against real servers on 127.0.0.1: https with a self-signed certificate and
bearer tokens, servers that truncate, drop, redirect or serve the wrong bytes.

Expected hashes are computed here with hashlib from the bytes the test serves, and request
counts are read from the server's own log, never from the fetcher's report.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, linear_recipe, write_recipe
from remote_server import AssetServer, make_certificate

from minifield.inputs import credentials, fetch, origins, pinned

TOKEN = "tok-" + secrets.token_hex(16)  # unique per run, so a grep for it means something
ASSET = random.Random(7).randbytes(3 << 20)  # 3 MiB: several 1 MiB chunks, so drops are mid-file
ASSET_SHA = hashlib.sha256(ASSET).hexdigest()


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def server(tls):
    with AssetServer(token=TOKEN, tls=tls) as srv:
        srv.add("blob", ASSET)
        yield srv


def write_credentials(path: Path, tokens: dict, mode: int = 0o600) -> Path:
    path.write_text(json.dumps({o: {"bearer_token": t} for o, t in tokens.items()}))
    os.chmod(path, mode)
    return path


def settings(tmp_path, tls, allowed, tokens=None, **overrides) -> fetch.Settings:
    values = {
        "allowed_origins": allowed,
        "cache_dir": tmp_path / "cache",
        "credentials": credentials.Credentials(tokens or {}),
        "ca_bundle": tls[0],
        "max_attempts": 3,
        "backoff_seconds": 0.01,
        "timeout_seconds": 20,
    }
    values.update(overrides)
    return fetch.Settings(**values)


def cache_files(cache: Path) -> list[str]:
    """Every file in the cache (blobs and temporaries), relative to it."""
    if not cache.exists():
        return []
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())


def remote_recipe(url: str, data: bytes = ASSET, **overrides) -> dict:
    item = {
        "name": "examples",
        "url": url,
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
    }
    return linear_recipe(inputs=[item], **overrides)


def cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minifield.cli", "fetch-inputs", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )


# --- through the command line --------------------------------------------------------------


@pytest.mark.slow
def test_correct_token_fetches_verifies_and_caches(tmp_path, tls, server):
    job = write_recipe(tmp_path / "job.json", remote_recipe(server.url("a", "blob")))
    creds = write_credentials(tmp_path / "creds.json", {server.origin: TOKEN})
    args = ("--job", job, "--dest", tmp_path / "in", "--allow-origin", server.origin)
    args += ("--credentials-file", creds, "--cache", tmp_path / "cache", "--ca-bundle", tls[0])
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    placed = tmp_path / "in" / "examples"
    assert hashlib.sha256(placed.read_bytes()).hexdigest() == ASSET_SHA
    assert cache_files(tmp_path / "cache") == [f"sha256/{ASSET_SHA}"]
    assert server.requests == [{"path": "/a/blob", "authorization": f"Bearer {TOKEN}"}]
    record = json.loads(first.stdout)["inputs"][0]
    assert (record["source"], record["attempts"], record["authenticated"]) == ("network", 1, True)

    # Already cached and verified: placed again without any request.
    placed.unlink()
    second = cli(*args)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["inputs"][0]["source"] == "cache"
    assert len(server.requests) == 1
    assert placed.read_bytes() == ASSET
    for proc in (first, second):
        assert TOKEN not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_missing_token_is_refused_naming_origin_and_status(tmp_path, tls, server):
    job = write_recipe(tmp_path / "job.json", remote_recipe(server.url("a", "blob")))
    proc = cli(
        "--job", job, "--dest", tmp_path / "in", "--allow-origin", server.origin,
        "--cache", tmp_path / "cache", "--ca-bundle", tls[0],
    )  # fmt: skip
    assert proc.returncode == 1
    assert f"{server.origin} answered HTTP 401" in proc.stderr
    assert "no bearer token is configured for this origin" in proc.stderr
    assert cache_files(tmp_path / "cache") == []
    assert not (tmp_path / "in" / "examples").exists()
    assert len(server.requests) == 1  # an authorization failure is not retried


@pytest.mark.slow
def test_world_readable_credentials_file_is_refused(tmp_path, tls, server):
    job = write_recipe(tmp_path / "job.json", remote_recipe(server.url("a", "blob")))
    creds = write_credentials(tmp_path / "creds.json", {server.origin: TOKEN}, mode=0o644)
    proc = cli(
        "--job", job, "--dest", tmp_path / "in", "--allow-origin", server.origin,
        "--credentials-file", creds, "--cache", tmp_path / "cache", "--ca-bundle", tls[0],
    )  # fmt: skip
    assert proc.returncode == 2
    assert f"credentials file {creds} has mode 0644" in proc.stderr
    assert f"chmod 600 {creds}" in proc.stderr
    assert TOKEN not in proc.stdout + proc.stderr
    assert server.requests == []
    assert cache_files(tmp_path / "cache") == []


# --- the library, in process ---------------------------------------------------------------


@pytest.mark.slow
def test_wrong_token_is_refused_naming_origin_and_status(tmp_path, tls, server):
    s = settings(tmp_path, tls, [server.origin], {server.origin: "tok-wrong"})
    with pytest.raises(fetch.FetchError) as err:
        fetch.fetch_inputs(remote_recipe(server.url("a", "blob")), tmp_path / "in", s)
    message = str(err.value)
    assert f"{server.origin} answered HTTP 403" in message
    assert "the bearer token configured for this origin was not accepted" in message
    assert "tok-wrong" not in message
    assert cache_files(tmp_path / "cache") == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("route", "expected", "requests"),
    [
        # Full size, wrong bytes: the server's answer, not a glitch; not retried.
        ("mismatch", f"downloaded {3 << 20} bytes with sha256", 1),
        # Content-Length says 3 MiB, the body stops at half: transient, retried.
        ("truncated", "broke off after", 3),
        # No Content-Length, reset mid-body: transient, retried.
        ("drop", "ended early", 3),
        # More bytes than pinned: not the pinned file; not retried.
        ("longer", "longer than the pinned size", 1),
    ],
)
def test_bad_bodies_never_land_in_the_cache(tmp_path, tls, server, route, expected, requests):
    s = settings(tmp_path, tls, [server.origin], {server.origin: TOKEN})
    with pytest.raises(fetch.FetchError) as err:
        fetch.fetch_blob(server.url(route, "blob"), ASSET_SHA, len(ASSET), s)
    assert expected in str(err.value)
    if requests > 1:
        assert "gave up after 3 attempts" in str(err.value)
    assert len(server.requests) == requests
    assert cache_files(tmp_path / "cache") == []


@pytest.mark.slow
@pytest.mark.parametrize("route", ["flaky503", "flaky-drop"])
def test_transient_failure_is_retried_then_verified(tmp_path, tls, server, route):
    s = settings(tmp_path, tls, [server.origin], {server.origin: TOKEN})
    log = io.StringIO()
    outcome = fetch.fetch_blob(server.url(route, "blob"), ASSET_SHA, len(ASSET), s, stream=log)
    assert outcome["attempts"] == 2
    assert len(server.requests) == 2
    assert "attempt 1 failed" in log.getvalue()
    assert cache_files(tmp_path / "cache") == [f"sha256/{ASSET_SHA}"]
    assert hashlib.sha256(fetch.blob_path(s.cache_dir, ASSET_SHA).read_bytes()).hexdigest() == (
        ASSET_SHA
    )


@pytest.mark.slow
def test_progress_is_shown_for_large_files(tmp_path, tls, server):
    s = settings(tmp_path, tls, [server.origin], {server.origin: TOKEN}, progress_min_bytes=1 << 20)
    log = io.StringIO()
    fetch.fetch_blob(server.url("a", "blob"), ASSET_SHA, len(ASSET), s, label="blob", stream=log)
    assert "fetch blob: 3.0/3.0 MiB (100%)" in log.getvalue()
    quiet = io.StringIO()
    s.progress_min_bytes = 4 << 20
    fetch.blob_path(s.cache_dir, ASSET_SHA).unlink()
    fetch.fetch_blob(server.url("a", "blob"), ASSET_SHA, len(ASSET), s, stream=quiet)
    assert quiet.getvalue() == ""


@pytest.mark.slow
def test_same_origin_redirect_is_followed(tmp_path, tls, server):
    s = settings(tmp_path, tls, [server.origin], {server.origin: TOKEN})
    fetch.fetch_blob(server.url("redirect-same", "blob"), ASSET_SHA, len(ASSET), s)
    assert server.paths() == ["/redirect-same/blob", "/a/blob"]
    assert cache_files(tmp_path / "cache") == [f"sha256/{ASSET_SHA}"]


@pytest.mark.slow
def test_redirect_to_another_origin_is_refused_even_if_allowed(tmp_path, tls, server):
    with AssetServer(tls=tls) as other:
        other.add("blob", ASSET)
        server.redirect_target = other.origin
        s = settings(tmp_path, tls, [server.origin, other.origin], {server.origin: TOKEN})
        with pytest.raises(fetch.FetchError) as err:
            fetch.fetch_blob(server.url("redirect-other", "blob"), ASSET_SHA, len(ASSET), s)
        assert f"to another origin ({other.origin}) refused" in str(err.value)
        assert other.requests == []  # nothing was sent there, token or not
    assert len(server.requests) == 1
    assert cache_files(tmp_path / "cache") == []


@pytest.mark.slow
def test_token_goes_only_to_its_own_origin(tmp_path, tls, server):
    with AssetServer(tls=tls) as other:
        other.add("blob", ASSET)
        # The key is written in another case: it still means exactly server.origin.
        creds_path = write_credentials(
            tmp_path / "c.json", {server.origin.replace("https://", "HTTPS://"): TOKEN}
        )
        s = settings(
            tmp_path, tls, [server.origin, other.origin], credentials=credentials.load(creds_path)
        )
        fetch.fetch_blob(other.url("a", "blob"), ASSET_SHA, len(ASSET), s)
        assert other.requests == [{"path": "/a/blob", "authorization": None}]
        fetch.blob_path(s.cache_dir, ASSET_SHA).unlink()
        fetch.fetch_blob(server.url("a", "blob"), ASSET_SHA, len(ASSET), s)
        assert server.requests[-1]["authorization"] == f"Bearer {TOKEN}"


@pytest.mark.slow
def test_origin_not_on_the_list_is_refused_without_a_request(tmp_path, tls, server):
    s = settings(tmp_path, tls, ["https://assets.example"], {server.origin: TOKEN})
    with pytest.raises(fetch.FetchError) as err:
        fetch.fetch_blob(server.url("a", "blob"), ASSET_SHA, len(ASSET), s)
    assert f"origin {server.origin} of {server.url('a', 'blob')} is not an allowed origin" in str(
        err.value
    )
    assert "allowed: https://assets.example:443" in str(err.value)
    assert server.requests == []
    assert cache_files(tmp_path / "cache") == []


@pytest.mark.slow
def test_plain_http_to_a_non_loopback_origin_is_refused(tmp_path, tls):
    with pytest.raises(origins.OriginError, match="uses plain http: only https is fetched"):
        settings(tmp_path, tls, ["http://assets.example"], allow_insecure_loopback=True)
    s = settings(tmp_path, tls, ["https://assets.example"])
    with pytest.raises(fetch.FetchError, match="origin http://assets.example:80 .* not an allowed"):
        fetch.fetch_blob("http://assets.example/blob", ASSET_SHA, len(ASSET), s)
    assert cache_files(tmp_path / "cache") == []


@pytest.mark.slow
def test_plain_http_on_loopback_needs_the_explicit_flag(tmp_path, tls):
    with AssetServer() as plain:
        plain.add("blob", ASSET)
        with pytest.raises(origins.OriginError, match="allow_insecure_loopback: true"):
            settings(tmp_path, tls, [plain.origin])
        s = settings(tmp_path, tls, [plain.origin], allow_insecure_loopback=True)
        fetch.fetch_blob(plain.url("a", "blob"), ASSET_SHA, len(ASSET), s)
        assert plain.paths() == ["/a/blob"]
    assert cache_files(tmp_path / "cache") == [f"sha256/{ASSET_SHA}"]


@pytest.mark.slow
def test_untrusted_certificate_is_refused(tmp_path, tls, server):
    s = settings(tmp_path, tls, [server.origin], {server.origin: TOKEN}, ca_bundle=None)
    with pytest.raises(fetch.FetchError, match="TLS verification failed for"):
        fetch.fetch_blob(server.url("a", "blob"), ASSET_SHA, len(ASSET), s)
    assert cache_files(tmp_path / "cache") == []


@pytest.mark.slow
def test_corrupt_cached_blob_is_discarded_and_fetched_again(tmp_path, tls, server):
    s = settings(tmp_path, tls, [server.origin], {server.origin: TOKEN})
    blob = fetch.blob_path(s.cache_dir, ASSET_SHA)
    blob.parent.mkdir(parents=True)
    blob.write_bytes(ASSET[:-1] + b"X")
    outcome = fetch.fetch_blob(server.url("a", "blob"), ASSET_SHA, len(ASSET), s)
    assert outcome["source"] == "network"
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == ASSET_SHA


@pytest.mark.slow
def test_every_failing_input_is_named(tmp_path, tls, server):
    server.add("other", b"other bytes")
    recipe = remote_recipe(server.url("mismatch", "blob"))
    recipe["inputs"].append(
        {"name": "second", "url": server.url("a", "nowhere"), "sha256": "0" * 64, "size": 3}
    )
    s = settings(tmp_path, tls, [server.origin], {server.origin: TOKEN})
    with pytest.raises(fetch.FetchError) as err:
        fetch.fetch_inputs(recipe, tmp_path / "in", s)
    assert "input 'examples':" in str(err.value) and "input 'second':" in str(err.value)
    assert "HTTP 404" in str(err.value)


# --- origins, credentials and input resolution ----------------------------------------------


@pytest.mark.parametrize(
    ("written", "normal"),
    [
        ("https://Assets.Example", "https://assets.example:443"),
        ("https://assets.example:443/", "https://assets.example:443"),
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
        ("http://[::1]", "http://[::1]:80"),
    ],
)
def test_origins_are_normalised(written, normal):
    assert origins.normalise(written) == normal


@pytest.mark.parametrize(
    ("written", "reason"),
    [
        ("https://assets.example/models", "without a path"),
        ("ftp://assets.example", "scheme must be https"),
        ("https://user:pw@assets.example", "credentials in the URL"),
        ("https://assets.example:99999", "not a valid URL"),
    ],
)
def test_bad_origins_are_refused(written, reason):
    with pytest.raises(origins.OriginError, match=reason) as err:
        origins.normalise(written)
    assert "pw@" not in str(err.value)


def test_credentials_file_contents_are_checked_without_echoing_tokens(tmp_path):
    bad = tmp_path / "bad.json"
    for text, reason in [
        ('{"https://a.example": {"bearer_token": "tok\\nX"}}', "without whitespace"),
        ('{"https://a.example": {"bearer_token": "tok-\u00e9"}}', "printable ASCII"),
        ('{"https://a.example": {"token": "tok-x"}}', 'exactly one field, "bearer_token"'),
        ('{"https://a.example/p": {"bearer_token": "tok-x"}}', "without a path"),
        ('{"https://a.example": {"bearer_token": "tok-x"}', "not valid UTF-8 JSON"),
        (
            '{"https://a.example": {"bearer_token": "tok-x"}, '
            '"https://a.example:443": {"bearer_token": "tok-y"}}',
            "listed twice",
        ),
    ]:
        bad.write_text(text)
        os.chmod(bad, 0o600)
        with pytest.raises(credentials.CredentialsError, match=reason) as err:
            credentials.load(bad)
        assert "tok-x" not in str(err.value) and "tok\nX" not in str(err.value)
    link = tmp_path / "link.json"
    link.symlink_to(bad)
    with pytest.raises(credentials.CredentialsError, match="not a symbolic link"):
        credentials.load(link)
    good = write_credentials(tmp_path / "good.json", {"https://a.example": "tok-secret"}, 0o400)
    loaded = credentials.load(good)
    assert loaded.token_for("https://a.example:443") == "tok-secret"
    assert loaded.token_for("https://a.example:8443") is None
    assert "tok-secret" not in repr(loaded)
    assert loaded.redact("header Bearer tok-secret") == "header Bearer [redacted]"


def test_inputs_verify_resolves_remote_inputs_by_name(tmp_path):
    recipe = remote_recipe("https://assets.example/blob", data=b"twelve bytes")
    with pytest.raises(pinned.InputError, match="remote input https://assets.example/blob not"):
        pinned.verify(recipe, tmp_path)
    (tmp_path / "examples").write_bytes(b"twelve bytes")
    verified = pinned.verify(recipe, tmp_path)
    assert verified == [
        {
            "name": "examples",
            "path": "examples",
            "sha256": hashlib.sha256(b"twelve bytes").hexdigest(),
            "size": 12,
        }
    ]
    assert pinned.files_by_name(recipe, tmp_path) == {"examples": (tmp_path / "examples").resolve()}
    (tmp_path / "examples").write_bytes(b"thirteen byte")
    with pytest.raises(pinned.InputError, match="has 13 bytes, but the recipe pins size 12"):
        pinned.verify(recipe, tmp_path)
