"""Point-to-point messages between pipeline ranks, each named by a key and buffered until its reader asks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from seqify.distributed.sizes import KINDS, decode, encode, is_size
from seqify.errors import BoundaryError, PeerError, SeqifyError

__all__ = ["Link", "Books", "Key", "ACTIVATION", "SKIP", "GRAD", "SKIP_GRAD", "directions", "peer", "leaves",
           "grads_for", "like_grads"]

Key = tuple[int, int, int]  # (what, partition or route, micro-batch)
ACTIVATION, SKIP, GRAD, SKIP_GRAD = 0, 1, 2, 3  # what a message carries

_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool,
]
_MAX_TENSORS = 16
_MAX_DIMS = 8
_SLOT = 2 + _MAX_DIMS
_KEY = 3
_BOOK = _KEY + 2 + _MAX_TENSORS * _SLOT  # the word saying "the rest of this step follows the book" (0: no)
_HEADER = _BOOK + 1

# what one message is, for a book: its key, kind and, per tensor, (dtype index, shape); or its size's words
Entry = tuple[Key, int, tuple[Any, ...]]


@contextmanager
def peer(me: str, who: int | list[int], what: str) -> Iterator[None]:
    """Turns a failed send, receive or all-reduce (a peer died, or stayed silent past the process-group
    timeout) into a :class:`PeerError` naming both ranks and what to do."""
    try:
        yield
    except RuntimeError as e:  # gloo and NCCL raise DistBackendError or a plain RuntimeError
        if isinstance(e, SeqifyError):
            raise
        name = f"rank {who}" if isinstance(who, int) else f"one of ranks {who}"
        cause = (str(e).splitlines() or [type(e).__name__])[0]
        cause = cause.split("] ", 1)[-1].split(". This is typically")[0]  # gloo's source location and advice
        raise PeerError(
            f"{me} lost {name} while {what} ({cause}). The peer process died or did not answer within the "
            "process-group timeout (seqify.distributed.init(timeout_s=...)). Look in its log (or its node's) for "
            "the first error; the rest of the job stops too. Restart the job and resume from the last "
            "seqify.checkpoint.save with seqify.checkpoint.load(stage, folder, optimizer, scheduler)."
        ) from e


def leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of a value that crosses a boundary (a tensor, a tuple of tensors, None, or a size:
    none)."""
    if value is None or is_size(value):
        return []
    return [value] if isinstance(value, torch.Tensor) else list(value)


def like_grads(tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    """The gradients of ``tensors``' floating-point members (zeros where ``None``), as one message."""
    return tuple((g if g is not None else torch.zeros_like(t)).contiguous()
                 for t, g in zip(tensors, grads) if t.is_floating_point())


def grads_for(tensors: Sequence[torch.Tensor], message: Any) -> list[torch.Tensor | None]:
    """Spread a :func:`like_grads` message back over ``tensors`` (None for those without gradients)."""
    got = iter(leaves(message))
    return [next(got) if t.is_floating_point() else None for t in tensors]


def _describe(key: Key) -> str:
    what = ("activations of partition {}", "skip {}", "gradients for partition {}", "gradients of skip {}")[key[0]]
    return f"{what.format(key[1])}, micro-batch {key[2]}"


class Books:
    """What one rank sent to and received from each peer in its last training step, message by message (key,
    kind, dtypes and shapes), kept across steps by a :class:`~seqify.distributed.DistributedStage`.

    A step whose fixed programs were all built before it (same micro-batch sizes; ``Link.steady``) sends what
    its last step sent, in the same order and shapes. Its first message to a peer says so in its header,
    with the fingerprint of that sequence; the receiver, holding the same sequence as received, knows the
    rest of the step's messages from that peer before they come: for each it queues the receive of its header
    and of its tensors back to back, and its host goes on without waiting for the header. (Without the book
    the host waits for each header to learn the shapes, a round trip through the host on the pipeline's
    critical path; receiving the tensors before the header arrives would keep NCCL's larger receive kernel
    spinning on the GPU's multiprocessors while the partition computes.)"""

    def __init__(self) -> None:
        self.sent: dict[int, list[Entry]] = {}  # last finished step: peer -> what went to it, in order
        self.got: dict[int, list[Entry]] = {}  # last finished step: peer -> what came from it, in order
        self.sending: dict[int, list[Entry]] = {}  # this step, so far
        self.getting: dict[int, list[Entry]] = {}

    def rotate(self) -> None:
        """The step finished: its messages are the book for the next."""
        self.sent, self.got, self.sending, self.getting = self.sending, self.getting, {}, {}

    def clear(self) -> None:
        """A step failed part-way: no book (the next step's messages all carry headers)."""
        self.sent, self.got, self.sending, self.getting = {}, {}, {}, {}


def fingerprint(entries: Sequence[Entry]) -> int:
    """A nonzero int64 naming a sequence of messages, equal on every process (ints only: no salted hashes)."""
    words = tuple((k, kind, spec) for k, kind, spec in entries)
    return (hash(words) & ((1 << 62) - 1)) | 1


class Link:
    """Sends values (a tensor, a tuple of tensors, None, or a size: a Python int, float or bool or a
    ``torch.Size``, as a size skip holds) to other ranks under a key, with a header giving the key,
    dtypes and shapes, so receivers need no shapes in advance; a size travels in the header alone.

    Between two ranks messages arrive in the order they were sent; :meth:`recv` of a key reads the
    sender's messages in that order, keeping those that are not yet wanted for a later :meth:`recv`.
    Every message a rank waits for was sent by an action that comes earlier in the shared schedule, so
    as long as sends never block (they are ``isend``) no two ranks wait on each other. With ``books``
    (:class:`Books`), a ``steady`` step's receivers need not wait for headers after its first message."""

    def __init__(self, device: torch.device, me: str = "this rank", directions: tuple[Any, Any] | None = None,
                 books: Books | None = None) -> None:
        self.device = device
        self.me = me
        # (to higher ranks, to lower ranks): process groups that each carry one direction only (see directions())
        self.directions = directions
        self.rank = dist.get_rank() if directions is not None else -1
        self.pending: list[tuple[Any, torch.Tensor, int]] = []
        self.inbox: dict[tuple[int, Key], Any] = {}
        self.books = books
        self.steady = False  # set by the step: this step sends what the last one did (see Books)
        self.booked: set[int] = set()  # peers whose receives of this step's later messages follow the book
        self.reading: dict[int, int] = {}  # peer -> the next entry of its book, read without waiting for headers
        self.unchecked: list[tuple[int, Entry, torch.Tensor]] = []  # headers received without waiting

    def send(self, key: Key, value: Any, dst: int) -> None:
        words: list[int] = []
        if value is None:
            tensors: tuple[torch.Tensor, ...] = ()
            kind = 2
        elif is_size(value):
            tensors = ()
            kind, words = encode(value)
        elif isinstance(value, torch.Tensor):
            tensors, kind = (value,), 0
        elif type(value) is tuple and all(isinstance(t, torch.Tensor) for t in value):
            tensors, kind = value, 1
        else:
            raise BoundaryError(
                f"a {type(value).__name__} must cross to rank {dst} ({_describe(key)}); only tensors, tuples of "
                "tensors, None and sizes (ints, floats, torch.Size) travel between processes (move the cut so other "
                "Python values stay inside one stage)"
            )
        if len(words) > _HEADER - _KEY - 2:
            raise BoundaryError(f"a torch.Size of {len(words)} dims must cross to rank {dst} ({_describe(key)}); at "
                                f"most {_HEADER - _KEY - 2} travel: move the cut")
        if len(tensors) > _MAX_TENSORS or any(t.dim() > _MAX_DIMS for t in tensors):
            raise BoundaryError(f"at most {_MAX_TENSORS} tensors of at most {_MAX_DIMS} dims cross ranks at once "
                                f"({_describe(key)} has {len(tensors)}): move the cut")
        book = 0
        if self.books is not None:  # (only then: a step without books pays nothing for them)
            entry: Entry = (tuple(key), kind, tuple(words) if kind in KINDS else  # type: ignore[assignment]
                            tuple((_DTYPES.index(t.dtype), tuple(t.shape)) for t in tensors))
            done = self.books.sending.setdefault(dst, [])
            last = self.books.sent.get(dst, [])
            if dst in self.booked:  # this step's first message to dst said: the rest follows the book
                if len(done) >= len(last) or last[len(done)] != entry:
                    expected = _describe(last[len(done)][0]) if len(done) < len(last) else "nothing more"
                    raise BoundaryError(
                        f"{self.me} sends {_describe(key)} to rank {dst} where its last step sent {expected}: a step "
                        "with unchanged micro-batch sizes must send what the last one did (its receiver posts their "
                        "receives before their headers arrive). Keep every input's shape fixed between steps, or use "
                        "graphs=False")
            elif not done and self.steady and last and last[0] == entry:
                book = fingerprint(last)
                self.booked.add(dst)
            done.append(entry)
        # pinned on GPUs: copying a pageable header to the device would first wait for every kernel this rank
        # has queued (a stream sync per message), where a pinned one is copied in stream order
        header = torch.zeros(_HEADER, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        header[:_KEY] = torch.tensor(key, dtype=torch.int64)
        header[_KEY], header[_KEY + 1] = kind, len(words) if kind in KINDS else len(tensors)
        header[_BOOK] = book
        if words:
            header[_KEY + 2:_KEY + 2 + len(words)] = torch.tensor(words, dtype=torch.int64)
        for k, t in enumerate(tensors):
            base = _KEY + 2 + k * _SLOT
            header[base] = _DTYPES.index(t.dtype)
            header[base + 1] = t.dim()
            header[base + 2:base + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        sent = [header.to(self.device, non_blocking=True)] + [t.detach().contiguous() for t in tensors]
        with peer(self.me, dst, f"sending {_describe(key)}"):
            for t in sent:
                self.pending.append((dist.isend(t, dst, group=self._group(dst > self.rank)), t, dst))

    def _group(self, upward: bool) -> Any:
        if self.directions is None:
            return None
        return self.directions[0] if upward else self.directions[1]

    def _recv(self, t: torch.Tensor, src: int, what: str) -> None:
        with peer(self.me, src, what):
            work = dist.irecv(t, src, group=self._group(src < self.rank))
            assert work is not None  # None only where this rank is outside the group, and both groups hold all ranks
            work.wait()

    def _next(self, src: int, wanted: Key) -> tuple[Key, Any]:
        """The next message from ``src``, whichever it is.

        On a GPU the message is received on a stream of its own (:func:`_incoming`): the host waits for the
        header to arrive, not for the kernels this rank has queued before it (``header.cpu()`` on the compute
        stream would wait for all of them, and the GPU would idle while the host then queued the next work),
        and the payload lands while those kernels run; the compute stream waits for it before its next kernel."""
        what = f"receiving {_describe(wanted)}"
        side = _incoming(self.device) if self.device.type == "cuda" else None
        if src in self.reading:
            return self._booked(src, what, side)
        if side is None:
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            self._recv(header, src, what)
            return self._unpack(header, src, what, None)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(side):
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            self._recv(header, src, what)  # queued on NCCL's stream after `side` (idle), and `side` waits for it
            host = torch.empty(_HEADER, dtype=torch.int64, pin_memory=True)
            host.copy_(header, non_blocking=True)
            with peer(self.me, src, what):
                side.synchronize()
            return self._unpack(host, src, what, (side, compute))

    def _unpack(self, header: torch.Tensor, src: int, what: str, streams: Any) -> tuple[Key, Any]:
        """The message a (host) header announces, its tensors received after it; with ``streams`` (the
        receiving stream, current now, and the compute stream) handed to the compute stream once they land."""
        key = (int(header[0]), int(header[1]), int(header[2]))
        kind, n = int(header[_KEY]), int(header[_KEY + 1])
        if kind in KINDS:
            words = [int(v) for v in header[_KEY + 2:_KEY + 2 + n]]
            self._note(src, (key, kind, tuple(words)), int(header[_BOOK]))
            return key, decode(kind, words)
        specs = []
        for k in range(n):
            base = _KEY + 2 + k * _SLOT
            specs.append((int(header[base]), tuple(int(d) for d in header[base + 2:base + 2 + int(header[base + 1])])))
        self._note(src, (key, kind, tuple(specs)), int(header[_BOOK]))
        return key, self._land(src, what, kind, specs, streams)

    def _note(self, src: int, entry: Entry, book: int) -> None:
        """Write a message received with a header into this step's book; a nonzero ``book`` (the sender's
        fingerprint of its last step's messages) says the rest of the step follows that book, unannounced."""
        if self.books is not None:
            self.books.getting.setdefault(src, []).append(entry)
        if not book:
            return
        last = self.books.got.get(src, []) if self.books is not None else []
        if not last or fingerprint(last) != book or last[0] != entry:
            raise PeerError(
                f"{self.me}: rank {src} sends this step's messages as its last step did, and says so, but this "
                "rank did not receive that step as it was sent (it failed part-way, or the ranks' stages differ). "
                "Restart the job from the last seqify.checkpoint.save; build every rank's stage alike")
        self.reading[src] = 1

    def _booked(self, src: int, what: str, side: Any) -> tuple[Key, Any]:
        """The next message from ``src`` as the book says it comes: its header's receive and its tensors'
        are queued back to back, so the tensors' receive (NCCL's larger kernel) starts once the header
        arrives, as when the host waited for it, but the host does not wait (the header is checked at
        :meth:`flush`). On the CPU the header is read and checked at once."""
        assert self.books is not None
        last, at = self.books.got[src], self.reading[src]
        if at >= len(last):
            raise PeerError(f"{self.me} waits for {what[len('receiving '):]} from rank {src}, which its last step "
                            "did not send: the ranks run different schedules; build every rank's stage alike")
        entry = last[at]
        self.reading[src] = at + 1
        self.books.getting.setdefault(src, []).append(entry)
        key, kind, spec = entry
        if side is None:
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            self._recv(header, src, what)
            self._check(src, entry, header)
            value = decode(kind, list(spec)) if kind in KINDS else self._land(src, what, kind, list(spec), None)
            return key, value
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(side):
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            self._recv(header, src, what)
            self.unchecked.append((src, entry, header))
            value = decode(kind, list(spec)) if kind in KINDS else self._land(src, what, kind, list(spec),
                                                                             (side, compute))
        return key, value

    def _check(self, src: int, entry: Entry, header: torch.Tensor) -> None:
        """A header received as the book foretold must say what the book says."""
        key, kind, _ = entry
        words = header.tolist()
        if tuple(words[:_KEY]) != tuple(key) or words[_KEY] != kind:
            got = (int(words[0]), int(words[1]), int(words[2]))
            raise PeerError(f"{self.me} expected {_describe(key)} from rank {src}, as that rank's last step sent, "
                            f"and received {_describe(got)}: the ranks run different schedules; build every rank's "
                            "stage alike")

    def _land(self, src: int, what: str, kind: int, specs: list[Any], streams: Any) -> Any:
        """Receive the tensors ``specs`` ((dtype index, shape) each) announce, as the value of ``kind``."""
        tensors = []
        for dtype, shape in specs:
            t = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
            self._recv(t, src, what)
            tensors.append(t)
        if streams is not None and tensors:  # the compute stream reads them after they land, and keeps them alive
            side, compute = streams
            compute.wait_stream(side)
            for t in tensors:
                t.record_stream(compute)
        if kind == 2:
            return None
        return tensors[0] if kind == 0 else tuple(tensors)

    def recv(self, key: Key, src: int) -> Any:
        """The value sent under ``key`` by rank ``src``."""
        while (src, key) not in self.inbox:
            got, value = self._next(src, key)
            if (src, got) in self.inbox:
                raise PeerError(f"{self.me} received {_describe(got)} twice from rank {src}: the ranks run "
                                "different schedules; build every rank's stage with the same schedule and chunks")
            self.inbox[(src, got)] = value
        return self.inbox.pop((src, key))

    def flush(self) -> None:
        """Wait until every message sent has arrived (the end of a step)."""
        for work, _, dst in self.pending:
            with peer(self.me, dst, "waiting for its sends to arrive"):
                work.wait()
        self.pending.clear()
        if self.unchecked:  # headers received without waiting: landed once the receiving stream is done
            with peer(self.me, self.unchecked[0][0], "waiting for its messages to arrive"):
                _incoming(self.device).synchronize()
            for src, entry, header in self.unchecked:
                self._check(src, entry, header)
            self.unchecked.clear()
        if self.inbox:
            (src, key), *_ = self.inbox
            raise PeerError(f"{self.me} ends the step with {len(self.inbox)} unread message(s) ({_describe(key)} "
                            f"from rank {src}): the ranks run different schedules; build every rank's stage with "
                            "the same schedule and chunks")
        if self.books is not None:
            self.books.rotate()


_INCOMING: dict[torch.device, Any] = {}


def _incoming(device: torch.device) -> Any:
    """The stream this process receives messages on, on ``device`` (one per device, made on first use)."""
    device = torch.device(device.type, device.index if device.index is not None else torch.cuda.current_device())
    if device not in _INCOMING:
        _INCOMING[device] = torch.cuda.Stream(device)
    return _INCOMING[device]


_DIRECTIONS: list[Any] = []  # [the default group they were made in, to higher ranks, to lower ranks]


def directions() -> tuple[Any, Any]:
    """Two process groups over every rank, one for messages to higher ranks and one for messages to lower
    ranks (created once per process; every rank must call this, as it calls ``seqify.distributed.stage``).

    NCCL runs the sends and receives between two ranks of one group in order on one stream, and a large send
    finishes only once its receiver runs: with activations going one way while gradients come back (1F1B),
    rank 0 queued behind its send of an activation and rank 1 queued behind its send of a gradient would each
    wait for the other's receive, queued behind the send. With one direction per group, a stream holds only
    sends (sender) or only receives (receiver) of one ordered sequence, so no two ranks wait on each other."""
    world = dist.group.WORLD
    if not _DIRECTIONS or _DIRECTIONS[0] is not world:  # first use, or a new default group since
        everyone = list(range(dist.get_world_size()))
        _DIRECTIONS[:] = [world, dist.new_group(everyone), dist.new_group(everyone)]
    return _DIRECTIONS[1], _DIRECTIONS[2]
