"""The deployment simulator (``sangam-bench sim``): the engine's scheduling and placement
policies over a cost model's forwards. ``steps`` draws the tokens each forward commits,
``config`` describes a deployment, ``simulator`` runs a trace through it, ``runs`` makes one
run from the command line's flags and ``cli`` is the subcommand (it imports the experiments;
this package's names do not import it)."""

from sangam.bench.sim.config import SimConfig
from sangam.bench.sim.simulator import SimResult, Simulator, simulate
from sangam.bench.sim.steps import (
    FixedSteps,
    GeometricSteps,
    ModeProfile,
    ProfileSteps,
    StepModel,
    ThresholdSteps,
    load_mode_profiles,
    load_step_profile,
)

__all__ = ["FixedSteps", "GeometricSteps", "ModeProfile", "ProfileSteps", "SimConfig",
           "SimResult", "Simulator", "StepModel", "ThresholdSteps", "load_mode_profiles",
           "load_step_profile", "simulate"]
