"""Training learned drafters without a hub: prompts the target writes itself or that local text
supplies (``data``), the target's own answers (``data``, ``generate``), target features cached on
disk (``features``), a reduced draft vocabulary (``features``), the training loop (``trainer``),
the pipeline that runs these stages for a drafter's recipe (``pipeline``; the recipes:
``recipes``) and the calibration of a trained checkpoint (``calibrate``, ``cape``).
"""
