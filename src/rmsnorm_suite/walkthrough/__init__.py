"""The tutorial's walkthrough as commands, one module each: ``environment`` (check-environment),
``oraclecheck`` (reference), ``grids`` (check-forward, check-backward, check-gamma), ``exercise``,
``figures``, ``checkpoints`` (check-checkpoints) and ``clean``. Each has
``configure(parser, command)`` and ``run(args)``, which the CLI (:mod:`rmsnorm_suite.cli`) calls; the
helpers they share are in :mod:`rmsnorm_suite.console`.

Every command takes ``--config`` (default: the shipped ``minimum`` config) and writes its details as JSON
under the config's ``output_dir`` (``outputs/``). Commands that run the kernels take ``--device``:
``auto`` picks CUDA when torch sees a device, else the CPU under the Triton interpreter when
``TRITON_INTERPRET=1`` was set, else stops with an explanation.
"""
