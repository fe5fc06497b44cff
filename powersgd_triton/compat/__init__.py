"""Every torch / Triton version gate (:mod:`.versions`) and the environment probes (:mod:`.env`: Triton importable,
its interpreter, CUDA). A new Triton version is this folder plus ``.ci/compat``."""
