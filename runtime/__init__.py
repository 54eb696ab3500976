"""The lean specdeploy runtime: numpy, onnxruntime, tokenizers and jinja2 only (no torch, no transformers).

    from specdeploy.runtime import load
    engine = load("bundle", draft="prompt-lookup")
"""

from .engine import Completion, Engine, TextStream, load
from .errors import ExactnessWarning, SpecDeployError
from .plan import StepPlan

__all__ = ["Completion", "Engine", "ExactnessWarning", "SpecDeployError", "StepPlan", "TextStream", "load"]
