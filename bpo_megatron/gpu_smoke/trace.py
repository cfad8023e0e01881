"""Where a profiled training step's time goes, read from its torch.profiler Chrome trace (the
kit's ``train_fast_paths`` writes them; ``tools/gpu/trace_summary.py`` prints this on any machine).

The trace carries no marks of its own, so the phases are read from its structure, as torch's
autograd lays it out:

* **backward**: the top-level operators named ``autograd::engine::evaluate_function: …`` (on a GPU
  they run on autograd's own thread, on a CPU on the caller's), one backward pass per run of them
  that no other top-level operator of the main thread interrupts;
* **forward**: what the main thread does before each backward (from the first kernel launch, or
  the previous backward's end);
* **before the first kernel**: the main thread's host work before it launched anything (per-sample
  checks, batching, host-to-device copies);
* after the last backward: up to the optimizer (``Optimizer.step#…``, torch's own annotation) the
  gradients are finished and clipped, then the **optimizer step**, then what follows it (the main
  weights copied back, the step's numbers read).

Host syncs: on a GPU the CUDA runtime's synchronize calls (the host waiting for the device), on a
CPU the scalar reads (``aten::_local_scalar_dense``, which would be syncs on a GPU). Each is placed
in its phase and named by the top-level operator around it (what asked for it). GPU busy time is the
union of the kernels' intervals (kernels of several streams may overlap).
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
SCALAR_READ = "aten::_local_scalar_dense"
BACKWARD_OP = "autograd::engine::evaluate_function"
OPTIMIZER_MARK = "Optimizer.step#"


def load(path: Path) -> list[dict[str, Any]]:
    """The events of a Chrome trace (``.json`` or ``.json.gz``)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def covered_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by sorted ``intervals`` (kernels on several streams may overlap)."""
    total, end = 0.0, float("-inf")
    for start, stop in intervals:
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def top_level(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operators of one thread that no other operator encloses, in time order."""
    out, end = [], float("-inf")
    for op in sorted(ops, key=lambda e: (e["ts"], -e.get("dur", 0))):
        if op["ts"] >= end:
            out.append(op)
            end = op["ts"] + op.get("dur", 0)
    return out


def _end(event: dict[str, Any]) -> float:
    return event["ts"] + event.get("dur", 0)


@dataclass
class Phase:
    name: str
    start: float  # µs, trace time
    end: float
    host_ops: int = 0  # top-level operators started in it
    kernels: int = 0  # kernels launched in it
    busy: float = 0.0  # µs the GPU ran a kernel within it
    syncs: int = 0
    sync_wait: float = 0.0  # µs the host spent in those syncs

    def row(self, origin: float) -> dict[str, Any]:
        span = self.end - self.start
        return {"phase": self.name, "start_ms": (self.start - origin) / 1e3, "wall_ms": span / 1e3,
                "host_ops": self.host_ops, "kernels": self.kernels, "gpu_busy_ms": self.busy / 1e3,
                "gpu_idle": (1 - self.busy / span) if span > 0 and self.kernels else float("nan"),
                "host_syncs": self.syncs, "sync_wait_ms": self.sync_wait / 1e3}


@dataclass
class Sync:
    at: float  # µs, trace time
    wait: float  # µs
    phase: str
    caller: str  # the top-level operator around it


@dataclass
class Analysis:
    """One profiled step: its span, the GPU's busy time, its phases and its host syncs."""

    start: float
    span: float  # µs
    busy: float  # µs
    kernels: int
    aten_ops: int
    on_gpu: bool
    phases: list[Phase] = field(default_factory=list)
    syncs: list[Sync] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def idle_share(self) -> float:
        return 1 - self.busy / self.span if self.on_gpu and self.span > 0 else float("nan")

    def phase_rows(self) -> list[dict[str, Any]]:
        return [p.row(self.start) for p in self.phases]


def _main_thread(ops: list[dict[str, Any]]) -> Any:
    """The thread that runs the step: the one with the most operators that are not backward nodes."""
    counts = collections.Counter(op["tid"] for op in ops if not op["name"].startswith(BACKWARD_OP))
    return counts.most_common(1)[0][0] if counts else None


def _backward_passes(ops: list[dict[str, Any]], main: Any) -> list[tuple[float, float]]:
    """(start, end) of each backward pass: the runs of top-level backward nodes (on any thread)
    that no other top-level operator of the main thread interrupts."""
    by_thread: dict[Any, list[dict[str, Any]]] = collections.defaultdict(list)
    for op in ops:
        by_thread[op["tid"]].append(op)
    outer = {tid: top_level(thread_ops) for tid, thread_ops in by_thread.items()}
    nodes = sorted((op for thread in outer.values() for op in thread if op["name"].startswith(BACKWARD_OP)),
                   key=lambda e: e["ts"])
    others = sorted(op["ts"] for op in outer.get(main, []) if not op["name"].startswith(BACKWARD_OP))
    passes: list[list[float]] = []
    for node in nodes:
        if passes:
            last_end = passes[-1][1]
            between = bisect.bisect_right(others, node["ts"]) - bisect.bisect_right(others, last_end)
            if between == 0 or node["ts"] <= last_end:
                passes[-1][1] = max(last_end, _end(node))
                continue
        passes.append([node["ts"], _end(node)])
    return [(a, b) for a, b in passes]


def analyse(events: list[dict[str, Any]]) -> Analysis:
    timed = [e for e in events if e.get("ph") == "X" and "ts" in e]
    if not timed:
        raise ValueError("the trace holds no timed events (ph 'X'): not a torch.profiler Chrome trace?")
    kernels = [e for e in timed if e.get("cat") == "kernel"]
    ops = [e for e in timed if e.get("cat") == "cpu_op"]
    runtime = [e for e in timed if e.get("cat") == "cuda_runtime"]
    on_gpu = bool(kernels or runtime)
    start = min(e["ts"] for e in timed)
    stop = max(_end(e) for e in timed)
    busy = covered_length(sorted((k["ts"], _end(k)) for k in kernels))
    main = _main_thread(ops)
    analysis = Analysis(start=start, span=stop - start, busy=busy, kernels=len(kernels),
                        aten_ops=sum(1 for op in ops if op["name"].startswith("aten::")), on_gpu=on_gpu,
                        events=timed)

    # phase boundaries
    launches = sorted(e["ts"] for e in runtime if e["name"].startswith("cudaLaunch"))
    passes = _backward_passes(ops, main)
    bounds: list[tuple[str, float]] = []  # (name, start); each phase ends where the next starts
    cursor = start
    if launches:
        bounds.append(("before the first kernel", start))
        cursor = launches[0]
    for i, (a, b) in enumerate(passes):
        suffix = f" {i + 1}" if len(passes) > 1 else ""
        bounds += [(f"forward{suffix}", cursor), (f"backward{suffix}", a)]
        cursor = b
    marks = [e for e in timed if e.get("cat") == "user_annotation" and e["name"].startswith(OPTIMIZER_MARK)
             and e["ts"] >= cursor]
    if not passes:
        bounds.append(("step (no backward found)", cursor))
    elif marks:
        mark = min(marks, key=lambda e: e["ts"])
        bounds += [("after backward: gradients finished, clipped", cursor), ("optimizer step", mark["ts"]),
                   ("after the optimizer step", _end(mark))]
    else:
        bounds.append(("after the last backward", cursor))
    phases = [Phase(name, a, b) for (name, a), (_, b) in zip(bounds, bounds[1:] + [("", stop)])]
    starts = [p.start for p in phases]

    def phase_of(ts: float) -> Phase:
        return phases[max(bisect.bisect_right(starts, ts) - 1, 0)]

    # host operators and launches by phase; the GPU's busy time clipped to each phase
    outer_ops = [op for tid in {op["tid"] for op in ops} for op in top_level([o for o in ops if o["tid"] == tid])]
    for op in outer_ops:
        phase_of(op["ts"]).host_ops += 1
    launch_time = {e["args"]["correlation"]: e["ts"] for e in runtime if "correlation" in e.get("args", {})}
    for k in kernels:
        phase_of(launch_time.get(k.get("args", {}).get("correlation"), k["ts"])).kernels += 1
    for phase in phases:
        clipped = sorted((max(k["ts"], phase.start), min(_end(k), phase.end)) for k in kernels
                         if k["ts"] < phase.end and _end(k) > phase.start)
        phase.busy = covered_length(clipped)

    # host syncs, named by the top-level operator around each
    sync_events = [e for e in runtime if e["name"] in SYNC_CALLS] if on_gpu else \
        [e for e in ops if e["name"] == SCALAR_READ]
    by_thread: dict[Any, list[dict[str, Any]]] = collections.defaultdict(list)
    for op in outer_ops:
        by_thread[op["tid"]].append(op)
    for thread in by_thread.values():
        thread.sort(key=lambda e: e["ts"])
    thread_starts = {tid: [op["ts"] for op in thread] for tid, thread in by_thread.items()}
    for event in sorted(sync_events, key=lambda e: e["ts"]):
        thread = by_thread.get(event["tid"], [])
        i = bisect.bisect_right(thread_starts.get(event["tid"], []), event["ts"]) - 1
        around = thread[i] if i >= 0 and _end(thread[i]) >= event["ts"] else None
        caller = around["name"] if around is not None else "(no operator)"
        phase = phase_of(event["ts"])
        phase.syncs += 1
        phase.sync_wait += event.get("dur", 0)
        analysis.syncs.append(Sync(event["ts"], event.get("dur", 0), phase.name, caller))
    analysis.phases = phases
    return analysis


def _cell(key: str, value: Any) -> str:
    if not isinstance(value, float):
        return str(value)
    if value != value:
        return "-"
    return f"{value:.0%}" if key == "gpu_idle" else f"{value:.2f}"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    keys = list(rows[0])
    cells = [{k: _cell(k, r[k]) for k in keys} for r in rows]
    widths = {k: max(len(k), *(len(c[k]) for c in cells)) for k in keys}
    align = {k: (str.ljust if k == "phase" else str.rjust) for k in keys}
    return ["  " + "  ".join(align[k](text, widths[k]) for k, text in line.items())
            for line in [dict(zip(keys, keys)), *cells]]


def summary(events: list[dict[str, Any]], top: int = 12) -> str:
    """The printed summary: the step, its phase table, where the host syncs fall, the kernels that
    take the most GPU time and each host thread's costliest top-level operators."""
    a = analyse(events)
    what = "host syncs (synchronize calls)" if a.on_gpu else "scalar reads (host syncs on a GPU)"
    lines = [f"span {a.span / 1e3:.1f} ms; GPU busy {a.busy / 1e3:.1f} ms ({a.kernels} kernels), idle "
             f"{a.idle_share:.1%} of the span" if a.on_gpu else
             f"span {a.span / 1e3:.1f} ms; no kernels (a CPU trace): host time only",
             "", "phases (ms from the trace's start; gpu_idle: share of the phase no kernel ran):"]
    lines += _table(a.phase_rows())
    lines += ["", f"where the {len(a.syncs)} {what} fall: phase, count, waited ms, the operators around them "
                  "(count)"]
    grouped: dict[str, list[Sync]] = collections.defaultdict(list)
    for sync in a.syncs:
        grouped[sync.phase].append(sync)
    for phase in a.phases:
        here = grouped.get(phase.name, [])
        if here:
            callers = collections.Counter(s.caller for s in here)
            lines.append(f"  {phase.name}: {len(here)}, {sum(s.wait for s in here) / 1e3:.2f} ms; "
                         + ", ".join(f"{name} ({n})" for name, n in callers.most_common(6)))
    longest = sorted(a.syncs, key=lambda s: -s.wait)[:5]
    if longest and a.on_gpu:
        lines.append("  longest: " + "; ".join(f"{s.wait / 1e3:.2f} ms at {(s.at - a.start) / 1e3:.1f} ms "
                                             f"({s.phase}, {s.caller})" for s in longest))
    by_kernel: collections.Counter = collections.Counter()
    for k in (e for e in a.events if e.get("cat") == "kernel"):
        by_kernel[k["name"][:100]] += k["dur"]
    if by_kernel:
        lines.append(f"\nkernels by GPU time (top {top}):")
        lines += [f"  {us / 1e3:8.2f} ms  {name}" for name, us in by_kernel.most_common(top)]
    threads: dict[Any, list[dict[str, Any]]] = collections.defaultdict(list)
    for op in (e for e in a.events if e.get("cat") == "cpu_op"):
        threads[op["tid"]].append(op)
    for tid, thread_ops in sorted(threads.items(), key=lambda kv: -len(kv[1])):
        outer = top_level(thread_ops)
        time: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        for op in outer:
            time[op["name"][:90]] += op.get("dur", 0)
            count[op["name"][:90]] += 1
        lines.append(f"\nhost thread {tid}: {len(thread_ops)} operators, {len(outer)} top-level, "
                     f"{sum(time.values()) / 1e3:.1f} ms (top {top}: ms, count, operator):")
        lines += [f"  {us / 1e3:8.2f} {count[name]:6d}  {name}" for name, us in time.most_common(top)]
    return "\n".join(lines)
