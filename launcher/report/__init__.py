"""`launch report`: the nightly runs' history, and a static page of it (no torch).

  * ``history``  one JSON record per run (``record_from_run_dir``), appended atomically to
                 ``<runs_root>/history.jsonl`` by ``launch suite`` and ``launch CONFIG --history``;
                 rebuilt from run directories (``rebuild_history``); read back (``collect``);
  * ``plots``    matplotlib figures (Agg, imported lazily) of one example's runs; each plotting
                 function returns its ``Plot`` (the figure and the PNG it wrote);
  * ``page``     the page's view of the records (failures first, the latest run per example,
                 per-example plots) and its jinja2 rendering: one HTML file plus its images;
  * ``build``    ``launch report RUNS_ROOT [--out DIR] [--since DATE] [--example GLOB]``.
"""
