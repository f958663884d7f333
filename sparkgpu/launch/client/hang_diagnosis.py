"""Which ranks of a hung attempt are behind, and where every rank is: :func:`diagnose` on the ranks' stacks.

Each rank's stacks file (``attempts/<k>/stacks/rank-<r>.txt``) holds a header naming the rank,
its node, its pid and its main thread (:data:`~sparkgpu.launch.rank.progress.STACKS_HEADER`),
then every dump :mod:`faulthandler` wrote on request, each after a marker line the supervisor
appended (:data:`DUMP_MARKER`). :func:`parse_stacks` reads the last dump's main thread.

A rank whose main thread is inside one of torch's collectives waits for its peers; the others
are behind. When every rank waits in a collective, the ranks whose last collective comes first
in their flight recorders are behind (:mod:`~sparkgpu.launch.client.flight_record`), else those
with the fewest progress notes (they are in an earlier collective); when none waits in one,
every stalled rank is.
"""

from __future__ import annotations

import dataclasses
import enum
import linecache
import re
from collections.abc import Mapping, Sequence

from sparkgpu.launch.client.flight_record import LastCollective, behind_by_sequence
from sparkgpu.launch.rank.progress import DUMP_MARKER
from sparkgpu.rundir.progress import RankProgress

__all__ = [
    "DUMP_MARKER",
    "Frame",
    "RankStacks",
    "RankState",
    "RankPlace",
    "Diagnosis",
    "parse_stacks",
    "place_of",
    "diagnose",
    "rank_list",
]


_HEADER = re.compile(r"^sparkgpu rank (\d+) on node (\d+), pid (\d+), main thread 0x([0-9a-f]+)", re.MULTILINE)
_THREAD = re.compile(r"^(?:Current thread|Thread) 0x([0-9a-f]+) \(most recent call first\):\s*$")
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<name>\S+)')
#: The caller's code as a node rehydrates it (``<cache>/sparkgpu/env/<id>/path/<n>/``): user code,
#: though under a folder named sparkgpu.
_SHIPPED = r"[/\\]sparkgpu[/\\]env[/\\][^/\\]+[/\\]path[/\\]\d+[/\\]"
#: Where library code lives: installed packages, the standard library, frozen modules, sparkgpu itself.
_LIBRARY = re.compile(
    r"[/\\](site|dist)-packages[/\\]|[/\\]lib[/\\]python\d+(\.\d+)?[/\\]|^<frozen "
    r"|[/\\]sparkgpu[/\\](?!env[/\\][^/\\]+[/\\]path[/\\]\d+[/\\])|_air\.py$"
)
_MODULE_ROOT = re.compile(
    rf".*{_SHIPPED}|.*[/\\](?:site-packages|dist-packages|python\d+(?:\.\d+)?)[/\\]|.*[/\\](?=sparkgpu[/\\])"
)
#: torch's collectives and point-to-point calls: a rank inside one waits for its peers.
_COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
        "broadcast",
        "broadcast_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
    }
)
#: The modules a rank waiting in a collective is in, innermost (the collectives and their logging wrapper).
_C10D = frozenset({"torch.distributed.distributed_c10d", "torch.distributed.c10d_logger"})
#: Decorators' frames that say nothing of where a rank is.
_WRAPPERS = frozenset({"wrapper", "inner", "_fn", "decorate_context", "_call_impl", "_wrapped_call_impl"})


@dataclasses.dataclass(frozen=True)
class Frame:
    file: str
    line: int
    name: str

    @property
    def library(self) -> bool:
        return bool(_LIBRARY.search(self.file))

    @property
    def module(self) -> str:
        """``torch.distributed.distributed_c10d`` for a library file; the file's name for user code."""
        tail = _MODULE_ROOT.sub("", self.file)
        if tail == self.file:
            return self.file.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".py")
        return tail.removesuffix(".py").removesuffix("/__init__").replace("/", ".").replace("\\", ".")

    def at(self) -> str:
        """``"train.py:12"``."""
        return f"{self.file.replace(chr(92), '/').rsplit('/', 1)[-1]}:{self.line}"

    def source(self) -> str:
        return linecache.getline(self.file, self.line).strip()


@dataclasses.dataclass(frozen=True)
class RankStacks:
    """One rank's last dump: its main thread's frames, outermost first, and the other threads' count."""

    rank: int
    node: int
    pid: int
    main: tuple[Frame, ...]
    threads: int
    text: str  # the last dump as faulthandler wrote it


class RankState(str, enum.Enum):
    WAITING = "waiting"  # in one of torch's collectives: it waits for its peers
    ELSEWHERE = "elsewhere"  # anywhere else: in user code, a loader, a library
    UNKNOWN = "unknown"  # no stacks came back


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """Where a rank's main thread is, in words (``"in `train_step` at train.py:40 (`time.sleep(3600)`)"``)."""

    state: RankState
    words: str


def parse_stacks(text: str) -> RankStacks | None:
    """The last dump in a rank's stacks file; ``None`` without a header or a dump."""
    header = _HEADER.search(text)
    if header is None:
        return None
    rank, node, pid, main_id = int(header[1]), int(header[2]), int(header[3]), int(header[4], 16)
    dump = text.rsplit(DUMP_MARKER, 1)[1] if DUMP_MARKER in text else text[header.end() :]
    threads: dict[int, list[Frame]] = {}
    current: list[Frame] | None = None
    for line in dump.splitlines():
        thread = _THREAD.match(line)
        if thread:
            current = threads.setdefault(int(thread[1], 16), [])
            continue
        frame = _FRAME.match(line)
        if frame and current is not None:
            current.append(Frame(frame["file"], int(frame["line"]), frame["name"]))
    if not threads:
        return None
    main = threads.get(main_id)
    if main is None:  # the header's thread is not in the dump: take the one with the deepest stack
        main = max(threads.values(), key=len)
    return RankStacks(rank, node, pid, tuple(reversed(main)), len(threads), dump.strip())


def _user_frame(frames: Sequence[Frame]) -> Frame | None:
    user = [f for f in frames if not f.library]
    return user[-1] if user else None


def _called_from(frames: Sequence[Frame], below: int) -> str:
    caller = _user_frame(frames[:below])
    return f", called from `{caller.name}` at {caller.at()}" if caller is not None else ""


def _collective(frames: Sequence[Frame]) -> tuple[int, str] | None:
    """The collective the innermost frames are in (the outermost one of a nested call such as
    ``broadcast`` in ``broadcast_object_list``), with its frame's index; ``None`` when they are not."""
    found = None
    for index in range(len(frames) - 1, -1, -1):
        frame = frames[index]
        if frame.module not in _C10D:
            break
        if frame.name in _COLLECTIVES:
            found = (index, frame.name)
    return found


def place_of(stacks: RankStacks | None) -> RankPlace:
    """Where a rank is, from its stacks (see :class:`RankPlace`)."""
    if stacks is None or not stacks.main:
        return RankPlace(RankState.UNKNOWN, "gave no stacks")
    frames = stacks.main
    waiting = _collective(frames)
    if waiting is not None:
        index, name = waiting
        return RankPlace(RankState.WAITING, f"waits in `{name}`{_called_from(frames, index)}")
    innermost = frames[-1]
    if not innermost.library:
        source = innermost.source()
        code = f" (`{source}`)" if source else ""
        return RankPlace(RankState.ELSEWHERE, f"is in `{innermost.name}` at {innermost.at()}{code}")
    # In a library: name where the user's code entered it, and the innermost frame.
    last_user = max((i for i, f in enumerate(frames) if not f.library), default=-1)
    entered = next(
        (f for f in frames[last_user + 1 :] if f.name not in _WRAPPERS and not f.name.startswith("<")), innermost
    )
    words = f"is in `{entered.module}.{entered.name}`"
    if entered is not innermost:
        words += f" (innermost: `{innermost.module}.{innermost.name}` at {innermost.at()})"
    return RankPlace(RankState.ELSEWHERE, words + _called_from(frames, len(frames)))


def _agree(words: str, count: int) -> str:
    """``"waits in ..."`` for one rank, ``"wait in ..."`` for several."""
    if count == 1:
        return words
    return re.sub(r"^(waits|is) ", lambda m: "wait " if m[1] == "waits" else "are ", words)


def rank_list(ranks: Sequence[int]) -> str:
    """``"rank 3"``, ``"ranks 0-2, 4-7"``."""
    ordered = sorted(set(ranks))
    runs: list[list[int]] = []
    for rank in ordered:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)
    return f"{'rank' if len(ordered) == 1 else 'ranks'} {text}"


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """A hung attempt: the ranks behind, and where every rank is."""

    behind: tuple[int, ...]
    places: dict[int, RankPlace]
    nodes: dict[int, int]
    summary: str  # one sentence: who is behind and where, who waits where

    def to_json(self) -> dict:
        return {
            "behind": list(self.behind),
            "summary": self.summary,
            "ranks": {
                str(rank): {"node": self.nodes.get(rank), "state": place.state.value, "where": place.words}
                for rank, place in sorted(self.places.items())
            },
        }


def diagnose(
    stacks: Mapping[int, RankStacks | None],
    progress: Mapping[int, RankProgress | None],
    stalled: Mapping[int, float],
    timeout: float,
    world_size: int,
    collectives: Mapping[int, LastCollective | None] | None = None,
) -> Diagnosis:
    """Names the ranks behind and where every rank is.

    Args:
        stacks: Each rank's last dump (``None`` where none came back).
        progress: Each rank's progress record, as last read.
        stalled: Seconds each rank has gone without progress, for the ranks past ``timeout``.
        timeout: The progress timeout that passed.
        world_size: The attempt's ranks.
        collectives: Each rank's last collective from its flight recorder, where it dumped one:
            when every rank waits in a collective, those whose last one comes first are behind.
    """
    ranks = range(world_size)
    places = {r: place_of(stacks.get(r)) for r in ranks}
    nodes = {}
    for r in ranks:
        record, dump = progress.get(r), stacks.get(r)
        nodes[r] = dump.node if dump is not None else record.node if record is not None else 0
    elsewhere = [r for r in ranks if places[r].state is not RankState.WAITING]
    if elsewhere:
        behind = [r for r in elsewhere if r in stalled] or elsewhere
    else:  # everyone waits in a collective: those in an earlier one (by the recorder, else by notes)
        behind = behind_by_sequence({r: (collectives or {}).get(r) for r in ranks})
        if not behind:
            counts = {r: (progress.get(r).count if progress.get(r) is not None else 0) for r in ranks}  # type: ignore[union-attr]
            fewest = min(counts.values())
            behind = [r for r in ranks if counts[r] == fewest]
    longest = max((stalled.get(r, 0.0) for r in behind), default=0.0)
    parts = []
    by_place: dict[str, list[int]] = {}
    for r in behind:
        by_place.setdefault(places[r].words, []).append(r)
    for words, members in by_place.items():
        on = sorted({nodes[r] for r in members})
        node_words = f"node {on[0]}" if len(on) == 1 else f"nodes {', '.join(map(str, on))}"
        parts.append(f"{rank_list(members)} on {node_words} {_agree(words, len(members))}")
    first = (
        f"{'; '.join(parts)}; no progress for {longest:.1f}s (progress_timeout={timeout:g}s)"
        if len(behind) < world_size
        else f"no rank made progress for {longest:.1f}s (progress_timeout={timeout:g}s): {'; '.join(parts)}"
    )
    others: dict[str, list[int]] = {}
    for r in ranks:
        if r not in behind:
            others.setdefault(places[r].words, []).append(r)
    rest = "; ".join(f"{rank_list(members)} {_agree(words, len(members))}" for words, members in others.items())
    if not elsewhere and len(behind) == world_size:
        rest = "every rank waits in a collective: they called different collectives, or a peer's link is stuck"
    summary = f"{first}; {rest}" if rest else first
    if collectives and any(c is not None for c in collectives.values()):
        summary += f"; flight recorder: {_collectives_clause(collectives, world_size)}"
    return Diagnosis(tuple(behind), places, nodes, summary)


def _collectives_clause(collectives: Mapping[int, LastCollective | None], world_size: int) -> str:
    groups: dict[str, list[int]] = {}
    for rank in range(world_size):
        found = collectives.get(rank)
        groups.setdefault(f"at {found.words}" if found is not None else "without a record", []).append(rank)
    return "; ".join(f"{rank_list(members)} {words}" for words, members in groups.items())
