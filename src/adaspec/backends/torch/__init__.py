"""The torch runtimes: a Hugging Face model as a backend (`backend.py`, with row-invariant
attention, `attention.py`), the static-cache runtime for one sequence (`static.py`) and for
several (`torch/static_batch.py`) over adaspec's own decoder (`decoder.py`), a restricted output
head (`restricted_head.py`), and their registrations (`runtime.py`)."""
