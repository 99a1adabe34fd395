"""What `sapo run` checks before it imports torch or loads a model: a busy port, an unwritable folder, a
corrupt key or a misspelt model name should cost a second and one line, not a minute of model loading
(or of hub retries with no network) followed by the same line.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import fcntl
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

from node.config import ConfigError, NodeConfig

log = logging.getLogger(__name__)

LOCK_FILE = ".node.lock"
LOCK_FD_ENV = "SAPO_OUT_LOCK_FD"  # docker/entrypoint.sh hands its slot's lock to the node under this name
STATUS_PORT_TRIES = 20  # a busy status port gives way to the next free one among this many
HUB_PROBE_S = 3.0
# any of these makes a folder's tokenizer loadable (fast, SentencePiece or BPE vocabularies)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


@dataclass
class Preflight:
    """What the checks hold on to for the node: the status endpoint's socket, bound (so a second node
    started at the same moment cannot take the same port) but not yet served."""
    status_socket: socket.socket | None
    out_lock: int | None = None  # the run folder's lock, held while the node runs

    def close(self) -> None:
        if self.status_socket is not None:
            self.status_socket.close()
        if self.out_lock is not None:
            os.close(self.out_lock)


def check(cfg: NodeConfig, model: bool = True) -> Preflight:
    """Raise `ConfigError` naming the first problem; `model=False` for a node without one. Checks that
    create nothing come first, so a typo leaves no folder or key behind."""
    if model and (problem := model_problem(cfg.model.name, cfg.model.cache_dir)):
        raise ConfigError(f"model.name: {problem}")
    if cfg.p2p.enabled:
        for addr in cfg.p2p.listen:
            _check_listen(addr)
    check_out_dir(cfg.run.out_dir)
    _check_run_files(cfg.run.out_dir)
    out_lock = lock_out_dir(cfg.run.out_dir)
    try:
        if cfg.p2p.enabled:  # with no network a node has no identity to keep
            _check_key(cfg)
        return Preflight(bind_status(cfg) if cfg.status.enabled else None, out_lock)
    except BaseException:
        os.close(out_lock)
        raise


def lock_out_dir(out: Path, setting: str = "run.out_dir") -> int:
    """An exclusive lock on the run folder for as long as this process lives (the kernel drops it at any exit):
    a second node on the same folder would resume from the first one's checkpoint, take its identity and
    interleave its metrics. The holder's pid is written in the lock file, for the refusal's message."""
    fd = inherited_lock(out)
    if fd is None:
        fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(f"{setting}: {out} is in use by another node (pid {holder}): stop that node, or choose "
                          "another --out") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def inherited_lock(out: Path) -> int | None:
    """The descriptor of this folder's lock that the docker entrypoint took when it claimed the folder as a slot,
    handed down through exec (`SAPO_OUT_LOCK_FD`): the node goes on holding the claim's lock, so no other replica
    can take the slot between the claim and the node's start. None if there is none, or it is another file's."""
    text = os.environ.pop(LOCK_FD_ENV, None)
    try:
        fd = int(text) if text else None
        same = fd is not None and os.path.samestat(os.fstat(fd), os.stat(out / LOCK_FILE))
    except (ValueError, OSError):
        return None
    return fd if same else None


@contextlib.contextmanager
def out_dir_locked(out: Path, setting: str) -> Iterator[None]:
    """`lock_out_dir` for a block: `sapo swarm` holds its folder while its nodes run and it summarises them."""
    fd = lock_out_dir(out, setting)
    try:
        yield
    finally:
        os.close(fd)


def check_out_dir(out: Path, setting: str = "run.out_dir") -> None:
    """The run folder exists (made if need be) and is writable, or one line naming `setting`."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{setting}: {out} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{setting}: cannot create {out} ({e.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"{setting}: {out} is not writable")


# what a node writes in its run folder (name: a folder?), node.key aside (`_check_key`)
RUN_FILES = {"checkpoints": True, "metrics.jsonl": False, "metrics.rolled-back.jsonl": False, "config.json": False,
             "plan.json": False, LOCK_FILE: False}


def _check_run_files(out: Path) -> None:
    """Each is written after a round's work: one that cannot be written would lose that work, up to
    `run.checkpoint_every` rounds of it, so it is named before the first round."""
    for name, folder in RUN_FILES.items():
        path = out / name
        if not path.exists() and not path.is_symlink():
            continue
        if path.is_dir() != folder:
            raise ConfigError(f"run.out_dir: {path} is a {'file' if folder else 'folder'}, where the node "
                              f"{'keeps its checkpoints in a folder' if folder else 'writes a file'} of that name: move it aside")
        if not os.access(path, os.R_OK | os.W_OK | (os.X_OK if folder else 0)):
            raise ConfigError(f"run.out_dir: {path} is not readable and writable by this user")


def _check_key(cfg: NodeConfig) -> None:
    from p2p.identity import IdentityError, load_or_create

    try:
        load_or_create(cfg.key_file())
    except IdentityError as e:
        raise ConfigError(f"p2p.key_file: {e}") from None


def _check_listen(addr: str) -> None:
    from p2p.host import check_can_listen

    try:
        check_can_listen([addr])
    except OSError as e:
        raise ConfigError(f"p2p.listen: cannot listen on {addr} ({e.strerror}; another node on this machine?): "
                          "choose another port, or tcp/0 for any free one") from None


def bind_status(cfg: NodeConfig) -> socket.socket:
    """The status endpoint's listening socket: the configured port, or when it is busy the next free one
    (two nodes on one machine with default settings both work). Port 0 takes any free port."""
    host, port = cfg.status.address()
    tries = 1 if port == 0 else STATUS_PORT_TRIES
    for candidate in range(port, port + tries):
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        # a node restarted within a minute finds its port held by the last run's closed connections (TIME_WAIT):
        # still its own port, not a busy one (a port another socket listens on stays refused)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, candidate))
            s.listen(16)
        except OSError as e:
            s.close()
            if e.errno == errno.EADDRINUSE and candidate + 1 < port + tries:
                continue
            raise ConfigError(f"status.listen: cannot listen on {host}:{candidate} ({e.strerror}): choose another "
                              "with --status.listen HOST:PORT (port 0 picks a free one) or --status.enabled false") from None
        if candidate != port:
            log.warning("status port %d is busy (another node?); serving status on %s:%d", port, host, candidate)
        return s
    raise AssertionError("unreachable")


def names_a_folder(name: str) -> bool:
    """Whether a model name can only mean a local folder (a path, not a hub id such as `org/model`)."""
    return name.startswith(("/", "./", "../", "~")) or name.endswith("/") or name.count("/") > 1


def model_problem(name: str, cache_dir: Path) -> str | None:
    """Why `name` cannot be loaded, when that is clear without loading it: a folder that is not there or
    holds no model, or a name that is no preset, no folder and not reachable on the hub."""
    from trainer import presets

    if name in presets.names():
        return None
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            return f"{name} is a file; give the folder that holds config.json and the weights"
        if not (path / "config.json").is_file():
            return f"{name} has no config.json: not a Hugging Face model folder"
        if not any((path / f).is_file() for f in TOKENIZER_FILES):  # else an empty tokenizer loads, and fails later
            return f"{name} holds no tokenizer ({', '.join(TOKENIZER_FILES[:2])}, ...): copy the model's tokenizer files into it"
        return None
    close = difflib.get_close_matches(Path(name).name or name, presets.names(), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    choices = f"presets: {', '.join(presets.names())}"
    if names_a_folder(name):
        return f"no such folder: {name} ({hint}{choices})"
    if hub_reachable():
        return None
    go_offline()
    if _hub_cached(name):
        return None
    return (f"{name!r} is not a preset or a folder, and the model hub is unreachable from here, so it cannot be "
            f"fetched ({hint}{choices}; or a local model folder)")


def go_offline() -> None:
    """Tell huggingface_hub (and transformers through it) that the hub is unreachable: with no network it
    retries for about a minute per look-up before it falls back on its cache. It reads the variable once at
    import, so the module's copy is set too."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True


def _hub_cached(repo_id: str) -> bool:
    """A hub model downloaded before loads with no network."""
    try:
        from huggingface_hub import try_to_load_from_cache
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - a malformed repo id is simply not cached
        return False


def hub_reachable(timeout: float = HUB_PROBE_S) -> bool:
    """One TCP connection to the hub's endpoint: with no network transformers retries for about a minute."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname or "", url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError:
        return False
    return True
