"""Developer tools (not installed with the package): README/docs table regeneration (:mod:`.readme_tables`), the
ahead-of-time compile matrix (:mod:`.aot_compile`, :mod:`.aot`). Run from the repository root:
``python -m tools.readme_tables --check``, ``python -m tools.aot``."""
