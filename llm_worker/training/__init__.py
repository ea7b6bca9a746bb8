"""Training learned drafters without a hub: prompts the target writes itself or that local text
supplies (``data``), the target's own answers (``data``), target features cached on disk
(``features``), a reduced draft vocabulary (``features``), and the training loop (``trainer``).
"""
