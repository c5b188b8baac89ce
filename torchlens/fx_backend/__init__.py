"""The compiled substrate: `torch.compile(model, backend="torchlens")`.

At compile time each FX graph dynamo captured is read into a narration plan (`plan.py`); at run
time each graph call records and narrates its plan, and the eager substrate's capture mode covers
what runs between graphs (`gaps.py`). One forward of the compiled model is one run (`runtime.py`),
with one ordinal sequence across graphs. What relies on dynamo internals is in `dynamo_seams.py`.

The seam with the eager substrate is small: `CaptureMode` and `remove_mode` from
`eager.capture`, and the argument/output naming of `eager.structure`.
"""
