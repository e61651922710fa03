"""Model runtimes behind one interface (`base.ModelBackend`): torch, llama.cpp and
ik_llama.cpp (in a child process), and how `fastest` picks the fastest one installed."""
