"""ik_llama.cpp, the default CPU runtime: the backend (`backend.py`, the C API through
ctypes), its registration (`runtime.py`), the native build for this CPU (`build.py`) and the
source patches that build applies (`patches/`)."""
