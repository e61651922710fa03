"""DISCO (Mamou et al., "Accelerating Speculative Decoding using Dynamic Speculation
Length"): collect teacher-forced draft features, train the stop/continue classifier, tune its
threshold and SL_max by latency, save one artifact, compare with the baselines in the bench."""
