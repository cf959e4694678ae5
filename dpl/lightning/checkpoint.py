"""Checkpoints that never carry secrets: public ``.ckpt`` + owner-only ``.ckpt.secret`` sidecar.

Secret state - the noise and sampler generators, plugin state derived from noise (FTRL's buffers), secret
permutations - lets whoever holds it replay the batches and subtract the noise from the parameter updates,
recovering every clipped sum. dpl therefore keeps it out of the Lightning checkpoint:

* :class:`DPModule` puts its secret state under :data:`SECRET_KEY` in the checkpoint dict only when the
  trainer's checkpoint IO is a :class:`SidecarCheckpointIO` (which dpl installs at setup);
* :class:`SidecarCheckpointIO` pops that key before anything is written, writes the public checkpoint to
  ``<path>`` and the secret state to ``<path>.secret`` (created with mode 0600), both atomically (temporary
  file + ``os.replace``: a killed run never leaves a truncated checkpoint behind);
* on load it reads ``<path>.secret`` if present (of the file a link points to: ``last.ckpt`` is a link to the
  newest checkpoint where no monitor picks them), checks that it belongs to this checkpoint (a random
  ``secret_id`` written into both) and hands it back under :data:`SECRET_KEY`.

The two files cannot be replaced in one atomic step, so the sidecar keeps, beside the new checkpoint's entry, the
two before it (the checkpoint being replaced is among them). A run killed after the sidecar was written but before
the new ``.ckpt`` landed still resumes from the previous ``.ckpt`` with its own secrets.

Share the ``.ckpt`` (or the exported weights) and never the ``.secret`` file. Without the sidecar a run
resumes with fresh OS entropy (as private, not bit-exact), or is refused by a plugin that cannot continue.
"""

from __future__ import annotations

import io
import os
import secrets
import stat
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO

from dpl.errors import ConfigError

SECRET_KEY = "dpl_secret"
SECRET_SUFFIX = ".secret"


def secret_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}{SECRET_SUFFIX}")


def new_secret_id() -> str:
    return secrets.token_hex(16)


def public_mode() -> int:
    """The mode of a new public file: 0666 less the process's umask (0644 under the usual umask 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _write_atomic(data: bytes, path: Path, mode: int) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder, created with ``mode``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a writer killed mid-write
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def broken_link(path: str | os.PathLike) -> str | None:
    """The one line for a checkpoint ``path`` that links to a file no longer there (``last.ckpt`` of a run killed
    between removing the checkpoint it linked to and linking to the newer one); ``None`` for any other path."""
    path = Path(path)
    if not path.is_symlink() or path.exists():
        return None
    return (f"checkpoint {path} links to {os.readlink(path)}, which does not exist: resume from the newest .ckpt "
            f"file beside it")


def load_checkpoint_file(path: str | os.PathLike) -> dict[str, Any]:
    """``torch.load`` a checkpoint, turning a missing, truncated or corrupt file into a one-line ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(broken_link(path) or f"checkpoint {path} does not exist")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # truncated zip, garbage bytes, pickle errors
        raise ConfigError(f"checkpoint {path} is corrupt or truncated ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else 'unreadable'})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ConfigError(f"{path} is not a Lightning checkpoint")
    return checkpoint


def attach_secret(checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    """Read ``<path>.secret`` (if present) into ``checkpoint[SECRET_KEY]`` after checking that it is owner-only and
    belongs to this checkpoint (one-line ``ConfigError`` otherwise). A ``path`` that is a symbolic link (``last.ckpt``
    linked to the newest checkpoint) has the sidecar of the file it links to."""
    sidecar = secret_path(Path(path).resolve())
    if not sidecar.is_file():
        return
    mode = sidecar.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{sidecar} is readable by others (mode {oct(mode & 0o777)}): it holds the "
                          f"run's noise secrets; chmod 600 it")
    try:
        stored = torch.load(sidecar, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(f"secret sidecar {sidecar} is corrupt or truncated ({type(exc).__name__})") from None
    expected = (checkpoint.get("dpl") or {}).get("secret_id")
    match = [entry for entry in _entries(stored) if entry.get("secret_id") == expected]
    if expected is None or not match:
        raise ConfigError(f"secret sidecar {sidecar} does not belong to checkpoint {path}")
    checkpoint[SECRET_KEY] = match[-1]


def _entries(stored: Any) -> list[dict[str, Any]]:
    """The secret states in a sidecar, oldest first (``{"entries": [...]}``; a single state: one entry)."""
    entries = stored.get("entries") if isinstance(stored, dict) and "entries" in stored else [stored]
    return [entry for entry in entries if isinstance(entry, dict)] if isinstance(entries, list) else []


def _recent_entries(sidecar: Path) -> list[dict[str, Any]]:
    """The two newest entries of an existing sidecar: that of the checkpoint now beside it is among them, also
    after a run was killed between the two writes once."""
    if not sidecar.is_file():
        return []
    try:
        return _entries(torch.load(sidecar, map_location="cpu", weights_only=True))[-2:]
    except Exception:  # unreadable: nothing to keep
        return []


class SidecarCheckpointIO(CheckpointIO):
    """Writes secret state to an owner-only sidecar, never into the checkpoint; all writes are atomic.

    Wraps another :class:`CheckpointIO` for remote paths it cannot handle itself (then secrets are dropped,
    not written: only local files get a sidecar).
    """

    def __init__(self, inner: CheckpointIO | None = None) -> None:
        self.inner = inner if inner is not None else TorchCheckpointIO()

    @staticmethod
    def _is_local(path: str | os.PathLike) -> bool:
        return "://" not in os.fspath(path)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        secret = checkpoint.pop(SECRET_KEY, None)
        if not self._is_local(path):
            self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        path = Path(path)
        sidecar = secret_path(path)
        if secret is not None:  # keep the replaced checkpoint's entry until the new checkpoint has landed
            entries = [*_recent_entries(sidecar), secret]
            _write_atomic(_serialize({"entries": entries}), sidecar, stat.S_IRUSR | stat.S_IWUSR)
        elif sidecar.exists():
            sidecar.unlink()  # a stale sidecar must not pair with this checkpoint
        _write_atomic(_serialize(checkpoint), path, public_mode())

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if not self._is_local(path):
            return self.inner.load_checkpoint(path, map_location=map_location)
        checkpoint = load_checkpoint_file(path)
        attach_secret(checkpoint, path)
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        if self._is_local(path):
            for p in (Path(path), secret_path(path)):
                if p.exists() or p.is_symlink():
                    p.unlink()
        else:
            self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


#: the privacy report of the checkpoint's own state, inside the checkpoint (:mod:`dpl.lightning.report` writes it)
REPORT_KEY = "dpl_privacy_report"


def save_engine_state(engine: Any, checkpoint: dict[str, Any], trainer: Any) -> None:
    """The engine's public state into ``checkpoint`` (under ``dpl``); its secret state under :data:`SECRET_KEY` only
    when ``trainer`` writes it to an owner-only sidecar (:class:`SidecarCheckpointIO`) and the checkpoint is a full
    one (not weights-only)."""
    if not engine.configured:
        return
    secret_id = new_secret_id()
    checkpoint["dpl"] = {**engine.state_dict(), "secret_id": secret_id}
    full = "optimizer_states" in checkpoint
    if full and trainer is not None and isinstance(trainer.strategy.checkpoint_io, SidecarCheckpointIO):
        checkpoint[SECRET_KEY] = {**engine.secret_state_dict(), "secret_id": secret_id}


def load_engine_state(engine: Any, checkpoint: dict[str, Any], trainer: Any) -> bool:
    """Resume ``engine`` from ``checkpoint`` (its public state, then the secret state of its sidecar); ``False`` where
    there is nothing to resume (no dpl state, or an engine not set up: validate / test / predict need the weights
    only). ``engine.resumed_from`` names the checkpoint without a path: the id of the run that wrote it (its
    privacy report), else its file name."""
    state = checkpoint.get("dpl")
    if state is None or not engine.configured:
        return False
    run_id = ((checkpoint.get(REPORT_KEY) or {}).get("run") or {}).get("id")
    path = getattr(trainer, "ckpt_path", None) if trainer is not None else None
    engine.resumed_from = f"run {run_id}" if run_id else (Path(path).name if path else "checkpoint")
    engine.load_state_dict(state)
    engine.load_secret_state_dict(checkpoint.pop(SECRET_KEY, None))
    return True
