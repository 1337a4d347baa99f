"""``examples/lightning_train.py``'s model under ``LightningCLI``: checkpointing configured from the command line.

    CKPT_EVERY_N_STEPS=100 python examples/lightning_cli.py fit --trainer.max_steps=400 \\
        --trainer.callbacks+=lightning_ckpt.DistributedCheckpoint --trainer.callbacks.dirpath=ckpts

``CKPT_*`` variables, ``--trainer.callbacks.<argument>`` and
``--trainer.callbacks.settings.<setting>`` (or the same keys in a YAML config)
all reach the callback.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lightning.pytorch.cli import LightningCLI  # noqa: E402

from lightning_train import Regressor  # noqa: E402

if __name__ == "__main__":
    LightningCLI(Regressor, save_config_kwargs={"overwrite": True})
