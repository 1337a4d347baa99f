"""Fault-tolerant checkpointing for Hugging Face Accelerate: a thin adapter over ``ckpt_core``.

```python
from accelerate_ckpt import Accelerator, CheckpointPlugin

plugin = CheckpointPlugin(dirpath="ckpts", every_n_steps=500, keep_last=3)
accelerator = Accelerator(checkpoint_plugin=plugin)   # or plugin.attach(accelerator)
model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
plugin.resume()
for batch in plugin.dataloader(dataloader):
    ...
    plugin.step(loss=loss)
```
"""

from .accelerator import Accelerator
from .data import ShardedBatchSampler
from .counters import AcceleratedResumableLoader
from .plugin import CheckpointPlugin

__all__ = ["AcceleratedResumableLoader", "Accelerator", "CheckpointPlugin", "ShardedBatchSampler"]
