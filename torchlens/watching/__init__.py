"""`tl.watch`: an always-on training watch, and the exact replay of the step that failed.

- `checks`: the cheap screen a healthy step pays for;
- `steps`: what a step keeps (references) so that it can be replayed;
- `roots`: the tensor each backward starts from (a loss computed outside the model);
- `updates`: what each optimizer update wrote into the parameters;
- `agreement`: the ranks agreeing on a verdict, under a process group;
- `replay`: the replay under tracking, the user's state put back around it, and the replays a fault gets;
- `spikes`: when a finite loss or gradients' norm is a spike (`SpikeRule`), and the `Spike` caught;
- `explain`: a spike replayed on its batch and the previous one: the batch or the weights, and where;
- `judging`: a step's screens read, an alarm confirmed, the fault described and replayed;
- `faults`: `Fault`, and what a fault leaves on disk;
- `options`: what `tl.watch` takes, checked;
- `watch`: the hooks, where a step ends, and the policy (`on_fault=`);
- `callbacks`: thin adapters for transformers' `Trainer` and PyTorch Lightning.
"""

from .faults import Fault
from .spikes import Spike, SpikeRule
from .watch import Watch, watch

__all__ = ["Fault", "Spike", "SpikeRule", "Watch", "watch"]
