"""`tandem serve`'s cluster secret: on by default, from a file, or off."""

import pytest

from tandem.cluster.cli.main import build_parser
from tandem.cluster.cli.serve import cmd_serve
from tandem.cluster.cli.settings import cluster_secret, pool_specs, resolve_config


def parse(argv):
    return build_parser().parse_args(["serve", *argv])


def test_default_is_a_fresh_random_secret_handed_to_every_engine():
    config = resolve_config(parse([]))
    a, b = cluster_secret(config), cluster_secret(config)
    assert len(a) == 32 and a != b
    specs = pool_specs(config, a)
    assert [s.config.runtime.cluster_secret for s in specs] == [a, a]
    assert a.hex() not in repr(specs)


def test_secret_file_and_dev_mode(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"correct horse battery staple\n")
    config = resolve_config(parse(["--cluster-secret-file", str(path)]))
    assert cluster_secret(config) == b"correct horse battery staple"
    assert cluster_secret(resolve_config(parse(["--no-internal-auth"]))) is None


def test_bad_secret_sources_fail_before_anything_starts(tmp_path, capsys):
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    assert cmd_serve(parse(["--cluster-secret-file", str(short)])) == 2
    assert "at least 16 bytes, got 3" in capsys.readouterr().err
    assert cmd_serve(parse(["--cluster-secret-file", str(tmp_path / "missing")])) == 2
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("cluster_secret: hunter2hunter2hunter2\n")
    with pytest.raises(ValueError, match="use cluster_secret_file"):
        resolve_config(parse(["--config", str(cfg)]))
