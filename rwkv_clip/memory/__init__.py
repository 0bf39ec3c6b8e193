"""Memory planner: what a training step or inference of RWKV-CLIP needs, per GPU.

    python -m rwkv_clip.memory --config model_config/RWKV_CLIP_B32.json --batch-size 256 \
        --precision bf16 [--checkpointing] [--gradient-acc K] [--gpus N] [--measure] [--json]

Four parts:

* :mod:`.walk`: the parameters (read from the model built on the meta device) and, op by
  op, the tensors autograd saves for backward, in the dtypes autocast gives them;
* :mod:`.estimate`: the peak of a steady-state training step (backward replayed segment by
  segment) or of inference, and the largest batch per card;
* :mod:`.measure`: one real step (the trainer's ``train_step``, optimizer, scaler and
  clipping) in a fresh process, and its measured peak;
* :mod:`.cli`: the command line.

The estimate is analytic, nothing is fitted to a measurement; ``--measure`` prints the
measured peak beside it.
"""
from ..errors import MeasurementError
from .estimate import (
    CARDS,
    Estimate,
    card_capacity,
    estimate,
    inference_peak,
    max_batch,
    training_peak,
)
from .measure import (
    MeasureSpec,
    PeakRSS,
    build_measured_model,
    make_step,
    measure,
    rss_kib,
    run_measurement,
    synthetic_batch,
)
from .params import ParamTable
from .walk import Plan, Segment, activation_segments, parameter_table

__all__ = ["CARDS", "Estimate", "card_capacity", "estimate", "inference_peak", "max_batch",
           "training_peak", "MeasurementError", "MeasureSpec", "PeakRSS", "build_measured_model",
           "make_step", "measure", "rss_kib", "run_measurement", "synthetic_batch",
           "ParamTable", "Plan", "Segment", "activation_segments", "parameter_table"]
