"""Which py-libp2p log records reach the node's log: errors, minus the ones routine events cause."""

import logging

import pytest

from p2p.service import _Libp2pLogFilter

PEER = "12D3KooWDaCNFeSck173CYJ69sKf9uSCKmCfX3A1R7bXhHGsVtbn"


def record(name: str, level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


@pytest.mark.parametrize("msg", [
    f"Error in handle_incoming for peer {PEER}: ConnectionClosedError: TCP connection reset by remote peer",
    "MultiselectClient handshake: read failed: fail to read from multiselect communicator",
    "MultiselectClient handshake: write failed: fail to write to multiselect communicator",
    "Failed to open TCP stream: connection refused",
])
def test_a_peer_going_away_is_not_an_error_in_our_log(msg):
    assert not _Libp2pLogFilter(logging.ERROR).filter(record("libp2p.stream_muxer.yamux", logging.ERROR, msg))


def test_other_libp2p_errors_and_our_own_records_pass():
    keep = _Libp2pLogFilter(logging.ERROR)
    assert keep.filter(record("libp2p.stream_muxer.yamux", logging.ERROR,
                              f"Error in handle_incoming for peer {PEER}: ValueError: bad frame"))
    assert keep.filter(record("p2p.host", logging.INFO, "MultiselectClient handshake: read failed"))
    assert not keep.filter(record("libp2p.pubsub", logging.WARNING, "a warning below the level"))
