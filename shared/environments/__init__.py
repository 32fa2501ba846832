"""Conveyor's environment API: the protocol every environment implements, its errors, and the
registry that intake and the rollout workers resolve environment names through
(``protocol`` and ``registry`` state the invariants)."""

from shared.environments.protocol import (AgentAction, AgentDrivenEnvironment, ArtifactWriter, EnvConfig, Environment, EnvironmentConfigError,
                                          EnvironmentError_, EnvironmentUnavailable, RowRejected, SandboxedEnvironment,
                                          StepResult, VerifyResult, validate_config)
from shared.environments.registry import ENTRY_POINT_GROUP, EnvironmentRegistry, check_startup, registry_for

__all__ = ["AgentAction", "AgentDrivenEnvironment", "ArtifactWriter", "ENTRY_POINT_GROUP", "EnvConfig", "Environment", "EnvironmentConfigError", "EnvironmentError_",
           "EnvironmentRegistry", "EnvironmentUnavailable", "RowRejected", "SandboxedEnvironment", "StepResult", "VerifyResult",
           "check_startup", "registry_for", "validate_config"]
