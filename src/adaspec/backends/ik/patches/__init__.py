"""Source patches `ik/build.py` applies to the pinned ik_llama.cpp before compiling it, one
module each (its NAME is recorded in the build's `build.json`), with the C++ some of them
insert beside them."""
