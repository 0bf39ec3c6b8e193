"""Memory planner: what a training step or inference of RWKV-CLIP needs, per GPU.

:mod:`.walk` (parameters and saved tensors), :mod:`.estimate` (the peak and the largest
batch per card), :mod:`.measure` (one real step's peak), :mod:`.cli` (the command line,
docs/training.md). The estimate is analytic: nothing is fitted to a measurement.
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
