"""The Lightning adapter: :class:`~dpl.lightning.module.DPModule` drives the private engine from a Lightning
training loop; DDP and FSDP strategies, checkpoint I/O with the secret sidecar, progress output and the ``dpl``
command live here."""
