"""Test and benchmark support, not the product (``launcher`` never imports it):

* ``tiny`` - the tiny models the project trains itself (``python -m launcher_testing.tiny``);
* ``models`` - real checkpoints built from registry artefacts (``python -m launcher_testing.models smollm2``);
* ``ranks`` - ``run_on_ranks``: a function on N gloo ranks as subprocesses, with a timeout (on the
  session's rank pool when ``PTQ_RANK_POOL=1``, as tests/conftest.py sets it);
* ``rank_pool`` - preloaded rank processes that run such jobs;
* ``checkpoints`` - small random HF checkpoints (Qwen3-MoE, Nemotron-H) and a byte tokenizer;
* ``locked_build`` - a build directory made once under a lock and published by rename (tiny, models).
"""
