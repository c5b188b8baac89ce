"""Statistics of compiled graphs: what each op's output holds, measured after the call or fused into it.

Three ways, chosen per graph at compile time:

- **Screened** (tracking alone, the CPU, a graph `_screenable` allows): per output to measure,
  a value that is finite only if all its elements are (`_finite_screen`), taken right after its op
  and returned, which inductor computes in the kernels producing the tensors: no output is kept
  for the statistics. All finite, the call's statistics are what the meter's screen gives a finite
  tensor; otherwise the call is counted again by the after-call variant (`recount`), which then
  runs in the graph's place.

- **After the call** (every measured output on the CPU, `meter.READ_NOW`, and within
  `AFTER_CALL_BYTES`): the outputs to measure become extra graph outputs and are measured when the
  call returns, by the eager meter (`torchlens.measure.meter`): on the CPU a one-sum screen for tracking,
  exact statistics from sums, the float outputs' reductions read to the host together
  (`Meter.measure_all`).
  The graph gains no reduction, so it compiles about as fast as plain and its own outputs are
  computed as plain `torch.compile` computes them; an output that a later in-place op of the graph
  would change is copied right after its op. The price is memory: those outputs live until the
  call returns (hence the budget).
- **Fused** (accelerators, or more bytes than the budget): the same vectors the eager meter reads
  once per forward (`torchlens.measure.recipes`) are traced into the graph right after each op's node and
  concatenated into one extra output, read once per graph call. Inductor fuses the reductions into
  the kernels that produce the tensors; the device is read once.

Fused into a graph a sample is not cheaper than the full reduction, so `value_stats="sampled"`
measures every element there and says so with `=`; measured after the call, it samples as eager does.
"""

from __future__ import annotations

import math
import operator
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union, cast

import torch
from torch import fx
from torch.fx.proxy import GraphAppendingTracer

from ..core.collectives import is_functional_collective, is_wait
from ..events import Stats, StatsGroup
from ..measure import meter
from ..measure.memory import node_writes, same_elements, storage_key, tensors_of
from ..measure.recipes import Recipe, not_applicable, recipe
from ..measure.stats import as_float, value_kind, vector_dtype
from ..measure.tracking import UNINITIALIZED
from ..measure.unwritten import UnwrittenMemory
from ..torch_internals.node_meta import example_value, plain_fake
from .plan import GraphPlan
from .recount import Recount, draws_random_numbers
from .replay import mutates_inputs, untouched_copy
from .values_pass import append_outputs

__all__ = ["StatsLayout", "add_stats_output", "measure_returned", "module_outputs", "read_screened", "read_stats",
           "screens_finite"]


class Slot(NamedTuple):
    """How one plan op is measured: a recipe per tensor output (fused), how many of its outputs
    the graph returns to be measured after the call (`returned`), or (`same_as`) the index of an
    earlier op whose statistics it shares (the same elements): of its output `part` when that op
    has several (the heads of one part of a split projection)."""

    recipes: Tuple[Recipe, ...] = ()
    same_as: Optional[int] = None
    returned: int = 0
    part: Optional[int] = None


# What a node's output was measured as: (its op's index, which of that op's tensor outputs or None).
Measured = Dict[fx.Node, Tuple[int, Optional[int]]]


# Per plan op: None (no statistics), else its `Slot`.
Slots = List[Optional[Slot]]


class StatsLayout(NamedTuple):
    """What a graph's extra statistics outputs are: one fused vector (the last output), or
    `returned` tensors measured after the call (the last `returned` outputs). A screened graph
    returns `returned` screens, one per measured output (`_finite_screen`): float64 sums, then
    `checked` bools; `recount` counts a call again that they do not show finite."""

    slots: Slots
    after_call: bool
    returned: int = 0
    recount: Optional[Recount] = None
    checked: int = 0

    def split(self, out):
        """(the graph's own outputs, what its statistics outputs hold)."""
        if self.after_call or self.recount is not None:
            return out[:len(out) - self.returned], tuple(out[len(out) - self.returned:])
        return out[:-1], out[-1]


# Outputs measured after the call live until it returns: at most this many bytes of them per call
# (static sizes, or dynamic ones' hints); past it the graph fuses its statistics instead.
AFTER_CALL_BYTES = 1 << 30


def module_outputs(plan: GraphPlan) -> List[int]:
    """Indices of the ops that end a module call: the last op before the graph leaves a module."""
    chosen = []
    for op, following in zip(plan.ops, plan.ops[1:] + [None]):
        leaving = following is None or following.modules[: len(op.modules)] != op.modules
        if op.modules and leaving:
            chosen.append(op.index)
    return chosen


def add_stats_output(gm: fx.GraphModule, plan: GraphPlan, rung: str, only=None,
                     recompile: Optional[Callable] = None) -> StatsLayout:
    """Make `gm` return what its ops' statistics need: the outputs themselves, measured after the
    call, when they are on the CPU and within the budget; else fused statistics vectors. With
    `recompile` (tracking alone: `compile(gm, example_inputs)` for the recount), a graph that
    `_screenable` allows returns a finiteness screen per output instead."""
    chosen = set(range(len(plan.ops)) if only is None else only)
    nodes = {node.name: node for node in gm.graph.nodes}
    held = [example_value(nodes[op.value]) for op in plan.ops if op.index in chosen]
    tensors = tensors_of(held)
    sizes = [_bytes(t) for t in tensors]
    known = [size for size in sizes if size is not None]  # (None: a size not known when compiling)
    on_host = all(t.device.type in meter.READ_NOW for t in tensors)
    if on_host and len(known) == len(sizes) and sum(known) <= AFTER_CALL_BYTES:
        if recompile is not None and _screenable(gm, plan, tensors):
            variant = untouched_copy(gm)
            slots, returned = _return_outputs(variant, plan, rung, chosen)
            recount = Recount(variant, StatsLayout(slots, True, returned), recompile)
            slots, screens, checked = _screen_outputs(gm, plan, rung, chosen)
            return StatsLayout(slots, False, screens, recount, checked)
        slots, returned = _return_outputs(gm, plan, rung, chosen)
        return StatsLayout(slots, True, returned)
    return StatsLayout(_fuse_stats(gm, plan, rung, chosen), False)


_SCREENED = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


def _screenable(gm: fx.GraphModule, plan: GraphPlan, tensors) -> bool:
    """Whether a tracked graph may return one finiteness screen per output (`_screen_outputs`): a call
    it does not show finite must be computed again as it was (`recount`). So its sizes are static, it has no
    collective, it writes into none of its inputs and draws no random numbers, and what it measures
    are plain real floats (the rest goes after the call, as the meter measures it). A graph whose
    ops carry an infinity or a NaN in a scalar argument (`masked_fill(mask, -inf)`) makes non-finite
    values on purpose, every call: it is measured after the call from the start."""
    if plan.resolver is not None or plan.exchanges or plan.written_inputs or mutates_inputs(gm):
        return False
    if any(_switches_state(node) for node in gm.graph.nodes):
        return False
    if any(op.reads[1] for op in plan.ops):  # (the kinds its scalar arguments carry: `carried_kinds`)
        return False
    for tensor in tensors:
        kind = value_kind(tensor.dtype)
        if not plain_fake(tensor) or tensor.layout != torch.strided or kind is None or (
                kind == "float" and tensor.dtype not in _SCREENED):
            return False  # (a subclass, a DTensor among them, is measured as the meter measures it)
    return not draws_random_numbers(untouched_copy(gm))


def _switches_state(node: fx.Node) -> bool:
    """Whether a node does more than compute: torch's own rule (`Node.is_impure`: a grad-mode or
    autocast switch, an assert, a write, a random draw by name) or a switch of `torch.autograd`'s
    grad modes (inference mode). A second run must start from where the first did, and the check
    for random draws runs the graph, which must leave no mode switched."""
    if node.op != "call_function":
        return False
    return node.is_impure() or getattr(node.target, "__module__", None) == "torch.autograd.grad_mode"


def _screen_outputs(gm: fx.GraphModule, plan: GraphPlan, rung: str, chosen) -> Tuple[Slots, int, int]:
    """Append to `gm`'s outputs, for each of the chosen ops' float outputs, its screen
    (`_finite_screen`), taken right after its op, which inductor computes in the kernel that
    produces the tensor where it can: tracking's screen (`recipes.screened`) inside the graph.
    Returned one by one, the sums first, then the bools, they are read together after the call:
    one vector made inside would be one more kernel of hundreds of inputs to compile. Returns the
    slots, how many screens there are and how many of them are bools."""
    graph = gm.graph
    slots: Slots = [None] * len(plan.ops)
    screens: List[fx.Node] = []
    checks: List[fx.Node] = []  # (a float64 output's)
    measured: Measured = {}
    for op, node, holder, value in _ops_to_measure(gm, plan, rung, chosen, slots, measured):
        with graph.inserting_before(node.next):
            outputs = [(holder, value)] if isinstance(value, torch.Tensor) else [
                (graph.call_function(operator.getitem, (holder, i)), t)
                for i, t in enumerate(value) if isinstance(t, torch.Tensor)]
            recipes = []
            for output, fake in outputs:
                recipes.append(_screen_recipe(fake, rung))
                if recipes[-1].measures:
                    (checks if fake.dtype == torch.float64 else screens).append(_finite_screen(graph, output, fake))
        slots[op.index] = Slot(tuple(recipes))
        _note_measured(measured, op.index, node, holder, value, [r.measures for r in recipes])
    append_outputs(gm, screens + checks)
    return slots, len(screens) + len(checks), len(checks)


def _finite_screen(graph: fx.Graph, output: fx.Node, fake: torch.Tensor) -> fx.Node:
    """A node whose value is finite only if every element of `output` is: its sum in float64 for a
    narrower float, which no finite values can overflow (float32's largest times any element count
    is far inside float64's range), while a NaN or an infinity makes it non-finite; for a float64
    tensor, whose finite values could overflow it (a `finfo.min` mask would make every call run
    twice), whether all its elements are finite, a bool. The sum is the cheaper of the two for
    inductor to compile (1.2-1.35x plain's cold compile, against 1.4-1.65x for `isfinite(x).all()`
    on resnet18 and GPT-2) and costs the same per call. Never a sum of `x * 0` (cannot overflow
    either), which inductor folds to zero, NaN or not."""
    if fake.dtype == torch.float64:
        return graph.call_function(torch.all, (graph.call_function(torch.isfinite, (output,)),))
    return graph.call_function(torch.sum, (output,), {"dtype": torch.float64})


def screens_finite(screens: tuple, checked: int) -> bool:
    """Whether a screened graph call's screens (`_finite_screen`, one per measured output: float64
    sums, then `checked` bools) show every output finite, read to the host at once: the sums added
    up (finite: none can overflow that total) and the bools all true."""
    sums = len(screens) - checked
    if checked and not bool(torch.stack(screens[sums:]).all()):
        return False
    return not sums or math.isfinite(torch.stack(screens[:sums]).sum().item())


def _screen_recipe(fake: torch.Tensor, rung: str) -> Recipe:
    """What the meter's screen measures of such a tensor after the call: whether it is finite,
    nothing of an integer or a bool, "n/a" of an empty one."""
    kind = value_kind(fake.dtype)
    if kind is None:
        return not_applicable(str(fake.dtype).replace("torch.", ""), rung)
    if kind == "float" and fake.numel() == 0:
        return not_applicable("empty", rung)
    return recipe(kind, rung, immediate=True)


def read_screened(slots: Slots, numels, failed: Optional[str] = None) -> List:
    """The statistics of a screened call whose screens all said finite: a `Stats` (or `StatsGroup`)
    per op, as the meter's screen fills them when it finds a tensor finite; or, when it could not
    be counted again (`failed` says why), "n/a" for what was to be measured."""
    def part(recipe_: Recipe, numel) -> Stats:
        if recipe_.measures and failed is not None:
            return not_applicable(failed, "reuse" if recipe_.shown else "off").stats(numel)
        stats = recipe_.stats(numel)
        if recipe_.measures:
            stats.nan = stats.posinf = stats.neginf = 0
        return stats

    return _per_op(slots, numels, part)


def _bytes(fake: torch.Tensor) -> Optional[int]:
    """The bytes a tensor of the graph will hold (a dynamic size by its hint), None if unknown."""
    numel = fake.numel()
    if not isinstance(numel, int):
        numel = getattr(getattr(numel, "node", None), "hint", None)
    return None if numel is None else int(numel) * fake.element_size()


def _measured(fake: torch.Tensor, rung: str) -> bool:
    """Whether the meter reads anything of such a tensor (tracking alone skips integers and bools)."""
    kind = value_kind(fake.dtype)
    return kind is None or recipe(kind, rung, immediate=True).measures


def _ops_to_measure(gm: fx.GraphModule, plan: GraphPlan, rung: str, chosen, slots: Slots, measured: dict):
    """The chosen ops that need a measurement of their own, as (op, its node, the node holding its
    output, that output's fake value). Ops that share an earlier op's statistics (a view of the same
    elements, nothing written between) and ops whose output holds no values yet get their slot here.
    `measured` maps each node measured so far to its op's index; callers add to it."""
    nodes = {node.name: node for node in gm.graph.nodes}
    unwritten = UnwrittenMemory()  # the eager rule, on the graph's fake tensors (`torchlens.measure.unwritten`)
    for op in plan.ops:
        node, holder = nodes[op.node], nodes[op.value]
        _follow_memory(unwritten, op.op, node, holder)
        if op.index not in chosen:
            continue
        source = _same_elements_as(node, measured)
        note = unwritten.unwritten(example_value(holder)) if unwritten else None
        if note is not None:
            slots[op.index] = Slot((not_applicable(note, rung),) * len(op.metas))
        elif source is not None:
            slots[op.index] = Slot(same_as=source[0], part=source[1])
            measured[node] = source  # a chain of views shares one measurement
        elif op.op.startswith(UNINITIALIZED):  # `empty` and friends: nothing written to measure yet
            slots[op.index] = Slot((not_applicable("uninitialized", rung),) * len(op.metas))
        else:
            yield op, node, holder, example_value(holder)


def _follow_memory(unwritten: UnwrittenMemory, name: str, node: fx.Node, holder: fx.Node) -> None:
    """What an uninitialized op of the graph allocated, what a functional collective will write
    (nothing is there until its `wait_tensor`), and what later nodes wrote into either."""
    if name.startswith(UNINITIALIZED):
        unwritten.allocated(example_value(holder))
    elif is_functional_collective(node.target):
        unwritten.in_flight(tensors_of(example_value(holder)))
    elif unwritten and is_wait(node.target) and node.args:
        unwritten.landed(tensors_of(_fake(node.args[0])))
    elif unwritten and (written := node_writes(node)):
        unwritten.wrote(tensors_of(fx.node.map_arg(written, _fake)))


def _fake(argument):
    """A node argument as the fake value dynamo recorded for it (other arguments as they are)."""
    return example_value(argument) if isinstance(argument, fx.Node) else argument


def _return_outputs(gm: fx.GraphModule, plan: GraphPlan, rung: str, chosen) -> Tuple[Slots, int]:
    """Append the chosen ops' tensor outputs to the graph's outputs (a copy taken right after the op
    where a later in-place op of the graph could change it); views of an output measured just
    before share its statistics and return nothing."""
    graph = gm.graph
    slots: Slots = [None] * len(plan.ops)
    returned: List[fx.Node] = []
    measured: Measured = {}
    inputs = {storage_key(example_value(node)) for node in graph.nodes
              if node.op == "placeholder" and isinstance(example_value(node), torch.Tensor)}
    for op, node, holder, value in _ops_to_measure(gm, plan, rung, chosen, slots, measured):
        if isinstance(value, torch.Tensor) and not _measured(value, rung):
            slots[op.index] = Slot((recipe(value_kind(value.dtype), rung),))  # nothing to read
            continue
        copy = _written_later(node, value, inputs)
        with graph.inserting_before(node.next):
            if isinstance(value, torch.Tensor):
                outputs = [graph.call_function(torch.clone, (holder,)) if copy else holder]
            else:
                parts = [graph.call_function(operator.getitem, (holder, i))
                         for i, t in enumerate(value) if isinstance(t, torch.Tensor)]
                outputs = [graph.call_function(torch.clone, (part,)) for part in parts] if copy else parts
        returned.extend(outputs)
        slots[op.index] = Slot(returned=len(outputs))
        _note_measured(measured, op.index, node, holder, value, [True] * len(outputs))
    append_outputs(gm, returned)
    return slots, len(returned)


def _written_later(node: fx.Node, value, inputs: set) -> bool:
    """Whether a node after `node` may write into the memory of what `node` produced (then it is
    copied before it is returned: it must be measured as the op left it). Aliasing is read from
    the fake tensors dynamo recorded; a write whose target cannot be told (an opaque module call,
    no recorded value) counts, and so does any write into a graph input when `node`'s output is
    one of them or a view of one: inputs may alias each other in a later call without a recompile.
    `inputs` holds the storages of the graph's inputs."""
    mine = {storage_key(t) for t in tensors_of(value)}
    later = node.next
    while later.op != "output":
        if _may_mutate(later):
            targets = _targets(later)
            if None in mine or None in targets or targets & mine:
                return True
            if mine & inputs and targets & inputs:
                return True
        later = later.next
    return False


def _targets(node: fx.Node) -> set:
    """The storages a writing node may write (`memory.node_writes`), with None among them when one
    is not known: an opaque module call may write anything, an argument may have no recorded value."""
    if node.op == "call_module":
        return {None}
    storages: Set[Optional[int]] = set()
    written: List[fx.Node] = []
    fx.node.map_arg(node_writes(node), written.append)
    for argument in written:
        tensors = tensors_of(example_value(argument))
        storages.update(map(storage_key, tensors) if tensors else (None,))
    return storages or {None}


def _fuse_stats(gm: fx.GraphModule, plan: GraphPlan, rung: str, chosen) -> Slots:
    """Trace statistics nodes into `gm` and append their concatenation to the graph's outputs."""
    graph = gm.graph
    tracer = GraphAppendingTracer(graph)
    slots: Slots = [None] * len(plan.ops)
    vectors, devices = [], []
    measured: Measured = {}
    for op, node, holder, value in _ops_to_measure(gm, plan, rung, chosen, slots, measured):
        with graph.inserting_before(node.next):
            proxy = fx.Proxy(holder, tracer)
            outputs = [(proxy, value)] if isinstance(value, torch.Tensor) else [
                # (Proxy's operators are set on the class when torch.fx.proxy is imported: its stubs lack them)
                (proxy[i], t) for i, t in enumerate(value) if isinstance(t, torch.Tensor)]  # type: ignore[index]
            recipes = []
            for output, fake in outputs:
                recipe_, vector = _vector_for(output, fake, rung)
                recipes.append(recipe_)
                if vector is not None:
                    vectors.append(vector.reshape(-1))
                    devices.append(fake.device)
        slots[op.index] = Slot(tuple(recipes))
        _note_measured(measured, op.index, node, holder, value, [r.measures and not r.padded for r in recipes])
    output_node = next(node for node in reversed(graph.nodes) if node.op == "output")
    with graph.inserting_before(output_node):
        if vectors:
            # One vector, on the device most of them are on (a few stray ones, such as a CPU
            # `arange` in a CUDA model, are moved): one read per graph call.
            home = max(set(devices), key=devices.count)
            # (a torch function called on proxies returns a proxy: its __torch_function__ traces it)
            stacked = cast(fx.Proxy, torch.cat([v if d == home else v.to(home) for v, d in zip(vectors, devices)]))
        else:
            stacked = fx.Proxy(graph.call_function(torch.zeros, (0,)), tracer)
    append_outputs(gm, [stacked.node])
    return slots


def _note_measured(measured: Measured, index: int, node: fx.Node, holder: fx.Node, value, shareable) -> None:
    """Note what op `index` measured, for views of it to share (`_same_elements_as`): its output,
    or each of its tensor outputs as the graph's own `getitem` nodes take them out (a split
    projection's parts, whose heads are views of them). `shareable`: per tensor output, whether
    its statistics may stand for a view's."""
    if isinstance(value, torch.Tensor):
        if holder is node and shareable[0]:
            measured[node] = (index, None)
        return
    positions: Dict[int, int] = {}  # output index -> its position among the tensor outputs (`StatsGroup.parts`)
    for i, item in enumerate(value):
        if isinstance(item, torch.Tensor):
            positions[i] = len(positions)
    for user in holder.users:
        taken = user.args[1] if user.op == "call_function" and user.target is operator.getitem else None
        position = positions.get(taken) if isinstance(taken, int) else None  # (not a slice of them)
        if position is not None and shareable[position] and not _written_between(holder, user):
            measured[user] = (index, position)


def _written_between(first: fx.Node, last: fx.Node) -> bool:
    """Whether a node after `first`, up to `last` included, may write into an existing tensor."""
    between = first.next
    while between is not last.next:
        if _may_mutate(between):
            return True
        between = between.next
    return False


def _same_elements_as(node: fx.Node, measured: Measured) -> Optional[Tuple[int, Optional[int]]]:
    """The op index (and output) whose statistics `node`'s output shares, or None.

    A node whose output addresses the same elements as its first argument, measured just before
    (`memory.same_elements`, read from the fake tensors dynamo recorded: views, transposes, the
    heads of a split projection, `contiguous` of what already is), holds the same values, so the
    same statistics: they are read once, not reduced again (about half of a transformer's ops), as
    the eager meter shares them. Only when nothing in between may have changed the tensor in
    place, the node included (`memory.node_writes`: what the eager meter's version counter tells).
    """
    if not node.args or not isinstance(node.args[0], fx.Node) or node.args[0] not in measured:
        return None
    source = node.args[0]
    before = example_value(source)
    value = before if _returns_its_input(node) else example_value(node)
    if not isinstance(value, torch.Tensor) or not isinstance(before, torch.Tensor):
        return None
    if not same_elements(value, before):
        return None
    if _written_between(source, node):  # the node itself included: `relu_` addresses what it wrote
        return None
    return measured[source]


def _returns_its_input(node: fx.Node) -> bool:
    """Whether the node returns its input itself when run eagerly: eval-mode dropout (torch's
    `dropout` hands back its argument when not training), whose fake output dynamo recorded as a
    new tensor."""
    if node.op != "call_function" or node.target is not torch.nn.functional.dropout:
        return False
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", True)
    return training is False


def _may_mutate(node: fx.Node) -> bool:
    """Whether a node may write into an existing tensor: one that writes an argument
    (`memory.node_writes`), or an opaque module call."""
    return node.op == "call_module" or bool(node_writes(node))


def _vector_for(output, fake: torch.Tensor, rung: str):
    """(recipe, vector proxy or None) for one tensor output (see `torchlens.measure.recipes`)."""
    if fake.layout != torch.strided:
        return not_applicable(str(fake.layout).replace("torch.", ""), rung), None
    kind = value_kind(fake.dtype)
    if kind is None:
        return not_applicable(str(fake.dtype).replace("torch.", ""), rung), None
    numel = fake.numel()
    if isinstance(numel, int) and numel == 0:
        return not_applicable("empty", rung), None
    chosen = recipe(kind, rung, numel_known=isinstance(numel, int), in_graph=True)
    if not chosen.measures:
        return chosen, None
    dtype = vector_dtype(fake.device)
    values = output if kind != "float" else as_float(output, fake.dtype)  # bools and integers as they are
    return chosen, chosen.build(values, dtype, numel, fake.dim(), fake.dtype)


def measure_returned(slots: Slots, tensors: Sequence[torch.Tensor], measurer, numels) -> List:
    """Measure the outputs a graph call returned for it (see `StatsLayout`): a `Stats`, a
    `StatsGroup` or None per plan op; `numels[i]` are the element counts of op i's outputs."""
    measured = measurer.measure_all(tensors)  # (read to the host together)
    position = 0
    result: List[Optional[Union[Stats, StatsGroup]]] = []
    for slot, counts in zip(slots, numels):
        if slot is None:
            result.append(None)
        elif slot.same_as is not None:
            result.append(_shared(result, slot))  # the same elements, measured once
        elif not slot.returned:
            parts = [recipe_.stats(numel) for recipe_, numel in zip(slot.recipes, counts)]
            result.append(parts[0] if len(parts) == 1 else StatsGroup(parts))
        else:
            mine = measured[position:position + slot.returned]
            position += slot.returned
            result.append(mine[0] if len(mine) == 1 else StatsGroup(mine))
    return result


def read_stats(slots: Slots, values: Sequence[float], tracking: bool, numels) -> List:
    """Turn one graph call's fused statistics (read to the host) into a `Stats`, a `StatsGroup` or
    None per plan op; `numels[i]` are the element counts of op i's outputs in this call."""
    position = 0

    def part(recipe_: Recipe, numel) -> Stats:
        nonlocal position
        stats = recipe_.stats(numel)
        if recipe_.measures:
            recipe_.read(stats, values[position:position + recipe_.size], tracking)
            position += recipe_.size
        return stats

    return _per_op(slots, numels, part)


def _per_op(slots: Slots, numels, part: Callable[[Recipe, Optional[int]], Stats]) -> List:
    """A `Stats`, a `StatsGroup` or None per plan op, from its slot: None without one, an earlier
    op's for one that shares its elements (read once), else `part(recipe, numel)` per output, in
    order; `numels[i]` are the element counts of op i's outputs in this call."""
    result: List[Optional[Union[Stats, StatsGroup]]] = []
    for slot, counts in zip(slots, numels):
        if slot is None:
            result.append(None)
        elif slot.same_as is not None:
            result.append(_shared(result, slot))
        else:
            parts = [part(recipe_, numel) for recipe_, numel in zip(slot.recipes, counts)]
            result.append(parts[0] if len(parts) == 1 else StatsGroup(parts))
    return result


def _shared(result: List, slot: Slot):
    """The statistics an op sharing an earlier op's elements (`Slot.same_as`) shows."""
    assert slot.same_as is not None
    shared = result[slot.same_as]
    return shared.parts[slot.part] if slot.part is not None and isinstance(shared, StatsGroup) else shared
