"""Config services: Hydra composition from a file path (compose), validation (validate, contents),
the model card derived from config.json (hf_card)."""
from launcher.config.compose import compose_example, ConfigError  # noqa: F401
