"""The guard's one path from device values to host numbers: deferred, counted readings.

A monitor never reads a tensor itself (on a GPU every ``.item()``, ``.tolist()`` or ``.cpu()`` in
a training step is a host sync). It ``submit``s small tensors computed on the device (the loss,
gradient norms, the GradScaler's state, AMP106's counts, per-op peaks while tracing) together
with a judge (through ``Monitor.submit``, which runs the judge contained as that monitor's
code: a judge that fails switches its monitor off, ``containment.py``). At a commit point
everything submitted is packed into one buffer per device and copied to the host with
``non_blocking=True`` (into pinned memory where the source is on an accelerator), and an event
recorded behind the copy. A training step has one commit point: the optimizer step pre-hook.
What the step submits after it (the GradScaler's update, the step's loss for metrics.jsonl)
rides with the next step's commit; a step with no optimizer step commits at its end
(``end_step``). So a steady step starts one copy in every precision.
``poll`` then judges, in submission order, every batch whose copy is known complete — the
event's ``query()`` never waits — and calls each judge with the values and the step they were
submitted in, so events carry the step in which the problem happened. On the CPU a copy is
complete at once: what a step submitted before its optimizer step is judged at the commit,
before the optimizer applies the step, and the rest at the next step's. On a GPU they are
judged when the device has caught up, typically a step later.
``flush`` waits for what is left, once: at guard exit and before the pytest plugin judges a test.
``read_now`` reads at once, waiting: only for the replay of a failing step (``replay.py``), which
runs once per anomaly episode and must judge its own trace before the optimizer goes on.

The same code runs on every device, so the CPU test suite exercises what GPUs run, and
``counts`` tells how many copies were started, how many batches were read once their copy was
known complete (no sync) and how many had to be waited for (a host sync on a GPU).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

#: ``judge(values, step)``: the submitted tensors' values, flattened and concatenated in order,
#: and the guard's step when they were submitted.
Judge = Callable[[List[float], int], None]

#: Submissions held before a commit is forced (a loop that never ends a step stays bounded).
MAX_PENDING = 4096
#: Batches in flight before the oldest is waited for (a device far behind the host).
MAX_IN_FLIGHT = 64


@dataclass
class ReadCounts:
    """What the readings cost so far."""

    #: Device-to-host copies started (one per device and commit).
    copies: int = 0
    #: Batches judged (each once, after its copies were known complete).
    reads: int = 0
    #: Times the host waited for copies not known complete (a host sync on a GPU): at a flush,
    #: or when too many batches are in flight. Never in a steady training step.
    waits: int = 0


class _Batch:
    """One commit: the host copies (one per device), their completion events and the judges."""

    __slots__ = ("copies", "entries", "after")

    def __init__(self, copies, entries):
        #: ``(host tensor, event or None)`` per device; None: complete at once (CPU).
        self.copies: List[Tuple[torch.Tensor, Optional[torch.Event]]] = copies
        #: ``(judge, step, spans)``, a span being ``(copy index, start, length)``.
        self.entries: List[Tuple[Judge, int, List[Tuple[int, int, int]]]] = entries
        #: ``(n, callback)``: called once the first ``n`` entries have been judged
        #: (``Readings.after``), in that order.
        self.after: List[Tuple[int, Callable[[], None]]] = []


class Readings:
    """Deferred device readings of one guard (see the module doc)."""

    def __init__(self):
        #: The guard's current step: submissions are judged with the step they were made in.
        self.step = 0
        self.counts = ReadCounts()
        #: Called at the start of each commit; they may ``submit`` what they hold (per-op traces).
        self.collectors: List[Callable[[], None]] = []
        self._pending: List[Tuple[Judge, int, Sequence[torch.Tensor]]] = []
        #: ``after`` callbacks waiting for the pending submissions' commit, each with the
        #: number of submissions it follows.
        self._pending_after: List[Tuple[int, Callable[[], None]]] = []
        self._in_flight: Deque[_Batch] = deque()
        #: Whether the current step has committed (its optimizer step pre-hook ran).
        self._committed_in_step = False

    def submit(self, tensors: Sequence[torch.Tensor], judge: Judge) -> None:
        """Judge ``tensors`` (small, floating point, any devices) once they reach the host.

        They are read as they are at the next commit: submit tensors nothing changes in place
        before then (results of reductions, clones).
        """
        self._pending.append((judge, self.step, tensors))
        if len(self._pending) >= MAX_PENDING:
            self.commit()
            self.poll()

    def commit(self) -> None:
        """Start the copy of everything submitted: one buffer and one copy per device."""
        self._collect()
        self._committed_in_step = True
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        batch = self._copy(pending)
        batch.after, self._pending_after = self._pending_after, []
        self._in_flight.append(batch)
        if len(self._in_flight) > MAX_IN_FLIGHT:
            oldest = self._in_flight.popleft()
            self._wait(oldest)
            self._read(oldest)

    def end_step(self) -> None:
        """The step ends: a step that committed (at its optimizer step) leaves what it submitted
        since for the next step's commit, so a step costs one copy; one that did not commits
        now, so nothing waits longer than a step."""
        if self._committed_in_step:
            self._collect()  # the ops traced since belong to this step
        else:
            self.commit()
        self._committed_in_step = False

    def read_now(self, tensors: Sequence[torch.Tensor]) -> List[float]:
        """The values of ``tensors``, waiting for the device if need be: for a path that is rare
        by design (the replay of a failing step, once per anomaly episode), never a training
        step's. Counted like a batch flushed alone."""
        values: List[float] = []
        batch = self._copy([(lambda read, step: values.extend(read), self.step, tensors)])
        if not self._complete(batch):
            self._wait(batch)
        self._read(batch)
        return values

    def poll(self) -> None:
        """Judge, in order, every batch whose copy is known complete; never waits."""
        in_flight = self._in_flight
        while in_flight and self._complete(in_flight[0]):
            self._read(in_flight.popleft())

    def flush(self) -> None:
        """Commit and judge everything, waiting (once) for the device if it has not caught up:
        the newest copies are waited for first, and the older ones, queued before them on the
        device, have arrived by then."""
        self.commit()
        for batch in reversed(self._in_flight):
            if not self._complete(batch):
                self._wait(batch)
        while self._in_flight:
            self._read(self._in_flight.popleft())

    def after(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once everything submitted so far has been judged, before what is
        submitted later (the next step's readings, copied with these) is."""
        if self._pending:
            self._pending_after.append((len(self._pending), callback))
        elif self._in_flight:
            newest = self._in_flight[-1]
            newest.after.append((len(newest.entries), callback))
        else:
            callback()

    def clear(self) -> None:
        """Forget everything not judged yet (the guard is leaving by an exception)."""
        self._pending.clear()
        self._pending_after.clear()
        self._in_flight.clear()

    # -- internals ----------------------------------------------------------------------

    def _collect(self) -> None:
        for collect in self.collectors:
            collect()

    def _copy(self, pending: List[Tuple[Judge, int, Sequence[torch.Tensor]]]) -> _Batch:
        """Pack ``pending``'s tensors into one buffer per device and start their copies."""
        slots: Dict[torch.device, int] = {}
        parts: List[List[torch.Tensor]] = []
        sizes: List[int] = []
        entries = []
        for judge, step, tensors in pending:
            spans = []
            for tensor in tensors:
                slot = slots.get(tensor.device)
                if slot is None:
                    slot = slots[tensor.device] = len(parts)
                    parts.append([])
                    sizes.append(0)
                flat = tensor if tensor.dim() == 1 else tensor.reshape(-1)
                parts[slot].append(flat)
                size = flat.numel()
                if spans and spans[-1][0] == slot:  # follows the previous one: one span
                    spans[-1] = (slot, spans[-1][1], spans[-1][2] + size)
                else:
                    spans.append((slot, sizes[slot], size))
                sizes[slot] += size
            entries.append((judge, step, spans))
        with torch._C.DisableTorchFunction():
            copies = [self._start_copy(torch.cat(part)) for part in parts]
        return _Batch(copies, entries)

    def _start_copy(self, buffer: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Event]]:
        """The one device-to-host transfer: non-blocking, into pinned memory from an accelerator
        (``to`` allocates it), followed by an event; host memory is returned as it is."""
        self.counts.copies += 1
        if buffer.device.type == "cpu":
            return buffer, None  # already host memory: ``to`` would return it as it is
        host = buffer.to("cpu", non_blocking=True)
        done = torch.Event(buffer.device)
        done.record()
        return host, done

    def _complete(self, batch: _Batch) -> bool:
        """Whether every copy of ``batch`` has arrived (a non-blocking query)."""
        for _, done in batch.copies:
            if done is not None and not done.query():
                return False
        return True

    def _wait(self, batch: _Batch) -> None:
        """Block until ``batch``'s copies have arrived: the one place the host waits."""
        self.counts.waits += 1
        for _, done in batch.copies:
            if done is not None:
                done.synchronize()

    def _read(self, batch: _Batch) -> None:
        """Judge ``batch``, whose copies have arrived. A judge that raises (GuardError under
        policy="raise") does so once the whole batch is judged."""
        self.counts.reads += 1
        values = [host.tolist() for host, _ in batch.copies]
        error = None
        callbacks = iter(batch.after)
        due = next(callbacks, None)
        for judged, (judge, step, spans) in enumerate(batch.entries, 1):
            if len(spans) == 1:  # the usual case: all on one device
                slot, start, length = spans[0]
                read = values[slot][start:start + length]
            else:
                read = [v for slot, start, length in spans
                        for v in values[slot][start:start + length]]
            try:
                judge(read, step)
            except Exception as err:  # the first one is raised once the batch is done
                error = error or err
            while due is not None and due[0] <= judged:
                due[1]()
                due = next(callbacks, None)
        while due is not None:
            due[1]()
            due = next(callbacks, None)
        if error is not None:
            raise error
