"""How long `tl.debug.bisect` takes on a transformers GPT-2, and what it names.

    python benchmarks/bisect_bench.py                 # GPT-2, 2 layers, 768 wide (GPT-2 small's width)
    python benchmarks/bisect_bench.py --quick         # 2 layers, 64 wide: proves the script works
    python benchmarks/bisect_bench.py --json out.json

Two cases on the same model, random weights, one batch of token ids:

- **rounding**: nothing planted. Inductor's fused kernels sum in other orders than eager's, so its
  values differ from eager's; judged against float64 every difference is rounding, and bisect says
  so after one compiled run (the cost of a reference, an eager trace and one compile).
- **planted**: inductor's decomposition of `addmm` is replaced, for the test only, by one that is
  wrong for the MLP's input projection alone (outputs 4x the model's width: `c_fc`), by 1 part in
  100 — the shape-specific kind of compiler bug that survives a test suite. Bisect must name
  `aot_eager_decomp_partition`, subsystem "decomposition", the application of `addmm` at
  `transformer.h.0.mlp.c_fc`.

Times are wall-clock seconds on this machine, inductor's on-disk caches off (`force_disable_caches`)
so that every compile is a cold one, as a first bisection would be.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

import torchlens as tl


def gpt2(quick: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    width = 64 if quick else 768
    config = GPT2Config(n_layer=2, n_embd=width, n_head=4 if quick else 12, vocab_size=1000, n_positions=64,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval(), torch.randint(0, 1000, (1, 16)), width


@contextlib.contextmanager
def wrong_addmm_for_width(width: int):
    """addmm decomposed wrongly (x1.01) where the output is `width` wide; right elsewhere."""
    from torch._inductor.decomposition import decompositions, fast_random_decomps

    aten = torch.ops.aten
    original = decompositions[aten.addmm.default]

    def addmm(bias, mat1, mat2, beta=1, alpha=1):
        out = beta * bias + alpha * (mat1 @ mat2)
        return out * 1.01 if mat2.shape[-1] == width else out

    decompositions[aten.addmm.default] = addmm
    fast_random_decomps.cache_clear()
    torch._dynamo.reset()
    try:
        yield
    finally:
        decompositions[aten.addmm.default] = original
        fast_random_decomps.cache_clear()
        torch._dynamo.reset()


def run_case(name: str, model, ids) -> dict:
    torch._dynamo.reset()
    started = time.perf_counter()
    with torch.no_grad():
        report = tl.debug.bisect(model, ids)
    seconds = time.perf_counter() - started
    row = report.row
    result = {"case": name, "seconds": round(seconds, 1), "verdict": report.verdict, "runs": report.runs,
              "backend": report.backend, "subsystem": report.subsystem, "application": report.application,
              "op": row.op if row is not None else None, "module": row.module if row is not None else None,
              "report": str(report)}
    print(f"{name}: {seconds:.0f} s, {report.runs} compiled runs\n  {report}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 64-wide GPT-2: proves the script works")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    from torch._inductor import config

    model, ids, width = gpt2(args.quick)
    results = []
    with config.patch(force_disable_caches=True):
        results.append(run_case("rounding", model, ids))
        with wrong_addmm_for_width(4 * width):
            results.append(run_case("planted", model, ids))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"quick": args.quick, "width": width, "torch": torch.__version__, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
