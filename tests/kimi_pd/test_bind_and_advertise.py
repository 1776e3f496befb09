"""Bind address vs advertised address: a worker listening on every interface must say where other
hosts reach it, or it would register (and hand decode workers) an address that means "yourself"."""
from __future__ import annotations

import argparse

import pytest

from worker.cli import settings_from_args
from worker.flags import add_worker_args


def settings(*argv: str):
    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    return settings_from_args(parser.parse_args(list(argv)), "DIR")


def test_kv_advertise_host_is_what_decode_workers_are_told():
    s = settings("--kv-host", "0.0.0.0", "--kv-advertise-host", "10.0.0.5")
    assert (s.transfer_host, s.transfer_address) == ("0.0.0.0", "10.0.0.5")
    assert settings("--kv-host", "10.0.0.6").transfer_address == "10.0.0.6"     # default: the bind address


@pytest.mark.parametrize("argv, flag", [
    (("--kv-host", "0.0.0.0"), "--kv-advertise-host"),
    (("--host", "0.0.0.0", "--redis-url", "redis://store:6379/0"), "--advertise-url"),
])
def test_a_wildcard_address_is_never_advertised(argv, flag):
    with pytest.raises(ValueError, match=flag):
        settings(*argv).validate()


def test_a_wildcard_http_bind_without_a_store_advertises_nothing_and_is_fine():
    settings("--host", "0.0.0.0").validate()
    settings("--host", "0.0.0.0", "--advertise-url", "http://10.0.0.5:8100", "--redis-url", "redis://s:6379/0").validate()
