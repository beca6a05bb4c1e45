"""Several decoder replicas behind one gateway: targets, DNS resolution, health, balancing.

``--decoder`` takes one or more targets (the option repeated, and/or a
comma-separated list). `parse_decoder_targets` checks them; every error
names the option. A target is one of:

* ``unix:///abs/path.sock`` (or ``unix:relative.sock``), an IP literal
  ``host:port`` (``[v6]:port``), or one of gRPC's ``ipv4:``, ``ipv6:``,
  ``unix-abstract:``, ``vsock:`` targets: one replica, as configured;
  ``localhost`` and wildcard hosts dial 127.0.0.1, as a single target
  always did;
* ``dns:///name:port`` or a plain ``name:port``: every address the name
  resolves to (`socket.getaddrinfo`, IPv4 and IPv6) is a replica, and the
  name is resolved again every ``--decoder-resolve-interval-s`` seconds, so
  replicas that appear or disappear (a Kubernetes headless Service) are
  added and removed. A failed lookup keeps the previous addresses.

`ReplicaPool` holds one `Replica` per address: its own `DecoderClient`
(a channel with pick_first to that one address) and its own
`DecoderMonitor` (client-side health checking with grpc.health.v1). New
requests go to a replica whose last check passed (round-robin, or the one
with the fewest streams open from this gateway); a replica that failed its
check gets none until a check passes again. Each stream stays on its
replica, and the pool remembers which replica runs which request so an
Abort reaches the right one. The gateway is healthy while any replica is.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import socket
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway import metrics
from gateway.decoder_client import DecoderClient, DecoderInfo
from gateway.health import DEFAULT_INTERVAL_S, DEFAULT_TIMEOUT_S, DecoderMonitor
from omni_common.errors import InvalidArgumentError, OmniError, UnavailableError, quote_value
from omni_common.net import LOCAL_DIAL_HOSTS, WILDCARD_HOSTS
from omni_common.server import client_target

logger = logging.getLogger(__name__)

BALANCE_ROUND_ROBIN = "round-robin"
BALANCE_LEAST_OUTSTANDING = "least-outstanding"
BALANCE_POLICIES = (BALANCE_ROUND_ROBIN, BALANCE_LEAST_OUTSTANDING)
"""Values of ``--decoder-balance``."""
DEFAULT_RESOLVE_INTERVAL_S = 5.0
"""Time between two lookups of a DNS target's addresses."""
DEFAULT_INFO_INTERVAL_S = 1.0
"""Time between two `GetDecoderInfo` polls of each healthy replica (per-replica metrics)."""
RESOLVE_TIMEOUT_S = 5.0
"""Longest one lookup may take; a slower one counts as failed (the old addresses stay)."""
EMPTY_RESOLVE_RETRY_S = 1.0
"""While a DNS target has no address yet, it is looked up at least this often."""

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""``(host, port)`` -> the host's IP addresses, as text (``10.0.0.7``, ``fd00::7``)."""

_STATIC_SCHEMES = ("ipv4:", "ipv6:", "unix-abstract:", "vsock:")
_HOSTNAME = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]*)(?:\.[A-Za-z0-9_-]+)*\.?$")
_SYNTAX = "use unix:///abs/path.sock, host:port or dns:///name:port"
_MAX_LABEL_CHARS = 200
_PICK_FIRST = [("grpc.lb_policy_name", "pick_first")]


@dataclass(frozen=True)
class DecoderTarget:
    """One ``--decoder`` entry: a fixed channel target, or a name to resolve."""

    spec: str
    """The entry as configured."""
    dial: str = ""
    """The channel target of a fixed replica; empty for a name to resolve."""
    host: str = ""
    """The name to resolve (``dns:`` targets and plain ``name:port``)."""
    port: int = 0

    @property
    def resolved(self) -> bool:
        """True for a name whose addresses are looked up (and looked up again)."""
        return not self.dial


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _host_port(text: str, entry: str, field: str) -> tuple[str, int]:
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit():
        raise InvalidArgumentError(field, f"{quote_value(entry)}: expected a port; {_SYNTAX}")
    port = int(port_text)
    if not 0 < port <= 65535:
        raise InvalidArgumentError(field, f"{quote_value(entry)}: port must be 1-65535")
    if host in LOCAL_DIAL_HOSTS:
        return host, port
    if host.startswith("[") and host.endswith("]"):
        if ":" not in host or not _is_ip(host[1:-1]):
            raise InvalidArgumentError(field, f"{quote_value(entry)}: not an IPv6 address")
        return host, port
    if ":" in host:
        raise InvalidArgumentError(
            field, f"{quote_value(entry)}: an IPv6 address goes in brackets ([::1]:PORT)"
        )
    if not _HOSTNAME.match(host):
        raise InvalidArgumentError(field, f"{quote_value(entry)}: not a host name; {_SYNTAX}")
    return host, port


def parse_decoder_target(entry: str, *, field: str = "decoder") -> DecoderTarget:
    """One target (no commas); InvalidArgumentError naming `field` if it is malformed."""
    text = entry.strip()
    if not text:
        raise InvalidArgumentError(field, f"empty target; {_SYNTAX}")
    if any(c.isspace() for c in text):
        raise InvalidArgumentError(field, f"{quote_value(text)}: a target has no spaces")
    if "://" in text:
        scheme = text.split("://", 1)[0]
        if scheme not in ("unix", "dns"):
            raise InvalidArgumentError(
                field, f"{quote_value(text)}: unknown scheme {quote_value(scheme)}; {_SYNTAX}"
            )
    if text.startswith("unix:"):
        try:
            return DecoderTarget(text, dial=client_target(text))
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(field, str(exc).partition(": ")[2]) from exc
    if text.startswith(_STATIC_SCHEMES):
        if not text.partition(":")[2]:
            raise InvalidArgumentError(field, f"{quote_value(text)}: no address after the scheme")
        return DecoderTarget(text, dial=text)
    if text.startswith("dns:"):
        rest = text[len("dns:") :]
        if rest.startswith("//"):
            authority, slash, rest = rest[2:].partition("/")
            if authority:
                raise InvalidArgumentError(
                    field,
                    f"{quote_value(text)}: a DNS server in the target is not supported "
                    "(the system resolver is used); write dns:///name:port",
                )
            if not slash:
                raise InvalidArgumentError(field, f"{quote_value(text)}: {_SYNTAX}")
        host, port = _host_port(rest, text, field)
        if host in WILDCARD_HOSTS:
            raise InvalidArgumentError(field, f"{quote_value(text)}: needs a name to resolve")
        return DecoderTarget(text, host=host.strip("[]"), port=port)
    host, port = _host_port(text, text, field)
    if host in LOCAL_DIAL_HOSTS or _is_ip(host.strip("[]")):
        return DecoderTarget(text, dial=client_target(text))
    return DecoderTarget(text, host=host, port=port)


def parse_decoder_targets(
    values: str | Iterable[str | DecoderTarget], *, field: str = "decoder"
) -> tuple[DecoderTarget, ...]:
    """Every target in `values` (each may be a comma-separated list), checked.

    Raises InvalidArgumentError naming `field` for an empty entry (``a,,b``),
    a malformed or unknown target, the same target twice, or no target.
    """
    if isinstance(values, str):
        values = [values]
    targets: list[DecoderTarget] = []
    for value in values:
        if isinstance(value, DecoderTarget):
            targets.append(value)
            continue
        for index, part in enumerate(value.split(",")):
            if not part.strip():
                raise InvalidArgumentError(
                    field,
                    f"{quote_value(value)}: entry {index + 1} is empty; "
                    "separate targets with single commas",
                )
            targets.append(parse_decoder_target(part, field=field))
    if not targets:
        raise InvalidArgumentError(field, f"give at least one decoder target; {_SYNTAX}")
    seen: set[str] = set()
    for target in targets:
        key = target.dial or f"dns:{target.host}:{target.port}"
        if key in seen:
            raise InvalidArgumentError(field, f"{quote_value(target.spec)} is given twice")
        seen.add(key)
    return tuple(targets)


def replica_label(target: str) -> str:
    """A replica's name in metrics and logs: its address (no ``ipv4:``/``ipv6:`` prefix).

    Targets carry no credentials (`parse_decoder_target` accepts none); the
    label is still cut to printable characters and a bounded length.
    """
    for prefix in ("ipv4:", "ipv6:"):
        if target.startswith(prefix):
            target = target[len(prefix) :]
    label = "".join(c if c.isprintable() and not c.isspace() else "?" for c in target)
    return label[:_MAX_LABEL_CHARS]


def _resolved_address(ip: str, port: int) -> tuple[str, str]:
    """(label, channel target) of one resolved address."""
    if ":" in ip:
        return f"[{ip}]:{port}", f"ipv6:[{ip}]:{port}"
    return f"{ip}:{port}", f"ipv4:{ip}:{port}"


async def resolve_host(host: str, port: int) -> list[str]:
    """The default `Resolver`: every IPv4 and IPv6 address of `host`, in resolver order."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    families = (socket.AF_INET, socket.AF_INET6)
    return list(dict.fromkeys(str(info[4][0]) for info in infos if info[0] in families))


class Replica:
    """One decoder: its own channel (pick_first to one address), health monitor and counters."""

    def __init__(
        self,
        label: str,
        client: DecoderClient,
        on_change: Callable[[Replica, bool], Awaitable[None]],
        *,
        interval_s: float,
        timeout_s: float,
        admitted: bool,
    ) -> None:
        self.label = label
        self.client = client

        async def changed(healthy: bool) -> None:
            await on_change(self, healthy)

        self.monitor = DecoderMonitor(client, changed, interval_s=interval_s, timeout_s=timeout_s)
        self.admitted = admitted
        """False for a DNS-found replica until its first check has answered."""
        self.removed = False
        """True once it left the pool (its open streams may still finish on it)."""
        self.in_flight = 0
        """Streams this gateway has open on it."""
        self.started = 0
        """Streams this gateway started on it."""
        self.info: DecoderInfo | None = None

    @property
    def healthy(self) -> bool | None:
        """The last check's answer; None before the first check."""
        return self.monitor.healthy

    @property
    def eligible(self) -> bool:
        """May it get a new request? (Unchecked counts: a pool nobody started has no monitor.)"""
        return self.admitted and not self.removed and self.healthy is not False

    def __repr__(self) -> str:
        return f"Replica({self.label!r}, healthy={self.healthy}, in_flight={self.in_flight})"


@dataclass(eq=False)
class Assignment:
    """A request running on a replica (`ReplicaPool.begin` / `end`)."""

    request_id: str
    replica: Replica


def _signature(info: DecoderInfo) -> tuple[str, tuple[str, ...], int]:
    return info.profile, info.voices, info.sample_rate_hz


def _forget_metrics(label: str) -> None:
    for collector in metrics.DECODER_COLLECTORS:
        with contextlib.suppress(KeyError):
            collector.remove(label)


class ReplicaPool:
    """The gateway's decoders. Create it inside its event loop; `start` it to check them.

    A pool nobody started (an engine built around one `DecoderClient`)
    sends every request to its replica, as a plain client would.
    """

    def __init__(
        self,
        targets: str | Iterable[str | DecoderTarget] = (),
        *,
        balance: str = BALANCE_ROUND_ROBIN,
        resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S,
        health_interval_s: float = DEFAULT_INTERVAL_S,
        health_timeout_s: float = DEFAULT_TIMEOUT_S,
        info_interval_s: float = DEFAULT_INFO_INTERVAL_S,
        resolver: Resolver | None = None,
        on_change: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        if balance not in BALANCE_POLICIES:
            raise InvalidArgumentError(
                "decoder_balance",
                f"{quote_value(balance)} is not one of {', '.join(BALANCE_POLICIES)}",
            )
        for name, value in (
            ("decoder_resolve_interval_s", resolve_interval_s),
            ("health_interval_s", health_interval_s),
            ("health_timeout_s", health_timeout_s),
            ("info_interval_s", info_interval_s),
        ):
            if not value > 0:
                raise InvalidArgumentError(name, f"must be > 0, got {value}")
        items = [targets] if isinstance(targets, str) else list(targets)
        self.targets = parse_decoder_targets(items) if items else ()
        self.balance = balance
        self.resolve_interval_s = resolve_interval_s
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.info_interval_s = info_interval_s
        self.on_change = on_change
        """Called with the gateway's health (any replica healthy) whenever it flips."""
        self._resolver: Resolver = resolver or resolve_host
        self._replicas: dict[str, Replica] = {}
        self._draining: set[Replica] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self._requests: dict[str, Assignment] = {}
        self._resolved: dict[DecoderTarget, tuple[tuple[str, str], ...]] = {}
        self._lookup_failing: set[DecoderTarget] = set()
        self._warned: set[frozenset[tuple[str, tuple[str, ...], int]]] = set()
        self._turn = 0
        self._healthy: bool | None = None
        self._health_lock = asyncio.Lock()
        self._resolve_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._closed = False
        for target in self.targets:
            if not target.resolved:
                self._add(replica_label(target.dial), self._client(target.dial), admitted=True)

    @classmethod
    def of_client(cls, client: DecoderClient) -> ReplicaPool:
        """A pool of one replica around an existing client (it closes the client)."""
        pool = cls()
        pool._add(replica_label(client.target), client, admitted=True)
        return pool

    # -- state ---------------------------------------------------------------
    @property
    def healthy(self) -> bool | None:
        """True while any replica passes its checks; None before the first checks."""
        return self._healthy

    @property
    def replicas(self) -> list[Replica]:
        """The replicas in the pool (DNS-found ones once checked), in configuration order."""
        return [r for r in self._replicas.values() if r.admitted]

    def replica_of(self, request_id: str) -> Replica | None:
        """The replica a running request is on."""
        assignment = self._requests.get(request_id)
        return None if assignment is None else assignment.replica

    def unavailable(self) -> UnavailableError:
        return UnavailableError(f"no healthy decoder, {len(self.replicas)} configured")

    # -- balancing and request tracking --------------------------------------
    def pick(self, exclude: Collection[Replica] = ()) -> Replica:
        """The replica for a new request (UnavailableError when none is healthy)."""
        candidates = [r for r in self._replicas.values() if r.eligible and r not in exclude]
        if not candidates:
            raise self.unavailable()
        if self.balance == BALANCE_LEAST_OUTSTANDING:
            fewest = min(r.in_flight for r in candidates)
            candidates = [r for r in candidates if r.in_flight == fewest]
        replica = candidates[self._turn % len(candidates)]
        self._turn += 1
        return replica

    def begin(self, request_id: str, replica: Replica) -> Assignment:
        """Record that `request_id` now runs on `replica`."""
        assignment = Assignment(request_id, replica)
        self._requests[request_id] = assignment
        replica.in_flight += 1
        replica.started += 1
        if not replica.removed:
            metrics.DECODER_REQUESTS.labels(replica.label).inc()
            metrics.DECODER_IN_FLIGHT.labels(replica.label).set(replica.in_flight)
        return assignment

    def end(self, assignment: Assignment, *, retried: bool = False) -> None:
        """The request's stream on its replica is over (`retried`: it moves to another)."""
        if self._requests.get(assignment.request_id) is assignment:
            del self._requests[assignment.request_id]
        replica = assignment.replica
        replica.in_flight -= 1
        if not replica.removed:
            metrics.DECODER_IN_FLIGHT.labels(replica.label).set(replica.in_flight)
            if retried:
                metrics.DECODER_RETRIES.labels(replica.label).inc()
        elif replica.in_flight == 0 and replica in self._draining:
            self._draining.discard(replica)
            self._close_later(replica)

    def abort(self, request_ids: Iterable[str]) -> Coroutine[Any, Any, list[str]]:
        """Abort requests on the replicas they run on; returns those reported aborted.

        The replicas are looked up now, so the returned coroutine may be
        shielded and awaited after the requests' tracking has ended.
        """
        groups: dict[Replica, list[str]] = {}
        for request_id in request_ids:
            assignment = self._requests.get(request_id)
            if assignment is not None:
                groups.setdefault(assignment.replica, []).append(request_id)
        return self._abort_groups(groups)

    @staticmethod
    async def _abort_groups(groups: dict[Replica, list[str]]) -> list[str]:
        results = await asyncio.gather(*(r.client.abort(ids) for r, ids in groups.items()))
        return [request_id for ids in results for request_id in ids]

    def suspect(self, replica: Replica) -> None:
        """A call on `replica` saw UNAVAILABLE: check it now, not at the next interval."""
        replica.monitor.wake()

    # -- decoder info ----------------------------------------------------------
    async def info(self, *, refresh: bool = False) -> DecoderInfo:
        """`GetDecoderInfo` of a healthy replica (UnavailableError when none is)."""
        candidates = [r for r in self._replicas.values() if r.eligible]
        if not candidates:
            raise self.unavailable()
        candidates.sort(key=lambda r: r.healthy is not True)  # checked-healthy first
        error: OmniError | None = None
        for replica in candidates:
            try:
                info = await replica.client.info(refresh=refresh)
            except UnavailableError as exc:
                self.suspect(replica)
                error = exc
                continue
            self._note_info(replica, info)
            return info
        assert error is not None
        raise error

    def _note_info(self, replica: Replica, info: DecoderInfo) -> None:
        replica.info = info
        if replica.removed:
            return
        metrics.DECODER_ACTIVE_REQUESTS.labels(replica.label).set(info.active_requests)
        metrics.DECODER_FALLBACK_STEPS.labels(replica.label).set(info.fallback_steps)
        metrics.DECODER_FINISHED_REQUESTS.labels(replica.label).set(info.finished_requests)
        groups: dict[tuple[str, tuple[str, ...], int], list[str]] = {}
        for other in self._replicas.values():
            if other.info is not None:
                groups.setdefault(_signature(other.info), []).append(other.label)
        if len(groups) > 1 and frozenset(groups) not in self._warned:
            self._warned.add(frozenset(groups))
            logger.warning(
                "decoder replicas disagree on what they serve: %s",
                "; ".join(
                    f"{', '.join(labels)}: profile {profile!r}, voices {list(voices)}, {rate} Hz"
                    for (profile, voices, rate), labels in groups.items()
                ),
            )

    # -- lifecycle --------------------------------------------------------------
    async def start(self) -> None:
        """Check every replica once (so health is right at once), then keep checking."""
        if self._started:
            return
        self._started = True
        await asyncio.gather(*(r.monitor.start() for r in list(self._replicas.values())))
        if any(t.resolved for t in self.targets):
            await self._resolve_once()
        await self._update_health()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._poll_info_loop(), name="decoder-info-poll"))
        if any(t.resolved for t in self.targets):
            self._tasks.append(loop.create_task(self._resolve_loop(), name="decoder-resolve"))

    async def stop(self) -> None:
        """Stop the health checks, polls and lookups; channels stay open for running streams."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        replicas = [*self._replicas.values(), *self._draining]
        await asyncio.gather(*(r.monitor.stop() for r in replicas))

    async def close(self) -> None:
        """Stop, then close every replica's channel and forget its metrics."""
        await self.stop()
        self._closed = True
        replicas = [*self._replicas.values(), *self._draining]
        self._replicas.clear()
        self._draining.clear()
        for replica in replicas:
            if not replica.removed:
                replica.removed = True
                _forget_metrics(replica.label)
        closing, self._closing = list(self._closing), set()
        await asyncio.gather(*(r.client.close() for r in replicas), *closing)

    # -- internals --------------------------------------------------------------
    @staticmethod
    def _client(dial: str) -> DecoderClient:
        return DecoderClient(dial, options=_PICK_FIRST)

    def _add(self, label: str, client: DecoderClient, *, admitted: bool) -> Replica:
        replica = Replica(
            label,
            client,
            self._replica_changed,
            interval_s=self.health_interval_s,
            timeout_s=self.health_timeout_s,
            admitted=admitted,
        )
        self._replicas[label] = replica
        metrics.DECODER_UP.labels(label).set(0)
        metrics.DECODER_IN_FLIGHT.labels(label).set(0)
        metrics.DECODER_REQUESTS.labels(label)
        metrics.DECODER_RETRIES.labels(label)
        return replica

    async def _replica_changed(self, replica: Replica, healthy: bool) -> None:
        if replica.removed:
            return
        metrics.DECODER_UP.labels(replica.label).set(1 if healthy else 0)
        if replica.admitted:
            await self._update_health()

    async def _update_health(self) -> None:
        async with self._health_lock:
            replicas = self.replicas
            up = sum(1 for r in replicas if r.healthy)
            healthy = up > 0
            if healthy == self._healthy:
                return
            before, self._healthy = self._healthy, healthy
            if healthy:
                logger.info("%d of %d decoders healthy: serving", up, len(replicas))
            elif before is None:  # none seen healthy yet: they are starting, as a rule
                logger.info("no decoder serving yet (%d configured): waiting", len(replicas))
            else:
                logger.warning("no healthy decoder (%d configured): not serving", len(replicas))
            if self.on_change is not None:
                await self.on_change(healthy)

    def _close_later(self, replica: Replica) -> None:
        task = asyncio.get_running_loop().create_task(replica.client.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _remove(self, replica: Replica) -> None:
        del self._replicas[replica.label]
        replica.removed = True
        _forget_metrics(replica.label)
        await replica.monitor.stop()
        logger.info(
            "decoder replica %s removed (no longer resolved); %d open streams finish on it",
            replica.label,
            replica.in_flight,
        )
        if replica.in_flight:
            self._draining.add(replica)
        else:
            await replica.client.close()

    async def _lookup(self, target: DecoderTarget) -> tuple[tuple[str, str], ...]:
        """The (label, channel target) of each address of `target`; the last ones on failure."""
        try:
            ips = await asyncio.wait_for(
                self._resolver(target.host, target.port), RESOLVE_TIMEOUT_S
            )
        except (OSError, TimeoutError, ValueError) as exc:  # socket.gaierror is an OSError
            if target not in self._lookup_failing:
                self._lookup_failing.add(target)
                logger.warning(
                    "decoder target %s: cannot resolve %s: %s; keeping its %d addresses",
                    target.spec,
                    target.host,
                    exc,
                    len(self._resolved.get(target, ())),
                )
            return self._resolved.get(target, ())
        self._lookup_failing.discard(target)
        addresses = []
        for ip in ips:
            if _is_ip(ip.partition("%")[0]):
                addresses.append(_resolved_address(ip, target.port))
            else:
                logger.warning("decoder target %s: ignoring %r (not an IP address)", target, ip)
        found = tuple(dict.fromkeys(addresses))
        if found != self._resolved.get(target):
            logger.info(
                "decoder target %s resolves to %s",
                target.spec,
                ", ".join(label for label, _ in found) or "no address",
            )
        self._resolved[target] = found
        return found

    async def _resolve_once(self) -> None:
        """Look up every DNS target; add replicas for new addresses, remove vanished ones."""
        async with self._resolve_lock:
            if self._closed:
                return
            wanted: dict[str, str] = {}
            for target in self.targets:
                if not target.resolved:
                    wanted.setdefault(replica_label(target.dial), target.dial)
                    continue
                for label, dial in await self._lookup(target):
                    wanted.setdefault(label, dial)
            if self._closed:
                return
            added = [
                self._add(label, self._client(dial), admitted=False)
                for label, dial in wanted.items()
                if label not in self._replicas
            ]
            removed = [r for label, r in self._replicas.items() if label not in wanted]
            # A new replica's first check runs before it gets traffic.
            await asyncio.gather(*(r.monitor.start() for r in added))
            for replica in added:
                replica.admitted = True
                logger.info(
                    "decoder replica %s added (%s)",
                    replica.label,
                    "healthy" if replica.healthy else f"not healthy: {replica.monitor.reason}",
                )
            for replica in removed:
                await self._remove(replica)
            if added or removed:
                await self._update_health()

    async def _resolve_loop(self) -> None:
        while True:
            empty = any(t.resolved and not self._resolved.get(t) for t in self.targets)
            interval = self.resolve_interval_s
            await asyncio.sleep(min(interval, EMPTY_RESOLVE_RETRY_S) if empty else interval)
            try:
                await self._resolve_once()
            except Exception:  # noqa: BLE001  a bug in one round must not end the lookups
                logger.exception("decoder address lookup failed")

    async def _poll_one(self, replica: Replica) -> None:
        try:
            info = await replica.client.info(refresh=True, timeout_s=self.health_timeout_s)
        except OmniError as exc:
            logger.debug("GetDecoderInfo of %s failed: %s", replica.label, exc)
            return
        self._note_info(replica, info)

    async def _poll_info_loop(self) -> None:
        while True:
            try:
                await asyncio.gather(*(self._poll_one(r) for r in self.replicas if r.healthy))
            except Exception:  # noqa: BLE001  a bug in one poll must not end the polls
                logger.exception("decoder info poll failed")
            await asyncio.sleep(self.info_interval_s)


__all__ = [
    "BALANCE_LEAST_OUTSTANDING",
    "BALANCE_POLICIES",
    "BALANCE_ROUND_ROBIN",
    "DEFAULT_INFO_INTERVAL_S",
    "DEFAULT_RESOLVE_INTERVAL_S",
    "Assignment",
    "DecoderTarget",
    "Replica",
    "ReplicaPool",
    "Resolver",
    "parse_decoder_target",
    "parse_decoder_targets",
    "replica_label",
    "resolve_host",
]
