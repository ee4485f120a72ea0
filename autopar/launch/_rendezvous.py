"""The launcher's rendezvous: torch elastic's handlers, with the stores bound, signed and fresh.

Elastic's own handlers hold three weaknesses this module closes:

* their TCPStores listen on every interface (the C++ server binds the wildcard address
  whatever host it is given), and the c10d handler unpickles the rendezvous state it reads
  from its store: anyone who can reach the port runs code in the launcher. Here every store
  the launcher hosts listens on one address (loopback for a single node, an explicit address
  otherwise: the socket is bound in Python and handed to the TCPStore), and the c10d state is
  HMAC-signed with the job's secret and verified before it is unpickled (:class:`SignedState`);
* the workers' store (MASTER_ADDR:MASTER_PORT, shared by every attempt) keeps a failed
  attempt's keys, so a restarted attempt's process group reads the dead workers' addresses
  and hangs or fails: here every attempt after the first gets a store of its own on a new port;
* a node that never joins leaves the others waiting silently (static) or ending with a bare
  timeout (c10d): here the wait is ``--join_timeout`` and the error names who is missing.

The handlers are registered with elastic's registry as ``autopar-static`` and
``autopar-c10d``; elastic's agent drives them as it drives its own.
"""
from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import hmac
import ipaddress
import os
import pickle
import socket
import sys
import time

import torch.distributed as tdist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
    Token,
)
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

STATIC = "autopar-static"
C10D = "autopar-c10d"
DEFAULT_C10D_PORT = 29400
_POLL_S = 0.05


class Secret(bytes):
    """The job's HMAC key; elastic logs its rendezvous configs, so the key never prints."""

    def __repr__(self) -> str:
        return "<secret>"

    __str__ = __repr__


def _say(message: str) -> None:
    print(f"autopar.launch: {message}", file=sys.stderr, flush=True)


def listening_store(host: str, port: int, timeout: float) -> tdist.TCPStore:
    """A TCPStore server listening on `host` only (port 0: a free one).

    TCPStore's server binds the wildcard address whatever host it is given; a socket bound
    here and handed over (``master_listen_fd``) keeps it to the one address."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise RendezvousConnectionError(f"cannot host a store on {host}: {e.strerror}") from e
    if ipaddress.ip_address(address[0].split("%")[0]).is_unspecified:
        raise RendezvousConnectionError(f"refusing to host a store on {host!r}: it would listen on every "
                                        f"interface; name the address the other nodes reach this one at")
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        bound_port = sock.getsockname()[1]
    except OSError as e:
        sock.close()
        raise RendezvousConnectionError(f"cannot host a store on {host}:{port} ({address[0]}): {e.strerror}; "
                                        f"is the address this machine's, and the port free?") from e
    return tdist.TCPStore(address[0], bound_port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout), master_listen_fd=sock.detach())


def client_store(host: str, port: int, timeout: float, whose: str) -> tdist.TCPStore:
    """A client of the store at `host`:`port`; the error says whose store did not answer."""
    try:
        return tdist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, TimeoutError) as e:  # DistNetworkError is a RuntimeError
        raise RendezvousTimeoutError(
            f"{whose} at {host}:{port} did not answer within {timeout:g} s (--join_timeout): it has not "
            f"started, or {host}:{port} is not reachable from this node") from e


def _wait_for_keys(store, keys: list[str], timeout: float) -> list[str]:
    """Wait until `store` holds every key (at most `timeout` seconds); returns those missing."""
    deadline = time.monotonic() + timeout
    while True:
        missing = [k for k in keys if not store.check([k])]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(_POLL_S)


def _announce_restart(attempt: int) -> None:
    if attempt:
        _say(f"restarting every rank (restart {attempt}); the workers get a new store")


class StaticRendezvous(RendezvousHandler):
    """``--nnodes N`` nodes with fixed ranks; node 0 hosts the store at ``addr:port``.

    Each attempt (the first, and each restart) is a round of its own: every node records that
    it joined, and waits at most `join_timeout` seconds for the others. The first attempt's
    workers use the store itself (MASTER_PORT is ``--master_port``, as with torchrun); each
    restart's workers get a fresh store that node 0 hosts on a new port."""

    def __init__(self, run_id: str, addr: str, port: int, node_rank: int, nnodes: int, join_timeout: float):
        self._run_id, self._addr, self._port = run_id, addr, port
        self._node_rank, self._nnodes, self._join_timeout = node_rank, nnodes, join_timeout
        self._store: tdist.TCPStore | None = None
        self._worker_store: tdist.TCPStore | None = None
        self._attempt = 0

    def get_backend(self) -> str:
        return STATIC

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            if self._node_rank == 0:
                self._store = listening_store(self._addr, self._port, self._join_timeout)
                self._port = self._store.port
            else:
                self._store = client_store(self._addr, self._port, self._join_timeout, "node 0's store")
        attempt, self._attempt = self._attempt, self._attempt + 1
        _announce_restart(attempt)
        store = tdist.PrefixStore(f"autopar.rendezvous.{self._run_id}.{attempt}", self._store)
        store.set(f"joined/{self._node_rank}", "1")
        missing = _wait_for_keys(store, [f"joined/{n}" for n in range(self._nnodes)], self._join_timeout)
        if missing:
            absent = [int(k.split("/")[1]) for k in missing]
            joined = [n for n in range(self._nnodes) if n not in absent]
            raise RendezvousTimeoutError(
                f"expected {self._nnodes} nodes (--nnodes {self._nnodes}); node(s) "
                f"{', '.join(map(str, absent))} did not join within {self._join_timeout:g} s (--join_timeout); "
                f"joined: node(s) {', '.join(map(str, joined))}. Start every node with the same "
                f"--master_addr {self._addr} --master_port {self._port}, each with its own --node_rank")
        return RendezvousInfo(store, self._node_rank, self._nnodes,
                              RendezvousStoreInfo(self._addr, self._worker_port(store, attempt)))

    def _worker_port(self, store, attempt: int) -> int:
        if attempt == 0:
            return self._port
        if self._node_rank == 0:
            self._worker_store = None  # the previous attempt's workers are gone; so is their store
            self._worker_store = listening_store(self._addr, 0, self._join_timeout)
            store.set("worker_port", str(self._worker_store.port))
        if _wait_for_keys(store, ["worker_port"], self._join_timeout):
            raise RendezvousTimeoutError(f"node 0 did not publish restart {attempt}'s store "
                                         f"within {self._join_timeout:g} s (--join_timeout)")
        return int(store.get("worker_port"))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        return True


class SignedState(RendezvousBackend):
    """The c10d rendezvous state in a store, signed: ``base64(HMAC-SHA256(secret, run_id + state)
    + state)``. A value whose signature does not verify is never unpickled: it is refused (one
    message on stderr) and the rendezvous goes on from the last state it could verify; that
    value's token is handed on, so the next write replaces it."""

    _EMPTY = b"autopar-empty"

    def __init__(self, store, run_id: str, secret: bytes, where: str):
        self._store, self._run_id, self._secret, self._where = store, run_id, secret, where
        self._key = "torch.rendezvous." + run_id
        self._trusted: bytes | None = None
        self._refused: set[bytes] = set()
        self._call("compare_set", self._key, "", self._EMPTY)

    @property
    def name(self) -> str:
        return C10D

    def get_state(self) -> tuple[bytes, Token] | None:
        return self._read(self._call("get", self._key))

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        signed = base64.b64encode(self._mac(state) + state)
        expected = token if isinstance(token, bytes) else self._EMPTY
        stored = self._call("compare_set", self._key, expected, signed)
        read = self._read(stored)
        return None if read is None else (*read, stored == signed)

    def _mac(self, state: bytes) -> bytes:
        return hmac.new(self._secret, self._run_id.encode() + state, hashlib.sha256).digest()

    def _read(self, stored: bytes):
        """``(state, token)`` for a stored value: the state once its signature verifies; for a
        value this job did not sign, the last verified state (None: none yet)."""
        if stored == self._EMPTY and self._trusted is None:  # once there is a state, "empty" is forged
            return None
        try:
            raw = base64.b64decode(stored, validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        mac, state = raw[:32], raw[32:]
        if len(mac) == 32 and hmac.compare_digest(mac, self._mac(state)):
            self._trusted = state
            return state, stored
        if stored not in self._refused:
            self._refused.add(stored)
            _say(f"refused a rendezvous state in the store at {self._where} that this job did not sign "
                 f"({len(stored)} bytes under {self._key!r}): it was not loaded. Someone who can reach "
                 f"the store wrote it (another job with the same --rdzv_id but another token, or an "
                 f"attacker); the job goes on with the last state it verified")
        return self._trusted, stored

    def _call(self, op: str, *args):
        try:
            return getattr(self._store, op)(*args)
        except (ValueError, RuntimeError, TimeoutError) as e:
            raise RendezvousConnectionError(f"the rendezvous store at {self._where} failed: {e}") from e


class C10dRendezvous(DynamicRendezvousHandler):
    """Elastic's dynamic (c10d) rendezvous over a :class:`SignedState`, whose workers get a
    store of their own every round, hosted by the round's node 0 on its ``local_addr``, and
    whose join timeout says how many nodes joined."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._attempt = 0

    def get_backend(self) -> str:
        return C10D

    def next_rendezvous(self) -> RendezvousInfo:
        self._shared_tcp_store_server = self._bootstrap_store_info = None  # a new store this round
        self._attempt += 1
        _announce_restart(self._attempt - 1)
        try:
            return super().next_rendezvous()
        except RendezvousTimeoutError as e:
            s, state = self._settings, self._state_holder.state
            # Timing out, this node took itself out of the state: it is counted all the same.
            nodes = sorted({str(n) for n in (*state.participants, *state.wait_list)} - {str(self._this_node)})
            nodes.append(f"{self._this_node} (this node)")
            raise RendezvousTimeoutError(
                f"the rendezvous {s.run_id!r} did not complete within {s.timeout.join.total_seconds():g} s "
                f"(--join_timeout): expected {s.min_nodes}"
                f"{'' if s.min_nodes == s.max_nodes else f' to {s.max_nodes}'} nodes, {len(nodes)} joined: "
                f"{', '.join(nodes)}. Start the missing node(s) with the same "
                f"--rdzv_endpoint, --rdzv_id and token") from e

    def _create_tcp_store_server(self, master_addr, master_port) -> tdist.TCPStore:
        return listening_store(master_addr, master_port, self._settings.timeout.join.total_seconds())


def _c10d_store(endpoint: str, timeout: float) -> tdist.TCPStore:
    """The c10d rendezvous store: hosted here, bound to the endpoint's address, when that
    address is this machine's and the port is free; else a client of the node that hosts it."""
    host, port = parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_C10D_PORT)
    if _matches_machine_hostname(host):
        try:
            return listening_store(host, port, timeout)
        except RendezvousConnectionError:  # another launcher on this machine hosts it
            pass
    return client_store(host, port, timeout, "the rendezvous store")


def create_static(params: RendezvousParameters) -> StaticRendezvous:
    addr, port = parse_rendezvous_endpoint(params.endpoint, default_port=-1)
    return StaticRendezvous(params.run_id, addr, port, int(params.config["rank"]), params.max_nodes,
                            float(params.config["join_timeout"]))


def create_c10d(params: RendezvousParameters) -> C10dRendezvous:
    join = float(params.config["join_timeout"])
    # Elastic's opt-out of the agent-hosted workers' store would have the workers' rank 0 host
    # it, on every interface; this launcher always hosts it.
    os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    store = _c10d_store(params.endpoint, join)
    backend = SignedState(store, params.run_id, params.config["secret"], params.endpoint)
    seconds = {k: datetime.timedelta(seconds=float(params.config[k + "_timeout"]))
               for k in ("last_call", "close", "heartbeat") if k + "_timeout" in params.config}
    return C10dRendezvous.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, params.local_addr,
        RendezvousTimeout(join=datetime.timedelta(seconds=join), **seconds),
        keep_alive_interval=float(params.config.get("keep_alive_interval", 5)),
        keep_alive_max_attempt=int(params.config.get("keep_alive_max_attempt", 3)),
    )


def register() -> None:
    """Make the handlers known to elastic's registry (idempotent)."""
    rendezvous_handler_registry.register(STATIC, create_static)
    rendezvous_handler_registry.register(C10D, create_c10d)


def address_towards(endpoint: str) -> str:
    """This machine's address on the route to `endpoint` (a UDP socket's connect sends nothing)."""
    host, port = parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_C10D_PORT)
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(address)
        return s.getsockname()[0]
