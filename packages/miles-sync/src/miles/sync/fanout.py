"""MultiEngineSender: one sender feeding N engines, each through its own transport, with per-engine versions.

``WeightSender`` over one broadcast group gives every engine the same update, so all engines share one version and
one delta base: one restarted engine makes every engine take a full resend. ``MultiEngineSender`` holds one
``Transport`` per engine (e.g. a ``SharedMemoryTransport`` per engine process), tracks each engine's last committed
version, and per push:

1. encodes (codec) and packs each bucket once; with ``delta=True`` it also delta-encodes it once, against the last
   version any engine committed (the *base*);
2. sends the bucket to every engine concurrently (a thread pool): the delta to the engines that hold the base, the
   full bytes (checksummed, so they become the engine's base) to the others: engines that are new, were reset, or
   failed an earlier push. The calls to one engine's transport stay in order and one at a time, so a transport
   needs no locking; transports of different engines run in parallel;
3. commits on every engine concurrently. An engine that rejects a delta for lack of its base (restarted without
   the sender being told: the message says ``NEEDS_FULL_UPDATE``) gets the same update again in full, alone, once.

Failure semantics (per engine, never silent): when an engine's begin, send or commit raises (a rejected bucket, an
``apply_fn`` error, a dead process, a transport timeout), the sender stops sending to that engine, aborts its
partial update and carries on with the others. After a push every engine is either at the new version (it applied
every bucket, checksums verified for deltas) or at its previous one (its receiver dropped the update). If any engine
failed, ``push`` raises ``FanOutError`` (a ``WeightUpdateError``) naming each failed engine and why, after the
others committed; ``versions`` and ``last_push`` say who holds what. A failed engine gets its next update in full.
Versions are never reused: a push consumes its version even when engines fail, so an engine that applied an update
whose acknowledgement was lost (a timeout) still accepts the next one.

Memory and pacing: bucket i+1 is encoded while bucket i is being sent, so at most two buckets (plus, with delta, the
host copy of the bases) are held at a time; engines advance bucket by bucket together, so a slow engine paces the
others. A sender-side error (the codec, ``named_tensors`` raising) aborts the update on every engine and propagates.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from miles.sync.bucket import Bucket, BucketMeta, EncodedTensor, group_into_buckets, pack, packed_nbytes
from miles.sync.codecs import get_codec
from miles.sync.delta import NEEDS_FULL_UPDATE
from miles.sync.errors import WeightUpdateError
from miles.sync.sender import DEFAULT_CODEC_EXCLUDE, encode_tensors
from miles.sync.transports import Transport
from miles.sync.versions import next_version
from torch import Tensor

logger = logging.getLogger(__name__)


@dataclass
class EnginePushStats:
    """What one push did for one engine (``FanOutPushStats.engines[name]``).

    Attributes:
        version: the engine's weight version after the push: the update's if it committed, else its previous one.
        committed: whether the engine applied the update.
        nbytes: payload bytes sent to this engine (the last attempt: the full resend if there was one).
        kinds: buckets per encoding of the last attempt: "full", and with delta "sparse" / "xor_zstd".
        full_resend: it rejected the delta for lack of its base and was sent the update again in full.
        error: why the engine failed (None when it committed).
    """

    version: int = 0
    committed: bool = False
    nbytes: int = 0
    kinds: Counter = field(default_factory=Counter)
    full_resend: bool = False
    error: str | None = None


@dataclass
class FanOutPushStats:
    """What one ``MultiEngineSender.push`` sent (``MultiEngineSender.last_push``, set on failure too).

    Attributes:
        version: the update's weight version.
        num_buckets: buckets in the update.
        full_nbytes: packed bytes of the update (what a full update moves to one engine).
        seconds: wall time of the push, full resends included.
        delta: whether the sender encodes deltas.
        engines: per engine name, its ``EnginePushStats``.
    """

    version: int = 0
    num_buckets: int = 0
    full_nbytes: int = 0
    seconds: float = 0.0
    delta: bool = False
    engines: dict[str, EnginePushStats] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Payload bytes sent to all engines together (last attempts)."""
        return sum(engine.nbytes for engine in self.engines.values())

    @property
    def committed(self) -> list[str]:
        """Names of the engines that applied the update."""
        return [name for name, engine in self.engines.items() if engine.committed]

    @property
    def failed(self) -> dict[str, str]:
        """Engine name -> why it did not apply the update."""
        return {name: engine.error for name, engine in self.engines.items() if engine.error is not None}


class FanOutError(WeightUpdateError):
    """An update failed on some engines (after the others committed it).

    Attributes:
        version: the update's version.
        failed: engine name -> reason; these engines keep their previous version and get the next update in full.
        committed: names of the engines now at ``version``.
    """

    def __init__(self, version: int, failed: dict[str, str], committed: list[str]) -> None:
        self.version = version
        self.failed = dict(failed)
        self.committed = list(committed)
        now_at = ", ".join(committed) if committed else "no engine"
        reasons = "; ".join(f"engine {name!r}: {reason}" for name, reason in failed.items())
        super().__init__(
            f"update v{version} failed on {len(failed)} of {len(failed) + len(committed)} engine(s) "
            f"({', '.join(failed)}); {now_at} applied it. The failed engines keep their previous version and get the "
            f"next update in full: {reasons}"
        )

    def __reduce__(self):  # picklable (e.g. across Ray actors) despite the keyword-rich constructor
        return type(self), (self.version, self.failed, self.committed)


@dataclass(slots=True)
class _Engine:
    name: str
    transport: Transport
    version: int = 0
    needs_full: bool = True  # the sender cannot know which delta base the engine holds


@dataclass(frozen=True, slots=True)
class _Outgoing:
    """One bucket of a pass, in the forms the engines take it."""

    index: int
    size: int  # packed bytes
    device: torch.device  # where the bucket's tensors live (passed to ``Transport.allocate``)
    entries: list[EncodedTensor] | None  # without delta: every engine packs these into its own buffer
    full: tuple[BucketMeta, Tensor] | None  # with delta: the packed bytes as a "full" delta bucket (CPU)
    delta: tuple[BucketMeta, Tensor] | None  # with delta: the bucket encoded against the base (CPU)


def _reason(err: BaseException) -> str:
    return str(err) if isinstance(err, WeightUpdateError) else f"{type(err).__name__}: {err}"


class MultiEngineSender:
    """Pushes a model's named tensors to N engines, each through its own transport, with per-engine versions.

    Args:
        engines: engine name -> its transport (one session per engine; e.g. a ``SharedMemoryTransport`` per engine
            process). Names appear in errors and stats. May be empty; ``add_engine`` adds more.
        bucket_bytes: target payload bytes per bucket (see ``WeightSender``); up to two buckets are held at a time.
        codec: codec name for floating-point tensors (``miles.sync.codecs.CODECS``); "identity" is exact.
        codec_exclude: regular expressions; matching tensor names are sent exactly (ignored for "identity").
        delta: send each bucket as its change from the last version an engine committed to the engines holding it,
            and the full bytes to the others (``miles.sync.delta``); encoded once per bucket whatever the number of
            engines. Holds a host copy of the packed weights. A full resend to an engine that lacked its base needs
            a re-iterable ``named_tensors`` (a list).
        max_workers: threads sending to engines at once; default one per engine.

    Attributes:
        version: the last version pushed (consumed even if the push failed on some or all engines).
        last_push: ``FanOutPushStats`` of the last push (also set when it raised ``FanOutError``).

    Not thread-safe: one ``push`` (or engine change) at a time.

    Raises:
        ValueError: on a non-positive ``bucket_bytes`` or ``max_workers``, or an unknown codec.
        ImportError: with ``delta`` and no zstandard / xxhash installed (names the install command).
    """

    def __init__(
        self,
        engines: Mapping[str, Transport],
        *,
        bucket_bytes: int = 512 * 2**20,
        codec: str = "identity",
        codec_exclude: Iterable[str] = DEFAULT_CODEC_EXCLUDE,
        delta: bool = False,
        max_workers: int | None = None,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes is {bucket_bytes}; it must be > 0 (512 * 2**20 is a good default)")
        if max_workers is not None and max_workers <= 0:
            raise ValueError(f"max_workers is {max_workers}; it must be > 0 (None: one thread per engine)")
        self.bucket_bytes = bucket_bytes
        self.codec = get_codec(codec)
        self.codec_exclude = tuple(re.compile(pattern) for pattern in codec_exclude)
        self.max_workers = max_workers
        self.version = 0
        self.last_push = FanOutPushStats()
        self._engines: dict[str, _Engine] = {}
        self._encoder = None
        self._base_version = 0  # the version the encoder's bases hold; 0: none
        if delta:
            from miles.sync.delta import DeltaEncoder

            self._encoder = DeltaEncoder()
        for name, transport in engines.items():
            self.add_engine(name, transport)

    # Engines

    def add_engine(self, name: str, transport: Transport) -> None:
        """Add an engine (empty weights, or of unknown version); its first update goes in full.

        Raises: ValueError if an engine of that name exists.
        """
        if name in self._engines:
            raise ValueError(f"engine {name!r} already exists; reset_engine({name!r}) replaces a restarted one")
        self._engines[name] = _Engine(name, transport)

    def remove_engine(self, name: str) -> Transport:
        """Stop sending to an engine; returns its transport (not closed). Raises: KeyError for an unknown name."""
        self._engine(name)
        return self._engines.pop(name).transport

    def reset_engine(self, name: str, transport: Transport | None = None) -> None:
        """The engine restarted or lost its weights: its next update goes in full; the others keep their deltas.

        Args:
            name: the engine.
            transport: its new transport (a restarted process has a new connection); None keeps the current one.
        Raises: KeyError for an unknown name.
        """
        engine = self._engine(name)
        if transport is not None:
            engine.transport = transport
        engine.version, engine.needs_full = 0, True

    def transport(self, name: str) -> Transport:
        """The engine's transport. Raises: KeyError for an unknown name."""
        return self._engine(name).transport

    @property
    def engines(self) -> list[str]:
        """Engine names, in the order they were added."""
        return list(self._engines)

    @property
    def versions(self) -> dict[str, int]:
        """Engine name -> the last version it committed (0: none, or reset)."""
        return {name: engine.version for name, engine in self._engines.items()}

    def close(self) -> None:
        """Call ``close()`` on every transport that has one (stops the endpoints' serve loops); a failure (e.g. a
        dead engine's closed connection) is logged, not raised."""
        for engine in self._engines.values():
            close = getattr(engine.transport, "close", None)
            if close is None:
                continue
            try:
                close()
            except Exception as err:
                logger.warning("closing the transport of engine %r failed: %s", engine.name, _reason(err))

    def _engine(self, name: str) -> _Engine:
        try:
            return self._engines[name]
        except KeyError:
            raise KeyError(f"no engine {name!r}; the engines are {list(self._engines)}") from None

    # Push

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int | None = None) -> int:
        """Send one complete update to every engine; returns its version once every engine applied it.

        Args:
            named_tensors: ``(name, tensor)`` pairs, e.g. ``model.state_dict().items()``; any dtype, shape and device.
                Read during the call only. A list when a full resend may be needed (``delta=True``).
            version: the update's version; it must exceed ``self.version``. Default ``self.version + 1``.

        Returns:
            The update's version (every engine is at it).

        Raises:
            FanOutError: (a ``WeightUpdateError``) if some engines failed; the message and ``failed`` name each and
                why. The other engines committed the update, ``self.version`` is the update's, ``versions`` says
                where each engine is; the next push brings the failed ones up with a full update.
            ValueError: if there are no engines or ``version`` is not greater than ``self.version``.
            Exception: a sender-side error (the codec, ``named_tensors`` raising) is re-raised after every engine
                aborted the update (they keep their versions and delta bases).
        """
        if not self._engines:
            raise ValueError("MultiEngineSender has no engines; add_engine(name, transport) first")
        version = next_version(version, self.version, holder="this sender")
        start = time.perf_counter()
        engines = list(self._engines.values())
        stats = FanOutPushStats(
            version=version,
            delta=self._encoder is not None,
            engines={engine.name: EnginePushStats(version=engine.version) for engine in engines},
        )
        delta_names: set[str] = set()
        if self._encoder is not None:
            delta_names = {e.name for e in engines if not e.needs_full and 0 < self._base_version == e.version}
            if not delta_names:  # nobody holds the base: skip computing deltas no engine can use
                self._encoder.reset()
                self._base_version = 0
        self.version = version  # consumed even on failure (see the module docstring)
        failures: dict[str, str] = {}
        checksums: list[int] = []  # per bucket, xxh3 of the packed bytes of the first pass
        workers = min(len(engines), self.max_workers or len(engines))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="miles-fanout") as pool:
            try:
                committed = self._pass(
                    pool, named_tensors, version, engines, delta_names, stats, failures, checksums, first=True
                )
            except BaseException:
                if self._encoder is not None:
                    self._encoder.discard()
                raise
            resend = [e for e in engines if e.name in delta_names and NEEDS_FULL_UPDATE in failures.get(e.name, "")]
            if resend and iter(named_tensors) is named_tensors:
                for engine in resend:
                    failures[engine.name] += (
                        "; a full resend needs a re-iterable named_tensors (a list), not an iterator"
                    )
            elif resend:
                logger.info("update v%d: %s lack the delta base, sending it in full", version, [e.name for e in resend])
                for engine in resend:
                    del failures[engine.name]
                    stats.engines[engine.name].full_resend = True
                try:
                    committed += self._pass(
                        pool, named_tensors, version, resend, set(), stats, failures, checksums, first=False
                    )
                except Exception as err:  # sender-side on the second pass: only these engines miss the update
                    for engine in resend:
                        failures.setdefault(engine.name, f"the full resend failed: {_reason(err)}")
        self._finish(version, engines, committed, failures, stats)
        stats.seconds = time.perf_counter() - start
        self.last_push = stats
        if failures:
            raise FanOutError(version, failures, [engine.name for engine in committed])
        logger.debug(  # per step: the run log file has it, the console does not
            "pushed weights v%d to %d engines in %.3fs (%s, %d buckets, %.1f MiB sent, %.1f MiB per full update)",
            version,
            len(engines),
            stats.seconds,
            self.codec.name,
            stats.num_buckets,
            stats.nbytes / 2**20,
            stats.full_nbytes / 2**20,
        )
        return version

    def _finish(
        self,
        version: int,
        engines: list[_Engine],
        committed: list[_Engine],
        failures: dict[str, str],
        stats: FanOutPushStats,
    ) -> None:
        committed_names = {engine.name for engine in committed}
        for engine in engines:
            engine_stats = stats.engines[engine.name]
            if engine.name in committed_names:
                engine.version, engine.needs_full = version, False
                engine_stats.committed = True
            else:
                engine.needs_full = True  # its receiver may hold any base (an unacknowledged commit, a restart)
                engine_stats.error = failures.get(engine.name, "the update did not reach it")
                logger.warning("engine %r did not apply update v%d: %s", engine.name, version, engine_stats.error)
            engine_stats.version = engine.version
        if self._encoder is not None:
            if committed:
                self._encoder.commit()
                self._base_version = version
            else:
                self._encoder.discard()

    def _pass(
        self,
        pool: ThreadPoolExecutor,
        named_tensors: Iterable[tuple[str, Tensor]],
        version: int,
        engines: list[_Engine],
        delta_names: set[str],
        stats: FanOutPushStats,
        failures: dict[str, str],
        checksums: list[int],
        *,
        first: bool,
    ) -> list[_Engine]:
        """Send one complete update to ``engines``; returns those that committed (the others are in ``failures``).

        The ``first`` pass delta-encodes and records each bucket's checksum; a full resend checks that it packs the
        same bytes.
        """
        live = list(engines)
        for engine in live:
            stats.engines[engine.name].nbytes, stats.engines[engine.name].kinds = 0, Counter()
        self._run(pool, live, lambda engine: engine.transport.begin(version), version, failures, abort=True)
        inflight: list[tuple[_Engine, Future]] = []
        index = 0
        try:
            buckets = group_into_buckets(
                encode_tensors(named_tensors, self.codec, self.codec_exclude), bucket_bytes=self.bucket_bytes
            )
            for entries in buckets:
                out = self._prepare(entries, version, index, checksums, first=first)
                self._collect(inflight, live, version, failures, abort=True)  # bucket index - 1 was sent
                if not live and not (first and self._encoder is not None):
                    break  # every engine failed; with delta the first pass goes on encoding: the bases and the
                    # checksums a full resend is checked against must cover every bucket
                inflight = [
                    (e, pool.submit(self._send, e, out, e.name in delta_names, version, stats.engines[e.name]))
                    for e in live
                ]
                index += 1
                if first:
                    stats.num_buckets, stats.full_nbytes = index, stats.full_nbytes + out.size
            self._collect(inflight, live, version, failures, abort=True)
            if live and not first and index != len(checksums):
                raise WeightUpdateError(
                    f"update v{version}: the full resend packed {index} buckets, the first pass {len(checksums)}; "
                    "named_tensors changed during the push"
                )
        except BaseException as err:
            self._collect(inflight, live, version, failures, abort=True)
            for engine in live:
                self._abort(engine, version, f"sender failed after {index} buckets: {err!r}")
            raise
        return self._run(
            pool, live, lambda engine: engine.transport.commit(version, index), version, failures, abort=False
        )

    def _prepare(
        self, entries: list[EncodedTensor], version: int, index: int, checksums: list[int], *, first: bool
    ) -> _Outgoing:
        """Pack (and delta-encode) one bucket once for every engine. The first pass appends its checksum to
        ``checksums``; a full resend checks its bytes against them."""
        size, device = packed_nbytes(entries), entries[0].parts[0].device
        if self._encoder is None:
            return _Outgoing(index, size, device, entries, None, None)
        from miles.sync.delta import as_full

        # zeros: alignment padding must not vary, or a full resend would pack other bytes than the first pass
        packed = pack(entries, torch.zeros(size, dtype=torch.uint8), version=version, index=index)
        if first:
            meta, payload = self._encoder.encode(packed)
            checksums.append(meta.delta.checksum)
            if meta.delta.kind == "full":
                return _Outgoing(index, size, device, None, (meta, payload), (meta, payload))
            full = as_full(packed, payload_checksum=meta.delta.checksum)
            return _Outgoing(index, size, device, None, full, (meta, payload))
        full = as_full(packed)
        if index >= len(checksums) or full[0].delta.checksum != checksums[index]:
            raise WeightUpdateError(
                f"bucket {index} of update v{version} packs other bytes in the full resend than in the first pass; "
                "named_tensors changed during the push"
            )
        return _Outgoing(index, size, device, None, full, full)

    @staticmethod
    def _send(engine: _Engine, out: _Outgoing, use_delta: bool, version: int, stats: EnginePushStats) -> None:
        """Runs on a pool thread; only this engine's transport and stats are touched."""
        transport = engine.transport
        if out.entries is not None:  # each engine packs into its own buffer: one copy per engine, in parallel
            bucket = pack(out.entries, transport.allocate(out.size, out.device), version=version, index=out.index)
        else:
            meta, payload = out.delta if use_delta else out.full
            bucket = Bucket(meta, transport.allocate(payload.numel(), out.device).copy_(payload))
        transport.send(bucket)
        stats.nbytes += bucket.meta.nbytes
        stats.kinds[bucket.meta.delta.kind if bucket.meta.delta is not None else "full"] += 1

    def _run(
        self,
        pool: ThreadPoolExecutor,
        live: list[_Engine],
        call: Callable[[_Engine], None],
        version: int,
        failures: dict[str, str],
        *,
        abort: bool,
    ) -> list[_Engine]:
        """``call(engine)`` on every live engine concurrently; drops the failed ones from ``live``; returns it."""
        self._collect([(engine, pool.submit(call, engine)) for engine in live], live, version, failures, abort=abort)
        return list(live)

    def _collect(
        self,
        futures: list[tuple[_Engine, Future]],
        live: list[_Engine],
        version: int,
        failures: dict[str, str],
        *,
        abort: bool,
    ) -> None:
        """Wait for every future; an engine whose call raised is recorded, removed from ``live`` and (``abort``)
        told to drop the update (its calls are done, so the abort cannot race one)."""
        for engine, future in futures:
            err = future.exception()
            if err is None or engine not in live:
                continue
            failures[engine.name] = _reason(err)
            live.remove(engine)
            if abort:
                self._abort(engine, version, f"engine {engine.name!r} failed: {failures[engine.name]}")

    @staticmethod
    def _abort(engine: _Engine, version: int, reason: str) -> None:
        try:
            engine.transport.abort(version, reason)
        except Exception as err:  # the protocol says abort never raises; a dead connection may anyway
            logger.warning("could not abort update v%d on engine %r: %s", version, engine.name, _reason(err))
