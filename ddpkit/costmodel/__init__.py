"""A cost model of data-parallel training: alpha-beta collectives plus a simulated backward pass.

    profile = costmodel.profile_model(module, x, y)            # one rank's compute (measure.py)
    costmodel.simulate(name, profile, 64, "100GbE")            # one step predicted (simulate.py)
    costmodel.predict(profile, world_sizes=(8, 64, 256))       # every strategy x world size
    cluster.run(costmodel.wrapper_job, runs)                   # each wrapper's own host work, alone

A collective's cost is ``ddpkit.network``'s; ``measure_collectives`` and ``fit_link`` fit this
machine's; ``python -m ddpkit predict [--validate]`` prints predictions (beside measured steps).
"""
from ddpkit.costmodel.measure import (
    CALIBRATION_SIZES, calibration_sizes, fit_link, format_fit, measure_all_reduce, measure_collectives,
    median_profile, model_calibration_sizes, profile_for, profile_job, profile_model, slowest_profile,
    slowest_rank, wrapper_job,
)
from ddpkit.costmodel.simulate import (
    Layer, MiB, Prediction, Profile, assign_buckets, format_predictions, predict, simulate,
    uniform_profile,
)

__all__ = [
    "MiB",
    "assign_buckets", "Layer", "Profile", "uniform_profile", "Prediction", "simulate", "predict",
    "format_predictions", "profile_model", "profile_job", "profile_for", "slowest_profile",
    "median_profile", "CALIBRATION_SIZES", "calibration_sizes", "model_calibration_sizes",
    "measure_collectives", "measure_all_reduce", "fit_link", "slowest_rank", "format_fit", "wrapper_job",
]
