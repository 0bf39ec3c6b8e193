"""The code behind the benchmark scripts (``scripts/bench_*.py``): ours beside an open_clip
model, ABBA-interleaved (``versus``), cost against image size (``resolution``) and a
call's FLOPs counted on fake tensors (``flops``). A user of the model imports none of it."""
