"""The local address and interface a node of a multi-node deployment serves from.

Gloo (CPU) and NCCL's bootstrap (GPU) pick a process's own address from its hostname unless
told otherwise, and on many hosts the hostname resolves to a loopback address, which no other
host can reach (``Gloo connectFullMesh failed ... remote=[127.0.0.1]``). So every process of a
multi-node deployment binds its data plane to one interface, chosen here once per node:

1. ``--network-interface`` when given, else ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``
   (the one the node's devices use) when it names one interface;
2. else the interface that holds ``--node-ip`` when given;
3. else the interface holding the local address the kernel routes ``--dist-init-addr`` from.

The choice is checked before any process starts, each failure one line that names the address,
the interface and the flag to change: node 0 must own ``--dist-init-addr`` (its store and
ZeroMQ socket listen there); the chosen interface must be the one that routes to it; another
node must reach it (a connection refused means node 0 is not up yet: it waits; no route, or no
answer within ``REACH_TIMEOUT_S``, is an error). A variable the user set is never overridden.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass

from sangam.config import EngineConfig

logger = logging.getLogger(__name__)

REACH_TIMEOUT_S = 5.0  # a TCP handshake to node 0 that gets no answer at all
AWAIT_NODE0_S = 300.0  # another node started before node 0: how long it waits for it
_SIOCGIFADDR = 0x8915  # Linux: an interface's primary IPv4 address


class NetworkError(ValueError):
    """A multi-node deployment this node cannot serve from, said in one line."""


@dataclass(frozen=True)
class NodeAddress:
    """Where this node's processes bind their data plane."""

    ip: str
    interface: str

    def environment(self, device_type: str) -> dict[str, str]:
        """The variables gloo or NCCL read for their interface, where the user set none."""
        name = interface_variable(device_type)
        return {} if os.environ.get(name) else {name: self.interface}


def interface_variable(device_type: str) -> str:
    """The variable the data plane's library reads its interface from."""
    return "NCCL_SOCKET_IFNAME" if device_type == "cuda" else "GLOO_SOCKET_IFNAME"


def split_addr(addr: str) -> tuple[str, int]:
    """``host:port`` (``--dist-init-addr``) split."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"dist_init_addr must be host:port (port 1-65534: PORT+1 is used "
                         f"too), got {addr!r}")
    return host, int(port)


def interface_addresses() -> dict[str, str]:
    """Every interface of this host with an IPv4 address: name -> address."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):  # no IPv4 address
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
                out[name] = socket.inet_ntoa(raw[20:24])
    return out


def resolve(host: str) -> str:
    """``host``'s IPv4 address (NetworkError if it has none)."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        raise NetworkError(f"--dist-init-addr {host!r} does not resolve to an IPv4 address "
                           f"({e.strerror or e})") from None


def _routed_source(peer: str, what: str) -> str:
    """The local address the kernel would send to ``peer`` from (nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
        except OSError as e:
            raise NetworkError(f"no route from this host to {peer} ({what}): "
                               f"{e.strerror}; check the address, or this host's routes "
                               "and interfaces") from None
        return s.getsockname()[0]


def _owner(ip: str, addresses: dict[str, str]) -> str | None:
    return next((name for name, a in addresses.items() if a == ip), None)


def _named_interface(config: EngineConfig, device_type: str) -> tuple[str, str] | None:
    """(interface, where it was named), if one was."""
    if config.network_interface:
        return config.network_interface, "--network-interface"
    name = interface_variable(device_type)
    value = os.environ.get(name, "")
    # A list or a prefix rule ("eth", "^docker") is the library's to apply: not checked here.
    if value and "," not in value and not value.startswith(("^", "=")):
        return value, name
    return None


def node_address(config: EngineConfig, device_type: str) -> NodeAddress:
    """This node's address and interface (see the module docstring); raises NetworkError."""
    host, port = split_addr(config.dist_init_addr)
    peer = resolve(host)
    return _checked(config, local_address(config, device_type, peer), peer, port)


def local_address(config: EngineConfig, device_type: str, peer: str,
                  what: str = "--dist-init-addr") -> NodeAddress:
    """The address and interface this process reaches ``peer`` (an IPv4 address: ``what``)
    from, as named or as routed; raises NetworkError."""
    addresses = interface_addresses()
    source = _routed_source(peer, what)
    routed = _owner(source, addresses)
    named = _named_interface(config, device_type)
    if named is not None:
        interface, flag = named
        if interface not in addresses:
            have = ", ".join(f"{n} ({a})" for n, a in addresses.items())
            raise NetworkError(f"{flag} {interface!r} is not an interface of this host with an "
                               f"IPv4 address; it has {have}")
        ip = addresses[interface]
    elif config.node_ip:
        interface = _owner(config.node_ip, addresses)
        if interface is None:
            raise NetworkError(f"--node-ip {config.node_ip} is not an address of this host "
                               f"(it has {', '.join(sorted(addresses.values()))})")
        ip, flag = config.node_ip, "--node-ip"
    else:
        if routed is None:
            raise NetworkError(f"the route to {peer} ({what}) leaves from {source}, which no "
                               "interface holds; name one with --network-interface")
        return NodeAddress(source, routed)
    if interface != routed:
        raise NetworkError(f"{flag} {interface} ({ip}) does not carry the route to {peer} "
                           f"({what}): it leaves from {routed or '?'} ({source}); "
                           f"change {flag} or {what}")
    return NodeAddress(ip, interface)


def _checked(config: EngineConfig, address: NodeAddress, peer: str, port: int) -> NodeAddress:
    if config.node_rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((peer, 0))
            except OSError as e:
                if e.errno != errno.EADDRNOTAVAIL:
                    raise
                raise NetworkError(
                    f"--dist-init-addr {peer} is not an address of this host: node 0 runs the "
                    f"front, whose store and socket listen there; give one of "
                    f"{', '.join(sorted(interface_addresses().values()))}") from None
    else:
        _await_reachable(address, peer, port + 1)
    logger.info("node %d serves from %s (%s)", config.node_rank, address.ip, address.interface)
    return address


def _await_reachable(address: NodeAddress, peer: str, port: int) -> None:
    """Connect to node 0's front socket from ``address``: refused means not up yet (retried,
    quietly but for one line); no route or no answer is an error."""
    said = False
    deadline = time.monotonic() + AWAIT_NODE0_S
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(REACH_TIMEOUT_S)
            try:
                s.bind((address.ip, 0))
                s.connect((peer, port))
                return
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise NetworkError(f"node 0 did not come up at {peer}:{port} in "
                                       f"{AWAIT_NODE0_S:g}s (connection refused)") from None
                if not said:
                    logger.warning("node 0 (%s:%d) is not up yet; waiting for it", peer, port)
                    said = True
            except (TimeoutError, OSError) as e:
                why = "no answer" if isinstance(e, TimeoutError) else e.strerror
                raise NetworkError(
                    f"cannot reach node 0 at {peer}:{port} from {address.ip} "
                    f"({address.interface}): {why} within {REACH_TIMEOUT_S:g}s; check "
                    "--dist-init-addr, --network-interface and firewalls (ports PORT and "
                    "PORT+1 of --dist-init-addr, and the data plane's)") from None
        time.sleep(0.5)

