"""Model runtimes behind one interface (`base.ModelBackend`, `sequences.SequenceView` for a
cache of several sequences), one package each: `ik/` (ik_llama.cpp, the default on a CPU),
`llamacpp/` and `torch/`; the registry that lists them and how `fastest` picks one
(`runtimes.py`); loading (`load.py`), in a child process where a runtime wants one
(`process_backend.py`)."""
