"""Config: schema (dataclasses), Hydra composition from a file path, validation."""
from launcher.config.compose import compose_example, ConfigError  # noqa: F401
