"""shared/access without servers: what `kvflow auth init` writes (layout, modes, every role's
files, a password per file that the configurations' hashes accept) and when it refuses; the
settings a role is given; connection options from settings."""

from __future__ import annotations

import hashlib
import re
import stat
from pathlib import Path

import bcrypt
import pytest

from kvflow.cli.main import main
from kvflow.shared.access.connect import AccessError, nats_auth, parse_sentinel_url, redis_options
from kvflow.shared.access.credentials import Credentials
from kvflow.shared.access.grants import NATS_ROLES, REDIS_ROLES
from kvflow.shared.config import BusSettings


def test_auth_init_writes_every_roles_files_that_the_configs_accept(tmp_path: Path) -> None:
    assert main(["auth", "init", str(tmp_path / "c")]) == 0
    creds = Credentials(tmp_path / "c")
    conf = creds.nats_conf.read_text()
    acl = creds.redis_acl.read_text()
    hashes = dict(re.findall(r'user: "(\w+)"\s+password: "([^"]+)"', conf))
    assert set(hashes) == set(NATS_ROLES)
    for role in NATS_ROLES:
        password = creds.nats_password_file(role).read_text().strip()
        assert bcrypt.checkpw(password.encode(), hashes[role].encode())
        others = [creds.nats_password_file(r).read_text().strip() for r in NATS_ROLES]
        assert others.count(password) == 1  # a password per role
    for role in REDIS_ROLES:
        password = creds.redis_password_file(role).read_text().strip()
        line = next(x for x in acl.splitlines() if x.startswith(f"user {role} "))
        assert f"#{hashlib.sha256(password.encode()).hexdigest()}" in line
    assert not creds.redis_password_file("tokenizer").exists()  # no Redis user: no file
    assert "user default on nopass resetkeys resetchannels -@all +ping" in acl
    # Redis with Sentinel: the replicas' login to the primary is a user of the ACL, and every
    # role may log in to the sentinels with its own password (to ask where the primary is)
    repl = re.search(r'masterauth "([^"]+)"', creds.redis_replication_conf.read_text()).group(1)
    line = next(x for x in acl.splitlines() if x.startswith("user replication "))
    assert f"#{hashlib.sha256(repl.encode()).hexdigest()}" in line and "+psync" in line
    sentinel = creds.sentinel_conf.read_text()
    for role in REDIS_ROLES:
        password = creds.redis_password_file(role).read_text().strip()
        line = next(x for x in sentinel.splitlines() if x.startswith(f"user {role} "))
        assert f"#{hashlib.sha256(password.encode()).hexdigest()}" in line
        assert "+sentinel|get-master-addr-by-name" in line and "+@all" not in line
    files = (creds.nats_conf, creds.redis_acl, creds.sentinel_conf, creds.redis_replication_conf)
    for f in (*files, creds.nats_password_file("worker")):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("url", "parsed"),
    [
        ("redis://127.0.0.1:6379/0", None),
        (
            "redis+sentinel://a:26379,b:26380/kvflow",
            ([("a", 26379), ("b", 26380)], "kvflow", 0, False),
        ),
        ("rediss+sentinel://[::1]:1/m/3", ([("::1", 1)], "m", 3, True)),
    ],
)
def test_sentinel_urls(url: str, parsed) -> None:
    assert parse_sentinel_url(url) == parsed


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://a:1",  # no master name
        "redis+sentinel://a/kvflow",  # no port
        "redis+sentinel://u:p@a:1/kvflow",  # a login in the URL
        "redis+sentinel://a:1/kvflow/x",
    ],
)
def test_bad_sentinel_urls_say_the_form(url: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_sentinel_url(url)


def test_auth_init_keeps_or_refuses_existing_credentials(tmp_path: Path, capsys) -> None:
    d = str(tmp_path)
    assert main(["auth", "init", d]) == 0
    before = Credentials(tmp_path).nats_password_file("gateway").read_text()
    assert main(["auth", "init", d]) == 2  # never replaced by accident
    assert "--force" in capsys.readouterr().err
    assert main(["auth", "init", d, "--if-missing"]) == 0
    assert Credentials(tmp_path).nats_password_file("gateway").read_text() == before
    assert main(["auth", "init", d, "--force", "--mode", "644"]) == 0
    after = Credentials(tmp_path).nats_password_file("gateway")
    assert after.read_text() != before and stat.S_IMODE(after.stat().st_mode) == 0o644


def test_auth_init_if_missing_renews_what_an_older_kvflow_left_incomplete(
    tmp_path: Path, capsys
) -> None:
    """Volumes from before the cluster files existed: --if-missing writes everything anew (the
    route and sentinel passwords must match users.acl), and says so."""
    d = str(tmp_path)
    assert main(["auth", "init", d]) == 0
    creds = Credentials(tmp_path)
    assert all(f.exists() for f in creds.files())
    before = creds.nats_password_file("gateway").read_text()
    creds.nats_cluster_conf.unlink()
    creds.sentinel_conf.unlink()
    assert main(["auth", "init", d, "--if-missing"]) == 0
    assert "lacks nats/cluster.conf, redis/sentinel.conf" in capsys.readouterr().err
    assert all(f.exists() for f in creds.files())
    assert creds.nats_password_file("gateway").read_text() != before
    route = creds.nats_route_password.read_text().strip()
    cluster = creds.nats_cluster_conf.read_text()
    assert cluster.count(f"route:{route}@") == 3 and 'include "nats.conf"' in cluster
    assert main(["auth", "init", d, "--nats-routes", "a:6222,b:7222", "--force"]) == 0
    routes = re.findall(r"@([^\"]+)\"", creds.nats_cluster_conf.read_text())
    assert routes == ["a:6222", "b:7222"]


def test_a_role_is_given_only_its_own_files(tmp_path: Path) -> None:
    creds = Credentials(tmp_path)
    assert creds.service_settings("tokenizer") == {
        "nats_user": "tokenizer",
        "nats_password_file": str(tmp_path / "tokenizer" / "nats-password"),
    }
    worker = creds.service_settings("worker")
    assert set(worker) == {"nats_user", "nats_password_file", "redis_user", "redis_password_file"}
    assert all("worker" in v for v in worker.values())


def test_connection_options_from_settings(tmp_path: Path) -> None:
    assert nats_auth(BusSettings(), "worker").options() == {"inbox_prefix": "_INBOX.worker"}
    assert redis_options(BusSettings(), "worker") == {}
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    bus = BusSettings(nats_password_file=str(pw), redis_password_file=str(pw), redis_user="x")
    assert nats_auth(bus, "worker").options() == {
        "inbox_prefix": "_INBOX.worker",
        "user": "worker",
        "password": "s3cret",
    }
    assert redis_options(bus, "worker") == {"username": "x", "password": "s3cret"}
    with pytest.raises(AccessError, match="cannot read the NATS password file"):
        nats_auth(BusSettings(nats_password_file=str(tmp_path / "missing")), "worker")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(AccessError, match="is empty"):
        redis_options(BusSettings(redis_password_file=str(tmp_path / "empty")), "worker")
    with pytest.raises(AccessError, match="TLS"):
        nats_auth(BusSettings(nats_tls_ca=str(tmp_path / "no-ca.pem")), "worker")
