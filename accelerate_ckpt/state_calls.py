"""``accelerator.save_state()`` / ``load_state()`` with a plugin attached: stock Accelerate's meaning, the core's
commit protocol.

* ``save_state(output_dir)`` writes the checkpoint *at* ``output_dir`` (its
  manifest and DCP shards in that directory), whatever it is called; with
  ``ProjectConfiguration(automatic_checkpoint_naming=True)`` at
  ``<project_dir>/checkpoints/checkpoint_<i>`` as stock names it. It returns
  once the checkpoint is committed on every rank (as stock returns with the
  files written), unless the plugin was made with ``async_save_state=True``.
* What ``output_dir`` held before is moved aside and deleted only once the new
  checkpoint is committed: a failed save loses nothing.
* ``load_state(input_dir)`` first waits for any save of this process still
  writing into ``input_dir`` (any ``Accelerator``, any plugin), then loads
  exactly that checkpoint (or the newest valid one under a root), moving
  nothing.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any, Optional

from ckpt_core.loop import checkpoint_target
from ckpt_core.storage import MANIFEST_NAME, get_fs, join

log = logging.getLogger("accelerate_ckpt")

ACCELERATE_FORMAT_FILES = ("model.safetensors", "pytorch_model.bin", "random_states_0.pkl", "optimizer.bin")
"""Files of a directory in Accelerate's own format (loaded by Accelerate's ``load_state``)."""

_PLUGINS: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Every attached plugin of this process: a load waits for their saves into the directory it reads."""


def register(plugin: Any) -> None:
    _PLUGINS.add(plugin)


def _norm(path: str) -> str:
    return os.path.abspath(path) if "://" not in path else path.rstrip("/")


def wait_for_saves_into(path: Optional[str]) -> None:
    """Wait for every save in flight in this process whose checkpoint lies at or under ``path`` (None: all)."""
    want = None if path is None else _norm(path)
    for plugin in list(_PLUGINS):
        writing = [p for p in plugin.writing_paths() if want is None or _norm(p) == want
                   or _norm(p).startswith(want.rstrip("/") + "/")]
        if writing:
            log.info("accelerate_ckpt: waiting for the save into %s before loading", writing[0])
            plugin.wait()


def automatic_target(plugin: Any) -> Optional[str]:
    """``<root>/checkpoint_<i>`` under ``automatic_checkpoint_naming``, else None."""
    pc = plugin.accelerator.project_configuration
    if not getattr(pc, "automatic_checkpoint_naming", False):
        return None
    root = plugin.settings.dirpath or os.path.join(plugin.accelerator.project_dir, "checkpoints")
    return join(str(root), f"checkpoint_{pc.iteration}")


def make_room(plugin: Any, path: str, automatic: bool) -> Optional[str]:
    """Move what ``path`` holds aside before a save writes there (rank 0; every rank waits); the aside, or None.

    Under automatic naming a committed checkpoint at ``path`` is refused, as
    stock refuses an existing ``checkpoint_<i>``; leftovers of a save that never
    committed are replaced.
    """
    acc = plugin.accelerator
    fs, local = get_fs(path, **plugin.settings.storage_options)
    aside, error = None, None
    if acc.is_main_process and fs.isdir(local) and fs.ls(local, detail=False):
        if automatic and fs.exists(join(local, MANIFEST_NAME)):
            error = (f"Checkpoint directory {path} ({acc.project_configuration.iteration}) already exists. "
                     "Please manually override `project_configuration.iteration` with what iteration to start "
                     "with.")
        else:
            aside = f"{local.rstrip('/')}.replaced-{int(time.time() * 1000)}"
            fs.mv(local, aside, recursive=True)
    error = _broadcast(acc, error)
    if error is not None:
        raise ValueError(error)
    return aside


def put_back(plugin: Any, aside: Optional[str], path: str) -> None:
    """Undo ``make_room`` when the save did not start (rank 0)."""
    if aside is None or not plugin.accelerator.is_main_process:
        return
    fs, local = get_fs(path, **plugin.settings.storage_options)
    if fs.exists(local):
        fs.rm(local, recursive=True)
    fs.mv(aside, local, recursive=True)


def drop_aside(plugin: Any, aside: Optional[str]) -> None:
    """Delete what a committed save replaced (rank 0)."""
    if aside is None or not plugin.accelerator.is_main_process:
        return
    fs, _ = get_fs(aside, **plugin.settings.storage_options)
    try:
        fs.rm(aside, recursive=True)
    except OSError as e:
        log.warning("accelerate_ckpt: could not delete %s (replaced by a newer checkpoint): %s", aside, e)


def _broadcast(acc: Any, value: Any) -> Any:
    """Rank 0's ``value`` on every process (also a barrier)."""
    if acc.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


def save_state(plugin: Any, output_dir: Optional[str] = None, safe_serialization: bool = True,
               **save_model_func_kwargs: Any) -> Optional[str]:
    """``accelerator.save_state`` with ``plugin`` attached.

    The checkpoint is ``output_dir`` itself; with ``automatic_checkpoint_naming``
    ``<project_dir>/checkpoints/checkpoint_<i>``; with neither, ``<dirpath>/step_<N>``.
    Returns once it is committed on every rank (``async_save_state=True``: once
    staged). ``safe_serialization`` and engine arguments do not apply (DCP shards).
    """
    step = save_model_func_kwargs.pop("step", None)
    if save_model_func_kwargs:
        log.info("accelerate_ckpt: save_state arguments %s do not apply to DCP checkpoints; ignored",
                 sorted(save_model_func_kwargs))
    plugin._check_attached()
    automatic = automatic_target(plugin)
    if automatic is not None:
        saved = plugin.save_at(automatic, step, automatic=True)
    elif output_dir is not None:
        saved = plugin.save_at(os.fspath(output_dir), step)
    else:
        saved = plugin.save(step)
    if not plugin.async_save_state:
        plugin.wait()
    return saved


def load_state(plugin: Any, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None,
               **load_model_func_kwargs: Any) -> None:
    """``accelerator.load_state`` with ``plugin`` attached.

    ``input_dir``: one checkpoint directory, whatever its name (exactly it), or a
    root (its newest valid checkpoint); omitted, the newest valid checkpoint under
    the plugin's ``dirpath``. A save of this process still writing there is waited
    for first. Nothing is moved. A directory in Accelerate's own format is loaded
    by Accelerate's ``load_state``.
    """
    plugin._check_attached()
    if input_dir is None:
        if not plugin.settings.dirpath:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        wait_for_saves_into(plugin.settings.dirpath)
        plugin.restore(step=plugin.settings.resume_step, set_aside_newer=False)
        return
    path = os.fspath(input_dir).rstrip("/")
    wait_for_saves_into(path)
    fs, local = get_fs(path, **plugin.settings.storage_options)
    if not fs.exists(local):
        raise ValueError(f"Tried to find {path} but folder does not exist")
    if any(fs.exists(join(local, f)) for f in ACCELERATE_FORMAT_FILES):
        log.info("accelerate_ckpt: %s is in Accelerate's own format; loading it with Accelerate's load_state",
                 path)
        plugin._orig["load_state"](input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)
        return
    target = checkpoint_target(path, plugin.settings.storage_options)  # one checkpoint, or a root
    plugin.restore(path=target.get("path"), dirpath=target.get("root"), set_aside_newer=False)
