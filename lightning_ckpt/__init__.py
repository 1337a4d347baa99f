"""Fault-tolerant checkpointing for PyTorch Lightning: a thin adapter over ``ckpt_core``.

```python
from lightning_ckpt import DistributedCheckpoint

trainer = L.Trainer(callbacks=[DistributedCheckpoint(dirpath="s3://bucket/run1", every_n_train_steps=500,
                                                     keep_last=3, keep_every_n_steps=10_000)])
trainer.fit(model, datamodule)   # resumes by itself when dirpath holds a valid checkpoint
```
"""

from .callback import DistributedCheckpoint
from .data import LightningResumableSampler, ResumableTrainLoader
from .state import LightningTrainerState

__all__ = ["DistributedCheckpoint", "LightningResumableSampler", "LightningTrainerState", "ResumableTrainLoader"]
