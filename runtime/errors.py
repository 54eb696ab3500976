"""The project's error types.

Every user-facing failure (bad path, unsupported architecture, corrupt bundle, over-long prompt,
missing GPU...) is raised as a :class:`SpecDeployError` carrying one clear sentence. The CLI prints
those without a traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class SpecDeployError(Exception):
    """Base class of every error a user can cause and fix."""


class ModelSourceError(SpecDeployError):
    """The model path is missing, unreadable or not a supported model."""


class UnsupportedArchitectureError(ModelSourceError):
    """The model's architecture is not one the exporter supports."""


class BundleError(SpecDeployError):
    """A bundle is missing, corrupt, from a newer schema or does not match its files."""


class BundleExistsError(BundleError):
    """The output bundle already exists and --force was not given."""


class ValidationFailed(SpecDeployError):
    """Numerical validation of an exported graph failed (all failures are listed)."""


class PromptError(SpecDeployError):
    """The prompt is empty or longer than the bundle's maximum context."""


class TreeSpecError(SpecDeployError):
    """A draft tree specification is invalid for this bundle."""


class DraftMismatchError(SpecDeployError):
    """A draft (or drafter) does not match the base model or bundle it is used with."""


class BackendUnavailableError(SpecDeployError):
    """The requested backend needs hardware or packages that are not present (GPU, TensorRT...)."""


class TrainingError(SpecDeployError):
    """A training run cannot start or resume (missing data, corrupt checkpoint...)."""


class StepPlanError(SpecDeployError):
    """A step plan was asked for that this backend has not, or that is not exact on this machine."""


class ExactnessWarning(UserWarning):
    """Speculation was asked for, but no step plan is bitwise exact here: the engine decodes plainly."""
