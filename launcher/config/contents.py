"""What the config names, read and checked before anything starts (no torch, bounded).

Each check lives beside the code that reads the file for real, and reads it the same way:

* ``stages.mmlu.dataset`` / ``dev_dataset``  -> ``launcher.mmlu.data.check_contents``
* ``stages.quantize.calib.dataset``          -> ``launcher.quant.calibration.check_contents``
* ``recipe.recipe_path``                     -> ``launcher.quant.recipe_yaml`` (called with the recipe's checks)
* ``model.path``/config.json                 -> ``launcher.hf_config.config_json_problems`` (with the card's)

``content_problems(cfg, reported)`` runs the first two for the enabled stages whose keys passed
the schema's rules; one line per problem, each naming the key, the file and its line or record.
"""
from __future__ import annotations

from omegaconf import DictConfig


def content_problems(cfg: DictConfig, reported: set[str]) -> list[str]:
    """One line per problem in the files; ``reported``: keys whose values are refused already."""
    out: list[str] = []
    q, m = cfg.stages.quantize, cfg.stages.mmlu
    calib = ("stages.quantize.calib.dataset", "stages.quantize.calib.size", "stages.quantize.calib.text_key")
    if q.enabled and cfg.recipe.format != "none" and not reported.intersection(calib):
        from launcher.quant.calibration import check_contents

        out += check_contents(q.calib.dataset, q.calib.size, q.calib.text_key)
    if m.enabled and not reported.intersection(("stages.mmlu.dataset", "stages.mmlu.dev_dataset",
                                                 "stages.mmlu.fraction", "stages.mmlu.few_shots")):
        from launcher.mmlu.data import check_contents as check_mmlu

        out += check_mmlu(m.dataset, m.dev_dataset, m.fraction, m.few_shots)
    return out
