"""The Lightning adapter: :class:`~dpl.lightning.module.DPModule` drives the private engine from a Lightning
training loop; DDP and FSDP strategies, checkpoint I/O with the secret sidecar and progress output live here (the
``dpl`` command, which puts adapter and tasks together, is :mod:`dpl.cli`)."""
