"""A lost rank: every survivor stops in bounded time with one line and exit status 3.

Each rank runs a :class:`PeerWatch` (docs/faults.md).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from .distributed import DEFAULT_TIMEOUT_MINUTES, DistInfo, restart_count, restarts_left
from .errors import RWKVCLIPError

EXIT_LOST_RANK = 3
DEFAULT_DIST_TIMEOUT = DEFAULT_TIMEOUT_MINUTES * 60  # seconds (--dist-timeout)
BEAT_INTERVAL = 0.5           # seconds between heartbeats
SILENCE_LIMIT = 30.0          # seconds of a silent heartbeat before a blocked rank gives up
IDENTIFY_WINDOW = 4.0         # seconds over which a failing rank compares the heartbeats
STORE_TIMEOUT = 10.0          # seconds a heartbeat request may take

_WRITING = threading.Lock()


@contextmanager
def writing():
    """Hold while a checkpoint or result file is written: a stop for a lost peer waits for
    it (the write is atomic anyway; waiting keeps the newest state)."""
    with _WRITING:
        yield


def silence_limit(timeout: float) -> float:
    """Seconds of a peer's silent heartbeat after which a blocked rank stops."""
    return max(3.0, min(SILENCE_LIMIT, timeout / 2))


def format_ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


class PeerWatch:
    """The heartbeat of one rank and the one exit for a lost peer.

    The heartbeat lives in the job's rendezvous store and is watched by the next rank (a
    ring). When a collective fails or the watched peer falls silent, the survivor waits
    for any checkpoint being written, prints ``lost rank R``, where it was and what is
    safe on disk, and leaves with ``os._exit(3)`` (``destroy_process_group`` can hang once
    a peer is gone).

    ``where()`` says how far this rank got (``at step 10``), ``outcome()`` what is safe on
    disk and how to go on; both are read only when a peer is lost. ``log``: a logger whose
    file handlers also get the line.
    """

    def __init__(self, info: DistInfo, timeout: float, prog: str) -> None:
        self.info, self.prog, self.timeout = info, prog, float(timeout)
        self.where: Callable[[], str] = lambda: "before the first step"
        self.outcome: Callable[[], str] = lambda: ""
        self.log: logging.Logger | None = None
        self._once = threading.Lock()
        self._closed = threading.Event()
        self._store: Any = None  # a PrefixStore over this job's TCPStore
        self._store_lost = False  # after one failed request the store is left alone
        self._store_host = ""
        self._thread: threading.Thread | None = None
        if info.distributed:
            self._store = self._connect()
        if self._store is not None:
            self._thread = threading.Thread(target=self._run, name="rwkv-clip-peer-watch",
                                            daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ store
    def _connect(self):
        import torch.distributed as dist

        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            return None  # a group made without env:// rendezvous: no heartbeat
        self._store_host = f"{host}:{port}"
        try:
            client = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=STORE_TIMEOUT))
        except Exception:  # the group is up, so this is unexpected: run without heartbeat
            return None
        attempt = restart_count()
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        return dist.PrefixStore(f"rwkv_clip/peers/{run_id}/{attempt}/", client)

    def _beats(self, ranks) -> dict[int, int]:
        return {r: int(self._store.add(f"beat/{r}", 0)) for r in ranks}

    def _left(self, rank: int) -> str | None:
        key = f"left/{rank}"
        if self._store.check([key]):
            return self._store.get(key).decode()
        return None

    # ------------------------------------------------------------------ heartbeat thread
    def _run(self) -> None:
        rank, world = self.info.rank, self.info.world_size
        peer = (rank + 1) % world
        limit = silence_limit(self.timeout)
        seen, since = None, time.monotonic()
        while not self._closed.wait(BEAT_INTERVAL):
            try:
                self._store.add(f"beat/{rank}", 1)
                if self._store.check(["lost"]):
                    self.stop_for_lost_peer(None)
                count = int(self._store.add(f"beat/{peer}", 0))
                now = time.monotonic()
                if count != seen:
                    seen, since = count, now
                    continue
                if now - since < limit:
                    continue
                left = self._left(peer)
                if left == "done":
                    peer = (peer + 1) % world  # finished cleanly: watch the next one
                    seen, since = None, now
                    if peer == rank:
                        return
                    continue
                self.stop_for_lost_peer(None, silent=peer)
            except Exception as exc:  # the store is gone with the rank that hosts it
                if self._closed.is_set():
                    return
                self._store_lost = True
                self.stop_for_lost_peer(exc)

    # ------------------------------------------------------------------ the exit
    def identify(self, silent: int | None = None) -> str:
        """Who is gone, as the line's subject: ``lost rank 1``, ``lost ranks 2, 3``,
        ``rank 1 stopped with an error``, or ``lost a peer rank`` when nothing tells."""
        if self._store is None:
            return "lost a peer rank"
        try:
            if self._store_lost:
                raise ConnectionError(self._store_host)
            if self._store.check(["lost"]):
                return self._store.get("lost").decode()
            me = self.info.rank
            others = [r for r in range(self.info.world_size) if r != me]
            left = {r: self._left(r) for r in others}
            failed = {r: why for r, why in left.items() if why not in (None, "done", "peer")}
            if failed:
                why = "with an error (its own message says why)"
                if set(failed.values()) == {"interrupted"}:
                    why = "(interrupted)"
                who = f"{format_ranks(list(failed))} stopped {why}"
            elif silent is not None:
                who = f"lost {format_ranks([silent])}"
            else:
                candidates = [r for r in others if left[r] is None]
                first = self._beats(candidates)
                time.sleep(IDENTIFY_WINDOW)
                last = self._beats(candidates)
                # a peer that stops for the same loss meanwhile says so before it goes
                silent_ranks = [r for r in candidates if last[r] == first[r]
                                and self._left(r) is None]
                if not silent_ranks:
                    return "lost a peer rank"
                who = f"lost {format_ranks(silent_ranks)}"
            self._store.set("lost", who)
            return who
        except Exception:  # the store went with its host
            self._store_lost = True
            if self.info.launcher == "slurm":
                return "lost rank 0 (it hosts the rendezvous store)"
            return f"lost the rendezvous store at {self._store_host} (its node is gone)"

    def stop_for_lost_peer(self, exc: BaseException | None, silent: int | None = None) -> None:
        """Name the lost peer, print the one line and exit with status 3; never returns.
        A second caller (the other thread) waits here until the first one exits."""
        self._once.acquire()
        who = self.identify(silent)
        if who == "lost a peer rank" and exc is not None:
            who += f" ({one_line_cause(exc)})"
        got_lock = _WRITING.acquire(timeout=max(60.0, self.timeout))
        try:
            parts = [f"{who} {self.where()}", self.outcome()]
            line = f"{self.prog}: error: " + "; ".join(p for p in parts if p)
            print(line, file=sys.stderr, flush=True)
            self._write_log(line)
            self.mark("peer")
        finally:
            if got_lock:
                _WRITING.release()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_LOST_RANK)

    def check(self, exc: BaseException) -> None:
        """In an ``except``: exit as :meth:`stop_for_lost_peer` when ``exc`` comes from a
        lost peer; otherwise record that this rank stops with its own error and return."""
        if self._store is None and not self.info.distributed:
            return
        if not isinstance(exc, RWKVCLIPError) and is_collective_failure(exc):
            self.stop_for_lost_peer(exc)
        self.mark("error")

    def _write_log(self, line: str) -> None:
        if self.log is None:
            return
        for handler in self.log.handlers:
            if isinstance(handler, logging.FileHandler) and handler.stream is not None:
                try:
                    handler.stream.write(line + "\n")
                    handler.flush()
                except Exception:
                    pass

    # ------------------------------------------------------------------ leaving
    def mark(self, why: str) -> None:
        """Tell the peers why this rank goes: ``done``, ``error``, ``interrupted`` or
        ``peer`` (it stops for a lost peer)."""
        if self._store is None or self._store_lost:
            return
        try:
            if not self._store.check([f"left/{self.info.rank}"]):
                self._store.set(f"left/{self.info.rank}", why)
        except Exception:
            pass

    def close(self, why: str = "done") -> None:
        """Stop the heartbeat before the group's final barrier (after it the rank hosting
        the store may leave, which must not read as a loss)."""
        if self._closed.is_set():
            return
        self.mark(why)
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * BEAT_INTERVAL + STORE_TIMEOUT)

    def __enter__(self) -> PeerWatch:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if isinstance(exc, Exception):
            self.check(exc)
        self.close("done" if exc is None else "error" if isinstance(exc, Exception)
                   else "interrupted")


def is_collective_failure(exc: BaseException) -> bool:
    """An error of the process group rather than of this rank's own work."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in (
        "gloo", "NCCL", "Connection reset", "Connection closed", "Broken pipe",
        "Timed out", "timed out", "ProcessGroup", "Socket"))


def one_line_cause(exc: BaseException) -> str:
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()),
                 type(exc).__name__)
    return first if len(first) <= 160 else first[:157] + "..."


def watch_peers(info: DistInfo, timeout: float, prog: str) -> PeerWatch:
    """A started :class:`PeerWatch` (inert in a single process)."""
    return PeerWatch(info, timeout, prog)


__all__ = ["EXIT_LOST_RANK", "DEFAULT_DIST_TIMEOUT", "PeerWatch", "watch_peers", "writing",
           "restart_count", "restarts_left", "silence_limit", "is_collective_failure"]
