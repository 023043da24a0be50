"""A pool across "hosts" (loopback addresses), without engines: `mctier master --host`,
`mctier store-server` joining it from another address, and the HA leader lookup on a real etcd."""

from __future__ import annotations

import signal
import sys

import pytest

from kvcore.errors import ConfigError
from kvcore.procs import Proc
from mcstore.admin import MasterAdmin
from mcstore.ha import leader, parse_entry
from mcstore.server import Master, StoreCluster
from tests.harness import LOGS, ROOT
from tests.hosts import Etcd, listeners_of
from tests.support import wait_for

pytestmark = pytest.mark.integration


def test_store_server_joins_a_pool_from_another_address():
    with StoreCluster(LOGS, host="127.0.0.11", segment_size=32 << 20) as c:
        assert listeners_of(c.master.pid) == sorted([("127.0.0.11", c.port), ("127.0.0.11", c.metrics_port)])
        admin = MasterAdmin(f"http://127.0.0.11:{c.metrics_port}")
        assert len(admin.segments()) == 1
        joiner = Proc("store-server-cli", [sys.executable, "-m", "multi.cli", "store-server", "--master", c.master_addr,
                                           "--host", "127.0.0.12", "--segment-size", "32MB"],
                      LOGS / "store-server-cli.log", cwd=str(ROOT))
        try:
            assert wait_for(lambda: len(admin.segments()) == 2, 30, 0.3), joiner.tail()
            names = " ".join(str(s) for s in admin.segments())
            assert "127.0.0.12" in names and "127.0.0.11" in names, names
            joiner.stop(grace=15, sig=signal.SIGTERM)
            assert joiner.popen.returncode == 0, joiner.tail()
            assert wait_for(lambda: len(admin.segments()) == 1, 15, 0.3), "the segment did not leave the pool"
        finally:
            joiner.stop()


def test_store_server_without_a_master_fails_fast():
    p = Proc("store-server-nomaster", [sys.executable, "-m", "multi.cli", "store-server", "--master", "127.0.0.13:1",
                                       "--host", "127.0.0.13", "--segment-size", "16MB"],
             LOGS / "store-server-nomaster.log", cwd=str(ROOT))
    try:
        p.popen.wait(timeout=60)
    finally:
        p.stop()
    assert p.popen.returncode != 0


def test_ha_leader_is_read_from_etcd_and_a_standby_takes_over():
    etcd = Etcd("127.0.0.14")
    masters = []
    try:
        assert leader([etcd.endpoint]) is None  # no master yet
        masters = [Master(LOGS, "127.0.0.15", ha_etcd=etcd.endpoint).start() for _ in range(2)]
        first = leader([etcd.endpoint])
        lead = next(m for m in masters if m.rpc == first)
        standby = next(m for m in masters if m is not lead)
        assert lead.leads() and not standby.leads()  # a standby does not even listen on its RPC port
        lead.stop(sig=signal.SIGKILL)
        assert standby.wait_leader(60) == standby.rpc
    finally:
        for m in masters:
            m.stop()
        etcd.stop()
    assert leader([etcd.endpoint], timeout=0.5) is None  # etcd gone: no leader, no hang


@pytest.mark.unit
def test_ha_entries_and_addresses():
    assert parse_entry("127.0.0.1:50051") is None
    assert parse_entry("etcd://127.0.0.2:2379;127.0.0.3:2379") == ["127.0.0.2:2379", "127.0.0.3:2379"]
    for bad in ("etcd://", "etcd://host", "etcd://h:p"):
        with pytest.raises(ConfigError):
            parse_entry(bad)
    with pytest.raises(ConfigError, match="wildcard"):
        Master(LOGS, "0.0.0.0", ha_etcd="127.0.0.2:2379")
    assert "--enable_oplog=true" in Master(LOGS, "127.0.0.2", port=1, metrics_port=2, ha_etcd="127.0.0.2:2379").argv()
