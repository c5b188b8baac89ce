"""The compiled substrate: `torch.compile(model, backend="torchlens")`.

At compile time each FX graph dynamo captured is read into a narration plan (`plan.py`); at run
time each graph call records and narrates its plan, and the eager substrate's capture mode covers
what runs between graphs (`gaps.py`). One forward of the compiled model is one run (`runtime.py`),
with one ordinal sequence across graphs. A failed graph is located by replay, or in live mode from
its own frame (`replay.py`, `failures.py`). What relies on dynamo's runtime structures is in
`dynamo_seams.py`; its `nn_module_stack` node metadata is read in `module_stack.py`.

The seam with the eager substrate: the capture mode and its reporting (`CaptureMode`,
`OpReporter` from `eager.capture`), and `eager.runner.run_eager`, with which a forward dynamo
failed to trace is run again eagerly to find the failing op. Argument and output naming and the
selection checks are core (`torchlens.core.structure`), shared by both.
"""
