"""The private core, free of Lightning: per-example gradients and clipping, noise, sampling, mechanisms and their
accounting, the four-hook private step and the engine that runs it (:class:`~dpl.core.engine.PrivateEngine`)."""
