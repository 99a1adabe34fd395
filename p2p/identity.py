"""The node's Ed25519 key: created once, then the same peer id on every restart."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.peer.id import ID

log = logging.getLogger(__name__)


class IdentityError(RuntimeError):
    """The key file exists but cannot be used. It is never replaced behind the user's back."""


def load_or_create(path: Path) -> KeyPair:
    path = Path(path)
    if path.exists():
        return load(path)
    key_pair = create_new_key_pair()
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, key_pair.private_key.serialize())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.link(tmp, path)  # fails if another process created the key meanwhile: keep theirs
    except FileExistsError:
        if path.exists():
            return load(path)
        raise IdentityError(f"cannot create key file {path}: {path.parent} is not a folder") from None
    except OSError as e:
        raise IdentityError(f"cannot create key file {path}: {e.strerror}") from None
    finally:
        with contextlib.suppress(OSError):  # nothing to remove when the folder could not be made
            tmp.unlink()
    log.info("created identity %s (peer id %s)", path, peer_id(key_pair))
    return key_pair


def load(path: Path) -> KeyPair:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise IdentityError(f"cannot read key file {path}: {e.strerror}") from None
    try:
        private = deserialize_private_key(data)
        key_pair = KeyPair(private, private.get_public_key())
        key_pair.public_key.serialize()
    except Exception as e:  # the decoder raises protobuf, ValueError and crypto errors alike
        raise IdentityError(f"key file {path} is not a libp2p private key ({type(e).__name__}); "
                            "move it away to create a new identity (the peer id will change)") from None
    if key_pair.private_key.get_type().name != "Ed25519":
        raise IdentityError(f"key file {path} holds a {key_pair.private_key.get_type().name} key; sapo uses Ed25519")
    if os.name == "posix" and Path(path).stat().st_mode & 0o077:
        log.warning("key file %s is readable by other users; chmod 600 it", path)
    return key_pair


def peer_id(key_pair: KeyPair) -> str:
    return ID.from_pubkey(key_pair.public_key).to_base58()


def seed_of(key_pair: KeyPair) -> int:
    """A run seed this identity owns: nodes started with the same settings (compose replicas, two users' defaults)
    draw their own tasks and samples, not one stream, and a node restarted with its key draws the same ones."""
    return int.from_bytes(hashlib.sha256(key_pair.public_key.serialize()).digest()[:4], "big") >> 1
