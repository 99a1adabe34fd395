"""The network layer, and nothing about learning: the node decides what to share and what to use.

config (knobs) · identity (Ed25519 key file) · wire (v1 message, codec, limits) · policy (what the
gossip validator accepts) · pool (bounded store of received groups, fair sampling) · host (libp2p
on trio: GossipSub, peer exchange, bootstrap redial) · service (the trio thread, seen from the node)
· probe (a model-free peer for tests, benchmarks and debugging).
"""
