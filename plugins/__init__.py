"""dpl's built-in plugins. Each is registered through the ``dpl`` entry-point group in
``pyproject.toml``, exactly as a third-party plugin package registers."""
