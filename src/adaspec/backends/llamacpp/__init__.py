"""llama.cpp through llama-cpp-python: the backend (`backend.py`) and its registration
(`runtime.py`)."""
