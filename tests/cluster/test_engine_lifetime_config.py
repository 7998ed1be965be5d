"""`tandem serve --detach-engines` / `--attach` settings (cluster/engines/attach.py):
each misuse is a ValueError naming the flag before anything starts; the
secret fingerprint an adopting gateway checks."""

import pytest

from tandem.cluster.cli.main import build_parser
from tandem.cluster.cli.serve import Service
from tandem.cluster.cli.settings import resolve_config
from tandem.wire.auth import secret_fingerprint


def settings_of(argv, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return resolve_config(build_parser().parse_args(["serve", *argv]))


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"0123456789abcdef0123")
    return str(path)


@pytest.mark.parametrize("flag", ["--detach-engines", "--attach"])
def test_needs_a_ray_cluster_the_gateway_joins(flag, secret_file, monkeypatch):
    with pytest.raises(ValueError, match=rf"{flag}: .*--address"):
        settings_of([flag, "--cluster-secret-file", secret_file], monkeypatch)


@pytest.mark.parametrize("flag", ["--detach-engines", "--attach"])
def test_needs_a_secret_the_next_gateway_holds_too(flag, monkeypatch):
    with pytest.raises(ValueError, match=rf"{flag}: pass --cluster-secret-file"):
        settings_of([flag, "--address", "127.0.0.1:6379"], monkeypatch)
    # without internal auth there is no secret to share
    s = settings_of([flag, "--address", "127.0.0.1:6379", "--no-internal-auth"], monkeypatch)
    assert getattr(s.ray, flag[2:].replace("-", "_")) is True


def test_attach_and_detach_together_is_refused(secret_file, monkeypatch):
    argv = [
        "--attach",
        "--detach-engines",
        "--address",
        "a:1",
        "--cluster-secret-file",
        secret_file,
    ]
    with pytest.raises(ValueError, match="pass one"):
        settings_of(argv, monkeypatch)


def test_ray_address_from_the_environment_counts(secret_file, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = build_parser().parse_args(
        ["serve", "--detach-engines", "--cluster-secret-file", secret_file]
    )
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert resolve_config(args).ray.detach_engines is True


def test_who_stops_the_engines_at_exit(secret_file, monkeypatch):
    """A gateway stops the engines it started, not those meant to outlive it."""
    base = ["--address", "a:1", "--cluster-secret-file", secret_file]
    assert Service(settings_of([], monkeypatch)).owns_engines
    assert not Service(settings_of(["--detach-engines", *base], monkeypatch)).owns_engines
    assert not Service(settings_of(["--attach", *base], monkeypatch)).owns_engines


def test_secret_fingerprint_tells_secrets_apart_and_hides_them():
    a, b = b"0123456789abcdef0123", b"0123456789abcdef0124"
    assert secret_fingerprint(a) == secret_fingerprint(a)
    assert secret_fingerprint(a) != secret_fingerprint(b)
    assert len(secret_fingerprint(a)) == 16 and a.hex()[:8] not in secret_fingerprint(a)
    assert secret_fingerprint(None) is None
