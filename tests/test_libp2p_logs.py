"""Which py-libp2p log records reach the node's log: errors, minus the ones routine events cause."""

import contextlib
import logging

import pytest

from p2p.service import IDENTIFY_FAILED, LIBP2P_DROPS, MUX_FAILED, RELAY_LOGGERS, _Libp2pLogFilter, quiet_libp2p_logs

PEER = "12D3KooWDaCNFeSck173CYJ69sKf9uSCKmCfX3A1R7bXhHGsVtbn"


def record(name: str, level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


@pytest.mark.parametrize("msg", [
    f"Error in handle_incoming for peer {PEER}: ConnectionClosedError: TCP connection reset by remote peer",
    "MultiselectClient handshake: read failed: fail to read from multiselect communicator",
    "MultiselectClient handshake: write failed: fail to write to multiselect communicator",
    "Failed to open TCP stream: connection refused",
    MUX_FAILED % PEER,
])
def test_a_peer_going_away_is_not_an_error_in_our_log(msg):
    assert not _Libp2pLogFilter(logging.ERROR).filter(record("libp2p.stream_muxer.yamux", logging.ERROR, msg))


def test_other_libp2p_errors_and_our_own_records_pass():
    keep = _Libp2pLogFilter(logging.ERROR)
    assert keep.filter(record("libp2p.stream_muxer.yamux", logging.ERROR,
                              f"Error in handle_incoming for peer {PEER}: ValueError: bad frame"))
    assert keep.filter(record("p2p.host", logging.INFO, "MultiselectClient handshake: read failed"))
    assert not keep.filter(record("libp2p.pubsub", logging.WARNING, "a warning below the level"))


@contextlib.contextmanager
def node_log(level: int):
    """The records that reach the node's log handlers while it logs at `level`, py-libp2p's routed there."""
    root = logging.getLogger()
    handler, old_level = logging.Handler(), root.level
    seen: list[logging.LogRecord] = []
    handler.emit = seen.append
    root.addHandler(handler)
    root.setLevel(level)
    try:
        quiet_libp2p_logs()
        yield seen
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


@pytest.mark.parametrize("node_level, shown", [(logging.INFO, False), (logging.DEBUG, True)])
def test_relay_errors_a_peer_causes_are_counted_and_shown_only_at_debug(node_level, shown):
    before = LIBP2P_DROPS["relay_stream_errors"]
    with node_log(node_level) as seen:
        relay, client, punch = (logging.getLogger(name) for name in RELAY_LOGGERS)
        relay.error(f"Unexpected error handling hop stream from {PEER}: ")
        relay.error("Error sending status message: Cannot write to stream; stream is reset")
        client.error("Error refreshing reservation for relay %s: %s", PEER, "stream reset")
        punch.error("Error in DCUtR protocol with peer %s: %s", PEER, "stream reset")
    assert LIBP2P_DROPS["relay_stream_errors"] == before + 4
    assert len(seen) == (4 if shown else 0)



def test_an_inbound_peer_that_leaves_mid_handshake_is_counted_not_logged():
    before = LIBP2P_DROPS["inbound_upgrade_failed"]
    with node_log(logging.INFO) as seen:
        logging.getLogger("libp2p.network.swarm").error(MUX_FAILED, PEER)
        logging.getLogger("libp2p.network.swarm").error("some other swarm failure")
    assert LIBP2P_DROPS["inbound_upgrade_failed"] == before + 1
    assert [r.getMessage() for r in seen] == ["some other swarm failure"]


def test_an_identify_answer_the_asker_left_before_is_counted_not_logged():
    """30 strangers leaving at once: py-libp2p logs each unwritable identify answer at ERROR with a traceback."""
    before = LIBP2P_DROPS["identify_reply_failed"]
    reset = "Write operation failed: TCP connection reset by remote peer"
    with node_log(logging.INFO) as seen:
        logging.getLogger("libp2p.identity.identify.identify").error(IDENTIFY_FAILED, PEER, reset, "StreamError",
                                                                     "Traceback (most recent call last): ...")
        logging.getLogger("libp2p.identity.identify.identify").error("some other identify failure")
    assert LIBP2P_DROPS["identify_reply_failed"] == before + 1
    assert [r.getMessage() for r in seen] == ["some other identify failure"]
