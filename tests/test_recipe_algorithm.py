"""`declared_algorithm` (read from YAML, no torch: what `launch validate` uses for the awq-at-EP
rule) agrees with the algorithm of the config ModelOpt itself resolves, for every named ModelOpt
config it can read and every built-in PTQ recipe."""
import os

import pytest

from launcher.schema import RecipeConfig
from launcher.quant.recipes import (
    EP_UNSAFE_ALGORITHMS, _load_named, _load_recipe_yaml, calibration_algorithm, declared_algorithm,
    named_modelopt_configs)

pytestmark = pytest.mark.torch   # compares with the configs ModelOpt itself resolves


def test_declared_algorithm_of_named_configs_agrees_with_modelopt():
    read = 0
    for name in named_modelopt_configs():
        known, algorithm = declared_algorithm(RecipeConfig(format="nvfp4", modelopt_cfg=name))
        real = calibration_algorithm(_load_named(name))
        if real in EP_UNSAFE_ALGORITHMS:
            assert known, f"{name} calibrates with {real} but validate cannot read it"
        if known:
            assert algorithm == real, name
            read += 1
    assert read >= 20   # 29 of 38 in ModelOpt 0.47 (the others have no preset of the same name)


def test_declared_algorithm_of_builtin_recipes_agrees_with_modelopt():
    import modelopt_recipes

    root = os.path.join(os.path.dirname(modelopt_recipes.__file__), "general", "ptq")
    names = sorted(f[:-5] for f in os.listdir(root) if f.endswith(".yaml"))
    assert names
    for name in names:
        path = f"general/ptq/{name}"
        known, algorithm = declared_algorithm(RecipeConfig(format="nvfp4", recipe_path=path))
        assert known, path
        assert algorithm == calibration_algorithm(_load_recipe_yaml(path)), path


def test_declared_algorithm_of_a_local_recipe_file(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("metadata: {recipe_type: ptq}\nquantize:\n  algorithm: {method: awq_lite}\n  quant_cfg: []\n")
    assert declared_algorithm(RecipeConfig(format="nvfp4", recipe_path=str(f))) == (True, "awq_lite")
    assert declared_algorithm(RecipeConfig(format="none")) == (True, None)
    assert declared_algorithm(RecipeConfig(format="fp8", modelopt_cfg="NO_SUCH_CFG")) == (False, None)
