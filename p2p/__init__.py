"""The network layer (libp2p host, identity, gossip, wire protocol, rollout pool).

Empty until the p2p work lands: a node runs as a silo until then. Nothing about learning will
live here; the node decides what to share and accept.
"""
