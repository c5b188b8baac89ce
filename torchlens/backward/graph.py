"""What a forward fed autograd, and the hooks on the nodes of the graph it built.

`GradientRoots` notes, as the forward runs, the node each op's output got; `BackwardWatch` walks
the graph from them when the forward ends, ties each node to the op that made it (autograd numbers
nodes as it makes them, so an op's nodes are the new ones its output's node reaches) and each
leaf's accumulator to the leaf's name, and hooks them all: the `NodeRecord` of a node is its hook.
"""

from __future__ import annotations

import functools
import weakref
from typing import Dict, Optional, Tuple

import torch
from torch.autograd.graph import get_gradient_edge

from ..measure.tracking import ForwardCause, ForwardValues
from ..narration.grammar import op_ref
from ..results import Recording
from ..torch_internals.engine import graph_task_id
from ..torch_internals.seams import degraded

__all__ = ["BackwardWatch", "GradientRoots", "NodeRecord", "running_backward"]

_sequence_nr = torch._C._autograd._get_sequence_nr
_Tensor = torch.Tensor
_BackwardCFunction = torch.autograd.function.BackwardCFunction


def running_backward() -> bool:
    """Whether this thread is inside a run of autograd's engine (a node, a hook)."""
    return graph_task_id() != -1


class GradientRoots:
    """What one forward's ops fed autograd: (event, node of an output, what made it when more than
    the op, the ops it stands for) in order, the sequence number autograd was at when the forward
    began, and the forward's inputs that are leaves."""

    __slots__ = ("start", "items", "inputs")

    def __init__(self):
        self.start = _sequence_nr()
        self.items: list = []
        self.inputs: Dict[int, tuple] = {}  # id(tensor) -> (weak reference, label)

    def note(self, event, out, forward: Optional[str] = None, ops: Optional[tuple] = None) -> None:
        """`event` produced `out` (a tensor or a sequence of them): remember their nodes.
        `forward` names what made them when it is more than the op (a compiled graph call), and
        `ops` are the ops it stands for (the graph's)."""
        ops = (event,) if ops is None else ops
        if isinstance(out, _Tensor):
            node = out.grad_fn
            if node is not None:
                self.items.append((event, node, forward, ops))
            return
        for tensor in out:
            if isinstance(tensor, _Tensor) and tensor.grad_fn is not None:
                self.items.append((event, tensor.grad_fn, forward, ops))

    def note_input(self, label: str, tensor) -> None:
        if isinstance(tensor, _Tensor) and tensor.requires_grad:
            self.inputs[id(tensor)] = (weakref.ref(tensor), f"the input {label}")

    def leaf_label(self, tensor, names: dict) -> str:
        name = names.get(id(tensor))
        if name is not None:
            return name
        known = self.inputs.get(id(tensor))
        if known is not None and known[0]() is tensor:
            return known[1]
        return "a leaf tensor no narrated op produced"


class NodeRecord:
    """A hooked node: its name and what it stands for in the forward. The record is itself the
    node's pre-hook and hook (called with one argument before the node runs, two after): one
    object per node, which a training step makes by the thousand.

    It holds no autograd node (that would keep the graph, and the activations it saved, alive for
    as long as the pass is watched): `edges` are the records of the nodes it sends its gradients to,
    by slot, and `key` tells nodes apart in a run (a leaf's is its tensor's: graphs of two passes
    share a parameter's accumulator).
    """

    __slots__ = ("watch", "key", "name", "scope", "site", "forward", "label", "edges", "leaf", "ops", "before")

    watch: Optional["BackwardWatch"]
    edges: Tuple[Optional["NodeRecord"], ...]
    leaf: Optional[weakref.ref]

    def __init__(self, name, scope, site, forward, label=None, key=None, ops=(), before=None):
        self.watch = None  # the `BackwardWatch` it reports through
        self.key = id(self) if key is None else key
        self.name = name
        self.scope = scope
        self.site = site
        self.forward = forward  # `#5 linear @fc2`: the forward op the node differentiates
        self.label = label  # for AccumulateGrad: the leaf's name
        self.edges = ()  # per gradient slot: the record of the node it is sent to (None: unwatched)
        self.leaf = None  # for AccumulateGrad: a weak reference to the leaf (its `.grad`, after the backward)
        # whose values it computes with: the forward ops it differentiates (a compiled graph's, one
        # node for all), or, where no op stands for it, those before the op ordinal `before`
        self.ops = ops
        self.before = before

    def forward_cause(self):
        """The non-finite value (`tracking.ForwardCause`) its forward op read or produced, or why
        that is not known; None when they were finite."""
        values = self.watch.forward_values if self.watch is not None else None
        if values is None:
            return ForwardCause(None, "the forward's values were not tracked", None)
        return values.of(self.ops, self.before)

    def forward_held(self):
        """The non-finite value its forward op's output held (`tracking.ForwardCause`), if known."""
        values = self.watch.forward_values if self.watch is not None else None
        return values.held(self.ops) if values is not None else None

    def __call__(self, *grads) -> None:
        watch = self.watch
        assert watch is not None  # (hooked only once its watch is set)
        if len(grads) == 2:  # after the node ran: (what it produced, what it received)
            watch.narration.node_done(watch, self, grads[0], grads[1])
        else:  # the node is about to run: what it received
            watch.narration.node_starting(watch, self, grads[0])


class Hooks:
    """The hooks a watch registered, to be removed: each as a weak reference to the hook table it
    sits in, and its key there.

    torch returns a handle per hook: an object holding that weak reference and the key. A training
    step registers hundreds, which would live as long as the watch and be moved by the garbage
    collector into its oldest generation, bringing its next full collection closer; keeping the
    reference and the key (an int) instead halves what survives, and removing a hook is what the
    handle's `remove` does. The tables are held weakly, as the handles hold them: a graph the user
    dropped is freed with its hooks. A handle shaped otherwise is kept as it is (a torch seam)."""

    __slots__ = ("tables", "keys", "handles")

    def __init__(self):
        self.tables: list = []  # weak references to hook tables
        self.keys: list = []
        self.handles: list = []

    def add(self, handle) -> None:
        try:
            table, key = handle.hooks_dict_ref, handle.id
            plain = not handle.extra_dict_ref and table().get(key) is not None
        except Exception as exc:
            degraded("hook handles", exc)
            plain = False
        if plain:
            self.tables.append(table)
            self.keys.append(key)
        else:
            self.handles.append(handle)

    def remove(self) -> None:
        """Remove every hook still in place. Idempotent."""
        tables, keys, handles = self.tables, self.keys, self.handles
        self.tables, self.keys, self.handles = [], [], []
        for table, key in zip(tables, keys):
            table = table()
            if table is not None:
                table.pop(key, None)
        for handle in handles:
            handle.remove()


class BackwardWatch:
    """The hooks on one forward's graph, and the recording its backwards are added to."""

    def __init__(self, narration, recording: Recording, roots: GradientRoots, outputs,
                 names: dict, root, forward_values: Optional[ForwardValues] = None):
        self.narration = narration
        self.forward_values = forward_values  # what each forward op read or produced that was not finite
        # The recording is held weakly: its output holds the graph (and what it saved for the
        # backward), which the user may drop (`Recorder(keep=0)`, an evaluation never backwarded).
        # What a backward needs of it is held here instead.
        self._recording = weakref.ref(recording)
        self.header = recording.header
        self._forward = (recording.events, recording.settings, recording.footer_extra, recording.findings)
        self.root = root  # the model's scope: where gradients reaching its outputs are shown
        self.runs = 0  # backwards through this graph so far
        self.hooks = Hooks()
        self.accumulators: list = []  # of leaves returned as they are (no graph holds theirs)
        self.parameters: tuple = ()  # (name, weak reference) of the model's (see `BackwardNarration.watch`)
        try:
            records, held = self._hook_nodes(roots, names, outputs)
            self._hook_outputs(outputs, records, roots, names)
            del held
        except BaseException:
            self.detach()
            raise

    @property
    def pass_name(self) -> str:
        return self.header or "the forward"

    def add_backward(self, backward) -> None:
        """A run through this graph began: its `Backward` joins the recording (if still held: a
        recording nobody holds keeps none, nor the gradients a trace would keep in them)."""
        recording = self._recording()
        if recording is not None:
            recording.backward.append(backward)

    def recording(self, backward) -> Recording:
        """The pass's recording, or, if nothing holds it any more, one like it without the output,
        holding `backward` (the run that failed)."""
        recording = self._recording()
        if recording is None:
            events, settings, footer_extra, findings = self._forward
            recording = Recording(events, None, settings, self.header, footer_extra, findings=findings)
            recording.backward = [backward]
        return recording

    def _hook_nodes(self, roots: GradientRoots, names: dict, outputs):
        """Record and hook every node of this forward: (id(node) -> record, the nodes, which must be
        held for as long as those ids are read). The walk starts from each op's output, then from
        the forward's outputs (one made by a custom `autograd.Function` was no op's)."""
        records: Dict[int, Optional[NodeRecord]] = {}
        start, hooked = roots.start, self.hooks.add
        # Every node reached is held until the walk ends: autograd makes a node's Python object on
        # demand and may make a new one (at a freed one's address) once nothing holds the last
        held = []
        walked = []  # (record, the nodes it sends to), to resolve the edges once all are recorded
        starts = list(roots.items)
        last = roots.items[-1][0] if roots.items else None
        if last is not None:
            starts += [(last, tensor.grad_fn, ("output", label), ())
                       for label, tensor in outputs if isinstance(tensor, _Tensor) and tensor.grad_fn is not None]
        for event, first, forward, ops in starts:
            stack = [first]
            while stack:
                node = stack.pop()
                if node is None or id(node) in records:
                    continue
                held.append(node)
                record = self._record(node, event, forward, ops, start, roots, names)
                if record is None:
                    records[id(node)] = None  # made before this forward: not walked again
                    continue
                records[id(node)] = record
                record.watch = self
                if record.label is not None:
                    # a leaf's accumulator: after it ran, what it received (the gradient added to
                    # `.grad`, not what `.grad` held before, which may be another step's)
                    hooked(node.register_hook(record))
                    continue
                hooked(node.register_prehook(record))
                hooked(node.register_hook(record))
                next_nodes = tuple(next_node for next_node, _ in node.next_functions)
                walked.append((record, next_nodes))
                stack.extend(next_nodes)
        for record, next_nodes in walked:
            record.edges = tuple(records.get(id(n)) if n is not None else None for n in next_nodes)
        return records, held

    @staticmethod
    def _record(node, event, forward, ops, start: int, roots: GradientRoots, names: dict) -> Optional[NodeRecord]:
        """What `node`, reached from `event`'s output (made by `ops`), stands for; None for a node
        made before the forward began (another model's, or preprocessing's)."""
        kind = type(node).__name__
        if kind == "AccumulateGrad":
            leaf = node.variable
            record = NodeRecord(kind, event.scope, None, None, roots.leaf_label(leaf, names), key=("leaf", id(leaf)))
            record.leaf = weakref.ref(leaf)
            return record
        if node._sequence_nr() < start:
            return None
        output = forward[1] if isinstance(forward, tuple) else None  # reached from the forward's output
        if isinstance(node, _BackwardCFunction) and (forward is None or output is not None):
            # a custom autograd.Function: its apply is no torch op, so it is named by what read it
            reader = (f"returning the output {output}" if output is not None
                      else f"read by {op_ref(event.ordinal, event.op, event.scope.path)}")
            # (`_forward_cls`: the Function class torch sets on its backward node class, unknown to its stubs)
            forward = f"{node._forward_cls.__name__}.apply (an autograd.Function), {reader}"  # type: ignore[attr-defined]
            ops = ()  # (its values are the Function's, made before the op that read them)
        elif output is not None:
            forward = f"the output {output}, made by no narrated op"
        elif forward is None:
            forward = op_ref(event.ordinal, event.op, event.scope.path)
        before = event.ordinal + (output is not None)  # (an output's: made before the forward ended)
        return NodeRecord(node.name(), event.scope, event.site, forward, ops=ops, before=before)

    def _hook_outputs(self, outputs, records: dict, roots: GradientRoots, names: dict) -> None:
        """A `<=` hook on each output (once per tensor), tied to the record of the node it feeds —
        or, for an output that is a leaf (a parameter returned as is), the leaf's, hooked here if no
        op read it."""
        arrived = self.narration.output_grad
        leaves = {record.key: record for record in records.values() if record is not None and record.label}
        seen = set()
        for label, tensor in outputs:
            if not isinstance(tensor, _Tensor) or not tensor.requires_grad or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            if tensor.grad_fn is not None:
                node = records.get(id(tensor.grad_fn))
            else:
                node = leaves.get(("leaf", id(tensor)))
                if node is None:
                    node = NodeRecord("AccumulateGrad", self.root, None, None, roots.leaf_label(tensor, names),
                                      key=("leaf", id(tensor)))
                    node.leaf = weakref.ref(tensor)
                    node.watch = self
                    # autograd holds a leaf's accumulator only while a graph uses it: this one is
                    # held here, or the backward would make another, without the hook
                    accumulator = get_gradient_edge(tensor).node
                    self.accumulators.append(accumulator)
                    self.hooks.add(accumulator.register_hook(node))
            self.hooks.add(tensor.register_hook(functools.partial(arrived, self, label, node)))

    def detach(self) -> None:
        """Remove every hook (nodes outlive the pass while the user holds the graph). Idempotent."""
        self.hooks.remove()
        self.accumulators = []
